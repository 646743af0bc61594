"""Reading requests off an HTTP connection (protocol.Connection): what a read brings
becomes parsed requests (message.Message), queued for their answers.

llhttp (httptools) parses them, fed in slices of a quarter of max_header_bytes so that
what it holds stays bounded: a head (431 once it outlasts slices worth max_header_bytes),
a chunked body's trailer section (its fields dropped), and the requests parsed ahead of
their answers (past max_pipelined, the rest of a read is kept as its bytes, `unfed`). A
read that holds exactly one plain request is parsed by whole.py instead, without llhttp's
callbacks, unless such reads keep missing (after WHOLE_MISSES in a row, the next
WHOLE_REST go straight to llhttp). A request llhttp or message.py refuses is answered by
the connection (_refuse), after those queued before it.
"""

from __future__ import annotations

import time

import httptools

from hybridgnn.serving.http.message import Message, Reject

WHOLE_MISSES = 8  # reads in a row whole.py could not take, after which ...
WHOLE_REST = 64  # ... this many go straight to llhttp


class RequestReader:
    """Connection's reading half, a mixin: the state it reads and writes is the
    connection's (its __slots__), and a refusal goes to the connection's _refuse."""

    __slots__ = ()

    def _parse(self, data: bytes) -> None:
        """Feed data to llhttp; a request it refuses is answered after those queued before it."""
        try:
            self._feed(data)
        except Reject as exc:  # raised here, not from a callback (those come wrapped)
            self._refuse(exc.status, str(exc))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, Reject):
                self._refuse(cause.status, str(cause))
            else:  # a bug in a callback, not the client's doing
                self.fatal = self.server.api.internal_error("HTTP parser callback", cause or exc)
                self._pause_reading()
        except httptools.HttpParserUpgrade:
            # Upgrades are not offered (RFC 9110 lets a server ignore them): answer the request
            # as plain HTTP, then close, since llhttp parses no further on this connection.
            if self.queue:
                self.queue[-1].keep_alive = False
            self.upgraded = True  # llhttp parses nothing more on this connection
            self._pause_reading()
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {str(exc)[:120] or type(exc).__name__}")

    def _whole(self, data: bytes) -> Message | None:
        """The request `data` holds whole, parsed without llhttp (whole.py says when), or None.
        After WHOLE_MISSES reads in a row it could not take (a client whose heads never
        repeat), the next WHOLE_REST reads go to llhttp without asking, so such a client
        costs llhttp's parse alone."""
        found = self.server.whole.parse(data)
        if found is None:
            self.whole_misses += 1
            if self.whole_misses >= WHOLE_MISSES:
                self.whole_misses = 0
                self.whole_rest = WHOLE_REST
            return None
        self.whole_misses = 0
        self.head_bytes = 0  # as on_message_begin: a head that ended in this read counts no more
        msg = Message(time.monotonic())
        msg.method, msg.url, msg.headers, body = found
        msg.body = [body]
        return msg

    def _feed(self, data: bytes) -> None:
        """Feed llhttp in slices of a quarter of max_header_bytes, bounding the head and the
        requests parsed. The head: llhttp holds a header field in memory until it ends, and
        a head that outlasts slices worth max_header_bytes is refused (431). A head is
        counted from the first slice after the one it began in, so what is held stays below
        1.25 × max_header_bytes; many small requests in one read never add up. A chunked
        body's trailer section is bounded the same way (its fields are dropped). The requests:
        once max_pipelined wait, the rest of the read is kept unparsed (`unfed`) and parsed
        when they are answered, so a read of thousands of tiny pipelined requests is held as
        its bytes, not as thousands of parsed ones."""
        limit = self.server.max_header_bytes
        step = self.server.head_step
        pipelined = self.server.max_pipelined
        # slices of a view: slicing the bytes would copy the rest of a large read per slice
        view = memoryview(data) if len(data) > step else data
        at, end = 0, len(data)
        while at < end:
            if len(self.queue) >= pipelined:
                self.unfed = bytes(view[at:])
                return
            cut = min(end, at + step)
            piece = view if at == 0 and cut == end else view[at:cut]
            at = cut
            if not self.in_head:
                self.parser.feed_data(piece)
                if self.after_chunk_size:
                    self.head_bytes += len(piece)
                    if self.head_bytes >= limit:
                        raise Reject(431, f"request trailer section larger than {limit} bytes")
                continue
            self.began = False
            self.parser.feed_data(piece)
            if self.in_head and not self.began:
                self.head_bytes += len(piece)
                if self.head_bytes >= limit:
                    raise Reject(431, f"request head larger than {limit} bytes")

    # --- llhttp callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.started = now = time.monotonic()
        self.msg = Message(now)
        self.in_head = True
        self.head_bytes = 0
        self.began = True

    def on_url(self, url: bytes) -> None:
        self.msg.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self.msg.add_field(name, value)
        # else a chunked body's trailer field: dropped (RFC 9110 6.5.1), never merged into
        # the header fields, where an Authorization or framing field sent late would pass
        # for one a proxy in front had seen and checked

    def on_chunk_header(self) -> None:
        self.after_chunk_size = True
        self.head_bytes = 0

    def on_headers_complete(self) -> None:
        self.in_head = False
        msg, parser, server = self.msg, self.parser, self.server
        if msg.check_head(parser.get_http_version(), server.max_header_bytes, server.max_body_bytes):
            self.continue_owed = True
        msg.method = parser.get_method().decode("ascii")
        msg.keep_alive = parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.after_chunk_size = False
        self.msg.add_body(body, self.server.max_body_bytes)

    def on_message_complete(self) -> None:
        self.msg.whole = time.monotonic()
        self.queue.append(self.msg)
        self.msg = None
        self.started = None
        self.in_head = True
        self.head_bytes = 0
        self.after_chunk_size = False
        self.continue_owed = False
        if len(self.queue) >= self.server.max_pipelined:
            self._pause_reading()
