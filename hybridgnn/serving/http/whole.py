"""A whole plain HTTP/1.1 request read at once, parsed without llhttp's callbacks.

Why: a client that waits for each answer sends each request in one piece, and parsing it
through llhttp costs a Python callback per header, per URL piece, per body piece and per
message (about a sixth of the server's CPU for a one-seed lookup). protocol.py's
Connection asks whole_request() first when it reads between requests, and feeds llhttp
as before when it answers None.

What holds: whole_request() answers only for input that llhttp parses into exactly one
request, with the same method, target, header fields (names lower-case, values without
surrounding blanks) and body, that the Connection would accept and keep alive. That is
`GET` or `POST`, an origin-form target of plain characters, `HTTP/1.1`, one to
MAX_FIELDS fields of token names and printable ASCII values, each name once, a Host
field, no Transfer-Encoding, Expect, Upgrade or Connection other than keep-alive, and a
body of exactly its Content-Length (none without one) within the server's limits.
Anything else (a partial or pipelined read, a duplicate field, a refusal to make) is
None, so llhttp and the Connection's own checks decide it as before.

A client sends the same head again and again (its Content-Length aside), so WholeRequests
keeps the heads it accepted, by their bytes: a kept head is not parsed again. Their
header fields are then one dict for every request with that head: endpoints only read a
request's headers.
"""

from __future__ import annotations

import re

WHOLE_MAX_BYTES = 8192  # a longer read is parsed by llhttp (it feeds a head in bounded slices)
HEADS_KEPT = 256  # heads kept per server; emptied when full (heads a client varies cannot grow it)
HEAD_KEPT_BYTES = 1024  # a longer head is parsed each time
MAX_FIELDS = 32
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_REQUEST = re.compile(rb"(GET|POST) (/[-A-Za-z0-9._~!$&'()*+,;=:@/?%]*) HTTP/1\.1\r\n((?:" + _TOKEN
                      + rb":[\t -~]*\r\n){1,%d})\r\n" % MAX_FIELDS)
# A field of the head _REQUEST matched, as text: its name, and its value without the blanks
# around it (words of visible characters and the blanks between them: no backtracking
# over a line of blanks).
_FIELD = re.compile("(" + _TOKEN.decode() + r"):[ \t]*((?:[!-~]+(?:[ \t]+[!-~]+)*)?)[ \t]*\r\n")
# Fields llhttp acts on (framing, keep-alive, upgrades) or the Connection judges (Expect):
# a request with one is left to them.
_LEFT_TO_LLHTTP = frozenset({"transfer-encoding", "expect", "upgrade", "proxy-connection"})

_FIELD_NAMES: dict[bytes | str, str] = {}  # header field names as sent (bytes or text) -> lower-case text, kept
_FIELD_NAMES_KEPT = 512


def field_name(name: bytes | str) -> str:
    """A header field's name as endpoints read it: lower-case text (kept: clients send the
    same few; names a client makes up cannot grow the table past _FIELD_NAMES_KEPT)."""
    key = _FIELD_NAMES.get(name)
    if key is None:
        key = (name.decode("latin-1") if type(name) is bytes else name).lower()
        if len(name) <= 64:
            if len(_FIELD_NAMES) >= _FIELD_NAMES_KEPT:
                _FIELD_NAMES.clear()
            _FIELD_NAMES[name] = key
    return key


def whole_request(data: bytes, max_header_bytes: int, max_body_bytes: int
                  ) -> tuple[str, bytes, dict[str, str], bytes] | None:
    """(method, target, header fields, body) of `data` if it is exactly one plain request
    the Connection accepts (see the module docstring), else None."""
    if len(data) > WHOLE_MAX_BYTES:
        return None
    m = _REQUEST.match(data)
    if m is None:
        return None
    head = m.group(3).decode("ascii")
    fields = _FIELD.findall(head)
    if len(fields) != head.count("\r\n"):
        return None  # cannot be (_FIELD matches every line _REQUEST does), but a field must not slip
    # The Connection's own measure of a head (each field's name and value plus 4) is at
    # most this: nearer its bound, it decides.
    if m.end() + len(fields) > max_header_bytes:
        return None
    names = _FIELD_NAMES
    headers = {names.get(name) or field_name(name): value for name, value in fields}
    if len(headers) != len(fields) or "host" not in headers or not _LEFT_TO_LLHTTP.isdisjoint(headers):
        return None
    connection = headers.get("connection")
    if connection is not None and connection.lower() != "keep-alive":
        return None
    body = data[m.end():]
    length = headers.get("content-length")
    if length is None:
        if body:
            return None
    elif not length.isdigit() or int(length) != len(body) or len(body) > max_body_bytes:
        return None
    return m.group(1).decode("ascii"), m.group(2), headers, body


class WholeRequests:
    """whole_request() for one server's limits, with the heads it accepted kept (see the
    module docstring)."""

    def __init__(self, max_header_bytes: int, max_body_bytes: int):
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self._kept: dict[bytes, tuple[str, bytes, dict[str, str], int]] = {}

    def parse(self, data: bytes) -> tuple[str, bytes, dict[str, str], bytes] | None:
        """whole_request(data) for this server's limits."""
        if len(data) > WHOLE_MAX_BYTES:
            return None
        end = data.find(b"\r\n\r\n")  # a kept head ends at the first empty line (no field is empty)
        if end < 0:
            return None
        kept = self._kept.get(data[:end])
        if kept is not None:
            method, target, headers, length = kept
            if len(data) - end - 4 != length:
                return None
            return method, target, headers, data[end + 4:]
        found = whole_request(data, self.max_header_bytes, self.max_body_bytes)
        if found is not None and end <= HEAD_KEPT_BYTES and len(found[3]) == len(data) - end - 4:
            if len(self._kept) >= HEADS_KEPT:
                self._kept.clear()
            self._kept[data[:end]] = (found[0], found[1], found[2], len(found[3]))
        return found
