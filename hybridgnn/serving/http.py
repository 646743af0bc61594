"""The built-in HTTP/1.1 front end: an asyncio protocol on uvloop that parses requests
itself and answers through serving/api.py (the default; `--http-server aiohttp` is the
alternative).

Why its own: at one seed per request the front end, not the model, bounds a batching
server on a few cores; aiohttp's request/response objects, router and task per request
cost ~140 µs more event-loop CPU per request than this server (bench/http_frontend.py at
1,500 req/s) and halve the served throughput. Here a request costs one buffer scan, a
header split and one write; an inference is answered from a future callback, with no task.

What holds: HTTP/1.1 and 1.0, keep-alive, pipelined requests answered in order (one at
a time per connection), Content-Length and chunked bodies, Expect: 100-continue, HEAD.
Limits answer with a JSON error and close the connection: a head over max_header_bytes
→ 431, a body over max_body_bytes → 413, a malformed request → 400, a transfer coding
other than chunked → 501. Connections idle (or stuck mid-request) longer than
idle_timeout_s are closed. Nothing a client sends raises out of the protocol.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from http import HTTPStatus
from string import hexdigits

from hybridgnn.serving.api import Api, Reply, Request

log = logging.getLogger(__name__)

_HEX = frozenset(hexdigits.encode())
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_CHUNK_LINE = 1024
_PAUSE_READING_BYTES = 1 << 20  # buffered bytes (pipelined requests) that stop reading while one is answered


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Date:
    """The Date header value, formatted once a second."""

    def __init__(self):
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode()
        return self._value


class HttpServer:
    """Listens on host:port and serves `api` until closed."""

    def __init__(self, api: Api, *, max_body_bytes: int, max_header_bytes: int = 64 * 1024,
                 idle_timeout_s: float = 75.0):
        self.api = api
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[_Connection] = set()
        self.closing = False
        self.date = _Date()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                backlog=4096)
        self._sweeper = loop.create_task(self._sweep_idle())

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def draining(self) -> bool:
        return self.closing or self.api.engine.draining

    async def _sweep_idle(self) -> None:
        period = max(0.05, min(5.0, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            cutoff = time.monotonic() - self.idle_timeout_s
            for conn in [c for c in self.connections if not c.busy and c.last_active < cutoff]:
                conn.close()

    async def close(self, timeout_s: float) -> None:
        """Stop listening, close idle connections, let in-flight answers go out (each with
        "Connection: close") for up to timeout_s, then drop what is left."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        for conn in [c for c in self.connections if not c.busy]:
            conn.close()
        deadline = time.monotonic() + timeout_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests from the byte stream and answers them in order."""

    __slots__ = ("server", "transport", "buf", "head", "body_left", "chunks", "chunk_left", "chunk_total",
                 "busy", "closed", "eof", "write_paused", "read_paused", "last_active", "discard_left")

    def __init__(self, server: HttpServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head = None  # (method, target, keep_alive, headers) of the request whose body is being read
        self.body_left = 0  # Content-Length body: bytes still to come
        self.chunks: list[bytes] | None = None  # chunked body: chunks so far (None: not chunked)
        self.chunk_left: int | None = None  # chunked: None = size line next, -1 = trailers, n = chunk bytes
        self.chunk_total = 0
        self.busy = False  # a request is being answered; later ones wait in buf
        self.closed = False
        self.eof = False  # the client sent FIN: close once what it asked is answered
        self.write_paused = False
        self.read_paused = False
        self.discard_left = 0  # after a 413: body bytes to drop before closing
        self.last_active = time.monotonic()

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._advance()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_active = time.monotonic()
        if self.discard_left:
            self.discard_left -= min(self.discard_left, len(data))
            if not self.discard_left:
                self.close()
            return
        self.buf += data
        self._advance()

    def eof_received(self) -> bool:
        # The client will send nothing more: answer what is in flight, then close.
        self.eof = True
        if not self.busy:
            self.close()
            return False
        return True

    # --- parsing ------------------------------------------------------------------------
    def _advance(self) -> None:
        """Parse and answer buffered requests until one is in flight or the buffer runs out."""
        try:
            while not (self.busy or self.closed or self.write_paused):
                if self.head is None and not self._read_head():
                    break
                body = self._read_body()
                if body is None:
                    break
                method, target, keep_alive, headers = self.head
                self.head = None
                self._answer(method, target, keep_alive, headers, body)
            if self.eof and not self.busy:
                self.close()
            if self.busy and len(self.buf) > _PAUSE_READING_BYTES and not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()
        except _BadRequest as exc:
            discard = max(0, self.body_left - len(self.buf)) if exc.status == 413 else 0
            self._write(Reply.error(exc.status, str(exc)), keep_alive=False, then_close=not discard)
            if discard:
                # Take in (and drop) the rest of the declared body so the client reads the 413
                # instead of a reset; close once it is in, or when the idle sweep ends it.
                self.discard_left = discard
                self.buf.clear()
        except Exception:  # a bug, not the client's: answer 500 and drop this connection only
            log.exception("HTTP protocol error")
            self._write(Reply.error(500, "internal server error"), keep_alive=False)
            self.close()

    def _read_head(self) -> bool:
        buf = self.buf
        while buf.startswith(b"\r\n"):  # stray line ends between requests are allowed
            del buf[:2]
        end = buf.find(b"\r\n\r\n")
        limit = self.server.max_header_bytes
        if end < 0:
            if len(buf) > limit:
                raise _BadRequest(431, f"request head larger than {limit} bytes")
            return False
        if end > limit:
            raise _BadRequest(431, f"request head larger than {limit} bytes")
        text = buf[:end].decode("latin-1")
        del buf[:end + 4]
        lines = text.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[0] or not _TOKEN.issuperset(parts[0]):
            raise _BadRequest(400, f"malformed request line {lines[0][:100]!r}")
        method, target, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            if version.startswith("HTTP/"):
                raise _BadRequest(505, f"HTTP version {version[:20]!r} not supported (1.0 and 1.1 are)")
            raise _BadRequest(400, f"malformed request line {lines[0][:100]!r}")
        if not target.startswith("/"):
            raise _BadRequest(400, f"request target must be a path, got {target[:100]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or not _TOKEN.issuperset(name):
                raise _BadRequest(400, f"malformed header line {line[:100]!r}")
            name = name.lower()
            value = value.strip(" \t")
            # Repeated headers join as a list; a repeated Content-Length then fails to parse (no smuggling).
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        self._frame_body(headers)
        self.head = (method, target, keep_alive, headers)
        return True

    def _frame_body(self, headers: dict[str, str]) -> None:
        limit = self.server.max_body_bytes
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if "content-length" in headers:
                raise _BadRequest(400, "a request must not carry both Transfer-Encoding and Content-Length")
            if coding.lower() != "chunked":
                raise _BadRequest(501, f"transfer coding {coding[:50]!r} not supported (chunked is)")
            self.chunks, self.chunk_left, self.chunk_total = [], None, 0
        else:
            length = headers.get("content-length", "0")
            if not (length.isascii() and length.isdigit()):
                raise _BadRequest(400, f"bad Content-Length {length[:50]!r}")
            self.body_left = int(length)
            if self.body_left > limit:
                raise _BadRequest(413, f"request body too large (limit {limit} bytes)")
        expect = headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                raise _BadRequest(417, f"unsupported expectation {expect[:50]!r}")
            if (self.body_left > len(self.buf)) or (self.chunks is not None and not self.buf):
                self.transport.write(_CONTINUE)

    def _read_body(self) -> bytes | None:
        """The current request's body once all of it is buffered, else None."""
        if self.chunks is not None:
            return self._read_chunked()
        n = self.body_left
        if not n:
            return b""
        buf = self.buf
        if len(buf) < n:
            return None
        body = bytes(buf[:n]) if len(buf) > n else bytes(buf)
        del buf[:n]
        self.body_left = 0
        return body

    def _read_chunked(self) -> bytes | None:
        buf = self.buf
        limit = self.server.max_body_bytes
        while True:
            if self.chunk_left is None:  # a size line: hex size, optional ;extensions
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > _MAX_CHUNK_LINE:
                        raise _BadRequest(400, "malformed chunk size line")
                    return None
                size = bytes(buf[:end]).split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 15 or not _HEX.issuperset(size):
                    raise _BadRequest(400, f"malformed chunk size {size[:20]!r}")
                del buf[:end + 2]
                n = int(size, 16)
                self.chunk_total += n
                if self.chunk_total > limit:
                    raise _BadRequest(413, f"request body too large (limit {limit} bytes)")
                self.chunk_left = n if n else -1
            elif self.chunk_left == -1:  # trailer fields, ended by an empty line
                if buf.startswith(b"\r\n"):
                    del buf[:2]
                else:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > self.server.max_header_bytes:
                            raise _BadRequest(431, "chunked trailers too large")
                        return None
                    del buf[:end + 4]
                body = b"".join(self.chunks)
                self.chunks, self.chunk_left = None, None
                return body
            else:
                n = self.chunk_left
                if len(buf) < n + 2:
                    return None
                if buf[n:n + 2] != b"\r\n":
                    raise _BadRequest(400, "chunk data not followed by CRLF")
                self.chunks.append(bytes(buf[:n]))
                del buf[:n + 2]
                self.chunk_left = None

    # --- answering ----------------------------------------------------------------------
    def _answer(self, method: str, target: str, keep_alive: bool, headers: dict[str, str], body: bytes) -> None:
        head_only = method == "HEAD"
        found = self.server.api.route(method, target.split("?", 1)[0])
        if isinstance(found, Reply):
            self._write(found, keep_alive, head_only)
            return
        endpoint, params = found
        try:
            reply = endpoint(Request(params, headers, body))
        except Exception:
            log.exception("unhandled error on %s %s", method, target)
            reply = Reply.error(500, "internal server error")
        if isinstance(reply, Reply):
            self._write(reply, keep_alive, head_only)
            return
        if not isinstance(reply, asyncio.Future):
            reply = asyncio.ensure_future(reply)
        self.busy = True
        reply.add_done_callback(lambda fut: self._answered(fut, keep_alive, head_only))

    def _answered(self, fut: asyncio.Future, keep_alive: bool, head_only: bool) -> None:
        self.busy = False
        if self.closed:
            return  # the client left; its request was still served to completion
        if fut.cancelled() or fut.exception() is not None:
            if not fut.cancelled():
                log.error("unhandled error answering a request", exc_info=fut.exception())
            reply = Reply.error(500, "internal server error")
        else:
            reply = fut.result()
        self._write(reply, keep_alive, head_only)
        if self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()
        self._advance()

    def _write(self, reply: Reply, keep_alive: bool, head_only: bool = False, then_close: bool = True) -> None:
        """Send reply; without keep-alive it says "Connection: close" and (then_close) closes."""
        if self.closed:
            return
        server = self.server
        keep_alive = keep_alive and not server.draining()
        body = reply.body
        parts = [_STATUS_LINES.get(reply.status) or f"HTTP/1.1 {reply.status} Unknown\r\n".encode(),
                 b"Content-Type: ", reply.content_type.encode(), b"\r\nContent-Length: ", str(len(body)).encode(),
                 b"\r\nDate: ", server.date.get(), b"\r\nServer: hybridgnn\r\n"]
        if reply.headers:
            parts.extend(f"{k}: {v}\r\n".encode() for k, v in reply.headers.items())
        parts.append(b"Connection: keep-alive\r\n\r\n" if keep_alive else b"Connection: close\r\n\r\n")
        if not head_only:
            parts.append(body)
        self.transport.write(b"".join(parts))
        self.last_active = time.monotonic()
        if not keep_alive and then_close:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.connections.discard(self)
            self.transport.close()  # flushes what is buffered first

    def abort(self) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.transport.abort()
