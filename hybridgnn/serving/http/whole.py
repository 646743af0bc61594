"""A whole plain HTTP/1.1 request read at once, parsed without llhttp's callbacks.

Why: a client that waits for each answer sends each request in one piece, and parsing it
through llhttp costs a Python callback per header, per URL piece, per body piece and per
message (about a sixth of the server's CPU for a one-seed lookup). protocol.py's
Connection asks WholeRequests.parse() first when it reads between requests, and feeds
llhttp as before when it answers None.

What holds: whole_request() answers only for input that llhttp parses into exactly one
request, with the same method, target, header fields (names lower-case, values without
surrounding blanks) and body, that the Connection would accept and keep alive. That is
`GET` or `POST`, an origin-form target of plain characters, `HTTP/1.1`, one to
MAX_FIELDS fields of token names and printable ASCII values, each name once, a Host
field, no Transfer-Encoding, Expect, Upgrade or Connection other than keep-alive, and a
body of exactly its Content-Length (none without one) within the server's limits.
Anything else (a partial or pipelined read, a duplicate field, a refusal to make) is
None, so llhttp and the Connection's own checks decide it as before.

What it saves comes from repetition: a client sends the same head again and again (its
Content-Length aside). WholeRequests keeps what it made of a head (HEADS_KEPT heads, by
their bytes), so a kept head is not parsed again; the header fields are then one dict for
every request with that head (endpoints only read a request's headers). A head seen for
the first time is left to llhttp, and only parsed here when it comes again. A head is
kept by its bytes without the values of PER_REQUEST_FIELDS (a tracing client's request id,
new in every request): a head that differs from a kept one only there is the kept one with
its own values (checked as _HEAD checks a value). A client whose heads never repeat
otherwise costs llhttp's parse and a set lookup.
"""

from __future__ import annotations

import re

WHOLE_MAX_BYTES = 8192  # a longer read is parsed by llhttp (it feeds a head in bounded slices)
HEADS_KEPT = 256  # heads kept per server; emptied when full (heads a client varies cannot grow it)
HEADS_SEEN = 1024  # heads seen once, remembered until they come again; emptied when full
HEAD_KEPT_BYTES = 1024  # a longer head is always llhttp's
MAX_FIELDS = 32
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_HEAD = re.compile(rb"(GET|POST) (/[-A-Za-z0-9._~!$&'()*+,;=:@/?%]*) HTTP/1\.1\r\n((?:" + _TOKEN
                   + rb":[\t -~]*\r\n){0,%d}" % (MAX_FIELDS - 1) + _TOKEN + rb":[\t -~]*)")
# A field of the head _HEAD matched (each line ending in CRLF), as text: its name, and its
# value without the blanks around it (words of visible characters and the blanks between
# them: no backtracking over a line of blanks).
_FIELD = re.compile("(" + _TOKEN.decode() + r"):[ \t]*((?:[!-~]+(?:[ \t]+[!-~]+)*)?)[ \t]*\r\n")
# Fields llhttp acts on (framing, keep-alive, upgrades) or the Connection judges (Expect):
# a request with one is left to them.
_LEFT_TO_LLHTTP = frozenset({"transfer-encoding", "expect", "upgrade", "proxy-connection"})

# Fields a client may set anew in every request (a tracing client's request id): a head is
# kept without their values. A field line of one, with a value _HEAD takes (one that it
# would not is left in the head, which plain_head then refuses: llhttp's).
PER_REQUEST_FIELDS = ("x-request-id", "traceparent")
_PER_REQUEST = re.compile(rb"\r\n(" + "|".join(PER_REQUEST_FIELDS).encode() + rb"):([\t -~]*)(?=\r\n|\Z)",
                          re.IGNORECASE)

# Header field names as sent -> lower-case text, kept: llhttp's (bytes) and _FIELD's (text)
# apart (b"Host" and "Host" hash alike: one table would compare them, a BytesWarning under -b).
FIELD_NAMES: dict[bytes, str] = {}
_TEXT_NAMES: dict[str, str] = {}
FIELD_NAMES_KEPT = 512


def field_name(name: bytes | str) -> str:
    """A header field's name as endpoints read it: lower-case text (kept: clients send the
    same few; names a client makes up cannot grow a table past FIELD_NAMES_KEPT)."""
    kept = FIELD_NAMES if type(name) is bytes else _TEXT_NAMES
    key = kept.get(name)
    if key is None:
        key = (name.decode("latin-1") if type(name) is bytes else name).lower()
        if len(name) <= 64:
            if len(kept) >= FIELD_NAMES_KEPT:
                kept.clear()
            kept[name] = key
    return key


def plain_head(head: bytes, max_header_bytes: int, max_body_bytes: int
               ) -> tuple[str, bytes, dict[str, str], int] | None:
    """(method, target, header fields, body length) of a request head (its bytes before the
    empty line) if the Connection accepts it as a plain request (the module docstring
    says which), else None."""
    m = _HEAD.fullmatch(head)
    if m is None:
        return None
    block = m.group(3).decode("ascii") + "\r\n"
    fields = _FIELD.findall(block)
    if len(fields) != block.count("\r\n"):
        return None  # cannot be (_FIELD matches every line _HEAD does), but a field must not slip
    # The Connection's own measure of a head (each field's name and value plus 4) is at
    # most this: nearer its bound, it decides.
    if len(head) + 4 + len(fields) > max_header_bytes:
        return None
    names = _TEXT_NAMES
    headers = {names.get(name) or field_name(name): value for name, value in fields}
    if len(headers) != len(fields) or "host" not in headers or not _LEFT_TO_LLHTTP.isdisjoint(headers):
        return None
    connection = headers.get("connection")
    if connection is not None and connection.lower() != "keep-alive":
        return None
    length = headers.get("content-length")
    if length is None:
        size = 0
    elif not length.isdigit() or len(length) > 18 or int(length) > max_body_bytes:
        return None
    else:
        size = int(length)
    return m.group(1).decode("ascii"), m.group(2), headers, size


def whole_request(data: bytes, max_header_bytes: int, max_body_bytes: int
                  ) -> tuple[str, bytes, dict[str, str], bytes] | None:
    """(method, target, header fields, body) of `data` if it is exactly one plain request
    the Connection accepts (see the module docstring), else None."""
    if len(data) > WHOLE_MAX_BYTES:
        return None
    end = data.find(b"\r\n\r\n")  # a plain head ends at the first empty line (no field is empty)
    found = plain_head(data[:end], max_header_bytes, max_body_bytes) if end >= 0 else None
    if found is None or len(data) - end - 4 != found[3]:
        return None
    return found[0], found[1], found[2], data[end + 4:]


def per_request_cut(head: bytes) -> tuple[bytes, list[tuple[str, bytes]]] | None:
    """(the head without the values of its PER_REQUEST_FIELDS, [(name, value as sent)]), or
    None when it has none. Every such field is cut: a head with one twice is one that
    plain_head refuses, so its key is kept as llhttp's."""
    found = _PER_REQUEST.search(head)
    if found is None:
        return None
    start, end = found.span(2)
    values = [(found.group(1).lower().decode("ascii"), found.group(2))]
    found = _PER_REQUEST.search(head, end)
    if found is None:  # one such field (a client sets one)
        return head[:start] + head[end:], values
    pieces = [head[:start]]
    while found is not None:
        pieces.append(head[end:found.start(2)])
        values.append((found.group(1).lower().decode("ascii"), found.group(2)))
        end = found.end(2)
        found = _PER_REQUEST.search(head, end)
    pieces.append(head[end:])
    return b"".join(pieces), values


class WholeRequests:
    """whole_request() for one server's limits, with what it made of heads kept (see the
    module docstring): parse(data) is None or whole_request(data) (the tests hold it to it)."""

    def __init__(self, max_header_bytes: int, max_body_bytes: int):
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        # head -> plain_head()'s answer, or False for a head left to llhttp: heads without
        # per-request fields by their bytes (a hit is such a head: one lookup, as before
        # there were others), those with them by their cut (per_request_cut)
        self._kept: dict[bytes, tuple[str, bytes, dict[str, str], int] | bool] = {}
        self._kept_cut: dict[bytes, tuple[str, bytes, dict[str, str], int] | bool] = {}
        self._seen: set[bytes] = set()

    def parse(self, data: bytes) -> tuple[str, bytes, dict[str, str], bytes] | None:
        """whole_request(data) for this server's limits, or None for a head seen the first
        time (llhttp parses it)."""
        if len(data) > WHOLE_MAX_BYTES:
            return None
        end = data.find(b"\r\n\r\n")
        if end < 0 or end > HEAD_KEPT_BYTES:
            return None
        head = data[:end]
        kept = self._kept.get(head)
        if kept is None:
            cut = per_request_cut(head)
            if cut is None:
                kept = self._keep(head, head, self._kept)
                if kept is None:
                    return None
            else:
                kept = self._kept_cut.get(cut[0])
                if kept is None:
                    kept = self._keep(head, cut[0], self._kept_cut)
                    if kept is None:
                        return None
                return self._with_values(kept, cut[1], head, data, end)
        if kept is False or len(data) - end - 4 != kept[3]:
            return None
        return kept[0], kept[1], kept[2], data[end + 4:]

    def _keep(self, head: bytes, key: bytes, kept: dict):
        """plain_head(head) kept under key if key was seen before (None: seen now, the
        first time; llhttp parses it)."""
        if key not in self._seen:
            if len(self._seen) >= HEADS_SEEN:
                self._seen.clear()
            self._seen.add(key)
            return None
        self._seen.discard(key)
        if len(kept) >= HEADS_KEPT:
            kept.clear()
        found = kept[key] = plain_head(head, self.max_header_bytes, self.max_body_bytes) or False
        return found

    def _with_values(self, kept, values: list[tuple[str, bytes]], head: bytes, data: bytes, end: int):
        """The kept head's parse with this head's own per-request values."""
        if kept is False or len(data) - end - 4 != kept[3]:
            return None
        headers = kept[2].copy()
        for name, value in values:  # values _HEAD takes (per_request_cut's)
            headers[name] = value.strip(b" \t").decode("ascii")
        if len(head) + 4 + len(headers) > self.max_header_bytes:
            return None  # this head's values take it nearer the bound: the Connection decides
        return kept[0], kept[1], headers, data[end + 4:]
