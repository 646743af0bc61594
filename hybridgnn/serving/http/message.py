"""One HTTP/1.1 request as the connection (protocol.py) parses it, and the rules its head
and body must meet: what is refused while parsing (Reject), and the request held until
it is answered (Message).
"""

from __future__ import annotations

from hybridgnn.serving.http.whole import FIELD_NAMES, field_name

# Header fields per request (trailers included), as Apache's LimitRequestFields: each costs a
# parser callback, and a 60 KiB head of 10,000 tiny fields held the loop 15 ms.
MAX_HEADER_FIELDS = 100


class Reject(Exception):
    """A request the server refuses while parsing: answered, then the connection closes."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Message:
    """A request being parsed, then waiting for its answer."""

    __slots__ = ("url", "headers", "hosts", "body", "body_size", "method", "keep_alive", "http10", "head_size",
                 "fields", "received", "whole")

    def __init__(self, received: float):
        self.url = b""
        self.headers: dict[str, str] = {}
        self.hosts = 0
        self.body: list = []  # none, or one item: the body (a bytearray once it came in pieces)
        self.body_size = 0
        self.method = ""
        self.keep_alive = True
        self.http10 = False
        self.head_size = 0  # the head's fields, as parsed (the feed-level bound catches one never ending)
        self.fields = 0  # header fields parsed (trailers too)
        self.received = received  # its first byte was read (parsed) then (monotonic)
        self.whole = received  # ... and its last (a request read in one piece: the same)

    def add_field(self, name: bytes, value: bytes) -> None:
        """One header field as llhttp parsed it (Reject past MAX_HEADER_FIELDS)."""
        key = FIELD_NAMES.get(name) or field_name(name)  # called per field: the kept name inline
        self.head_size += len(name) + len(value) + 4
        self.fields += 1
        if self.fields > MAX_HEADER_FIELDS:
            raise Reject(431, f"more than {MAX_HEADER_FIELDS} header fields")
        headers = self.headers
        if key == "host":
            self.hosts += 1
        text = value.decode("latin-1").strip(" \t")
        # Repeated fields join as a list (RFC 9110 §5.3); a repeated single value then fails to parse.
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def check_head(self, version: str, max_header_bytes: int, max_body_bytes: int) -> bool:
        """Reject unless the parsed head is one this server takes; whether a 100 Continue is
        owed (the client waits for it before sending its body)."""
        if self.head_size + len(self.url) > max_header_bytes:
            raise Reject(431, f"request head larger than {max_header_bytes} bytes")
        if version not in ("1.1", "1.0"):
            raise Reject(505, f"HTTP version {version!r} not supported (1.0 and 1.1 are)")
        self.http10 = version == "1.0"
        if not self.http10 and self.hosts != 1:
            raise Reject(400, "an HTTP/1.1 request needs exactly one Host header")
        headers = self.headers
        length = headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):
            raise Reject(400, f"bad Content-Length {length[:50]!r}")  # llhttp checks too; never trust int()
        if length is not None and int(length) > max_body_bytes:
            raise Reject(413, f"request body too large (limit {max_body_bytes} bytes)")
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.lower() != "chunked":
            # llhttp frames "gzip, chunked" by its chunks: the body would reach the endpoint still coded
            raise Reject(400, f"unsupported transfer coding {coding[:50]!r} (only chunked is)")
        expect = headers.get("expect")
        if expect is None:
            return False
        if expect.lower() != "100-continue":
            raise Reject(417, f"unsupported expectation {expect[:50]!r}")
        return length != "0" and not self.http10  # an HTTP/1.0 client knows no 100 (RFC 9110 §10.1.1)

    def add_body(self, body: bytes, max_body_bytes: int) -> None:
        """A piece of the body (Reject past max_body_bytes)."""
        self.body_size += len(body)
        if self.body_size > max_body_bytes:
            raise Reject(413, f"request body too large (limit {max_body_bytes} bytes)")
        parts = self.body
        if not parts:
            parts.append(body)  # most bodies come in one piece: kept as it is
        else:
            # One buffer, not a bytes object per piece: llhttp calls this once per chunk, and
            # a body of two-byte chunks held as objects took twenty times its size.
            if type(parts[0]) is bytes:
                parts[0] = bytearray(parts[0])
            parts[0] += body

    def body_bytes(self) -> bytes:
        body = self.body[0] if self.body else b""
        return body if type(body) is bytes else bytes(body)  # a body that came in pieces
