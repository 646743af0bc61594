"""The HTTP/1.1 server: listens, keeps the connections (protocol.py's Connection, one per
client), sweeps their timeouts, caps their number and closes them all in order. What
holds for each connection is said in protocol.py."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import socket
import time
from collections.abc import Callable
from http import HTTPStatus

from hybridgnn.capabilities import connection_limit
from hybridgnn.serving.core.access import enable_access_log
from hybridgnn.serving.http.access import log_http
from hybridgnn.serving.http.message import Message
from hybridgnn.serving.http.protocol import Connection
from hybridgnn.serving.http.reply import RETRY, Reply, Routes
from hybridgnn.serving.http.turns import Turns, standing_queue_limits
from hybridgnn.serving.http.whole import WholeRequests

log = logging.getLogger("hybridgnn.serving.http.protocol")
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_ROUTES_KEPT = 1024
_KEEP_ALIVE = b"Connection: keep-alive\r\n\r\n"
_CLOSE = b"Connection: close\r\n\r\n"
_ROUTE_TARGET_KEPT = 256  # bytes


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

    def __init__(self, api: Routes, *, max_body_bytes: int, max_header_bytes: int = 64 * 1024,
                 idle_timeout_s: float = 75.0, request_timeout_s: float = 30.0, max_connections: int = 10_000,
                 max_pipelined: int = 8, answers_per_turn: int = 64,
                 queue_bound_s: float = float("inf"), listeners: int = 1, access_log: bool = False,
                 on_refused_connection: Callable[[], None] | None = None):
        """access_log: one line per answer on the `hybridgnn.access` logger (http/access.py).
        on_refused_connection: called for each connection refused past the cap (a metric)."""
        self.api = api
        self.access_log = access_log
        if access_log:
            enable_access_log()
        self.turns = Turns(answers_per_turn, *standing_queue_limits(queue_bound_s))
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.head_step = max(1, max_header_bytes // 4)  # a head is fed to llhttp in slices of this many bytes
        self.whole = WholeRequests(max_header_bytes, max_body_bytes)  # one whole request in a read, parsed at once
        self.routes: dict[tuple[str, bytes], tuple] = {}  # (method, request target) -> the API's route (keep_route)
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_connections = connection_limit(max_connections, listeners)  # listeners: 2 beside gRPC
        self.max_pipelined = max_pipelined
        self.retry = RETRY
        self.connections: set[Connection] = set()
        self.refused_connections = 0
        self._on_refused_connection = on_refused_connection
        self.closing = False
        self.date = _Date()
        self._kept: dict[tuple[Reply, bool, bool], bytes] = {}  # encode's of shared replies, for the current Date
        self._kept_date = b""
        self._heads: dict[tuple[int, str], tuple[bytes, bytes]] = {}  # head_parts', for the current Date
        self._heads_date = b""
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    def refused_connection(self) -> None:
        """Count a connection refused past the cap (the metric too, when one is given)."""
        self.refused_connections += 1
        if self._on_refused_connection is not None:
            self._on_refused_connection()

    def encode(self, reply: Reply, keep_alive: bool, head_only: bool = False) -> bytes:
        """An answer's bytes. A shared Reply (Reply.shared) is encoded once per Date second
        for each connection mode: it answers many requests alike."""
        if not reply.shared:
            return self._encode(reply, keep_alive, head_only)
        date = self.date.get()
        if date is not self._kept_date:
            self._kept.clear()
            self._kept_date = date
        key = (reply, keep_alive, head_only)
        wire = self._kept.get(key)
        if wire is None:
            wire = self._kept[key] = self._encode(reply, keep_alive, head_only)
        return wire

    def send(self, transport, reply: Reply, msg: Message | None, keep_alive: bool, head_only: bool = False) -> None:
        """Write an answer on a connection's transport, and its access-log line when this
        server keeps one (msg None: an answer to no whole request)."""
        wire = self.encode(reply, keep_alive, head_only)
        transport.write(wire)
        if self.access_log:
            log_http(transport, msg, reply.status, len(wire))

    def _encode(self, reply: Reply, keep_alive: bool, head_only: bool) -> bytes:
        start, rest = self.head_parts(reply.status, reply.content_type)
        if reply.headers:
            rest += b"".join(f"{k}: {v}\r\n".encode() for k, v in reply.headers.items())
        return b"%s%d%s%s%s" % (start, len(reply.body), rest, _KEEP_ALIVE if keep_alive else _CLOSE,
                                b"" if head_only else reply.body)

    def keep_route(self, method: str, target: bytes, found: tuple) -> None:
        """Keep the API's route for a request target (short ones: a client can make up any
        number of them, so the table is emptied when full)."""
        if len(target) <= _ROUTE_TARGET_KEPT:
            if len(self.routes) >= _ROUTES_KEPT:
                self.routes.clear()
            self.routes[(method, target)] = found

    def head_parts(self, status: int, content_type: str) -> tuple[bytes, bytes]:
        """An answer's head around its Content-Length value: (status line, Content-Type and
        the field name; the rest of that line, Date and Server), made once per second for
        each status and content type (the server's own replies name a handful)."""
        date = self.date.get()
        if date is not self._heads_date:
            self._heads.clear()
            self._heads_date = date
        key = (status, content_type)
        parts = self._heads.get(key)
        if parts is None:
            line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()
            parts = self._heads[key] = (line + b"Content-Type: " + content_type.encode() + b"\r\nContent-Length: ",
                                        b"\r\nDate: " + date + b"\r\nServer: hybridgnn\r\n")
        return parts

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> None:
        """Listen on host:port. reuse_port: beside the other front-end processes on that
        port (SO_REUSEPORT: the kernel spreads new connections over them)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host, port, reuse_address=True,
                                                reuse_port=reuse_port or None, backlog=4096)
        self._sweeper = loop.create_task(self._sweep())

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def draining(self) -> bool:
        return self.closing or self.api.draining

    async def _sweep(self) -> None:
        """Close idle connections, time out slow requests and stuck readers. A sweep over
        all connections twice a second costs less than a timer per request."""
        period = max(0.05, min(0.5, self.request_timeout_s / 4, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.check_timeouts(now)

    async def close(self, timeout_s: float) -> None:
        """Take in what waits in the listen backlog, stop listening, close idle connections,
        let in-flight answers go out (each with "Connection: close") for up to timeout_s,
        then answer what is left 503 and close."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._server is not None:
            listeners = [socket.socket(fileno=os.dup(s.fileno())) for s in self._server.sockets]
            self._server.close()
            # The duplicated descriptors keep the sockets listening: accept what completed its
            # handshake already, so those clients get a 503 instead of a reset.
            loop = asyncio.get_running_loop()
            for lsock in listeners:
                lsock.setblocking(False)
                while True:
                    try:
                        conn, _ = lsock.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    conn.setblocking(False)
                    await loop.connect_accepted_socket(lambda: Connection(self), conn)
                lsock.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        deadline = time.monotonic() + timeout_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.give_up()
        if self._server is not None:
            await self._server.wait_closed()


