"""The HTTP/1.1 connection: one asyncio protocol per connection on uvloop (server.py
listens and keeps them), requests parsed by llhttp (httptools), or by whole.py when one
read holds exactly one plain request (reading.py feeds them), answers from
serving/http/api.py.

Why its own server: at one seed per request the front end, not the model, bounds a
batching server on a few cores. Here a request costs the parser's callbacks and one
write; an inference is answered from a future callback, with no task per request.

What holds:
- HTTP/1.1 and 1.0, keep-alive, pipelining (answers in order, one in flight per
  connection), Content-Length and chunked bodies, Expect: 100-continue, HEAD.
- Whatever llhttp rejects is a 400; an HTTP/1.1 request without exactly one Host is a
  400, and so is a transfer coding other than chunked alone; a head over
  max_header_bytes or of more than MAX_HEADER_FIELDS fields is a 431, a body over
  max_body_bytes a 413; other HTTP versions 505.
  Each such answer is JSON and closes the connection, after the answers to the requests
  before it.
- Memory per connection is bounded: once `max_pipelined` requests are parsed and wait,
  the bytes read past them wait unparsed until those are answered (llhttp is fed in
  slices of a quarter of max_header_bytes, so a slice more may have been parsed), and
  reading pauses while they wait or the write buffer is over its high-water mark (a
  client that sends and never reads holds at most a few hundred KiB, however small its
  requests).
- Connections are capped (`max_connections`; past it a new one gets 503 + Retry-After
  and is closed). A request must arrive whole within `request_timeout_s` of its first
  byte (408 otherwise); a connection idle between requests for `idle_timeout_s` is
  closed; one whose client stops reading answers for `request_timeout_s` is aborted.
- The loop answers at most `answers_per_turn` requests per turn (one pass of the event
  loop); a connection whose request finds the turn's share spent keeps it parsed and
  waits, in arrival order, for a later turn (turns.py says why). Requests a client
  pipelined take turns too: one answer each while other connections wait. The wait for
  a turn is known, and admission counts it. A queue that stands (its oldest wait over a
  target for an interval: a quarter of the admission bound, and the bound) is cut short:
  a request that waited over the target is refused (429) at its turn.
- Close: stops accepting after taking in what waits in the listen backlog; every
  accepted request gets an answer: its result, or 503 + Retry-After + Connection: close
  when it cannot finish before the deadline.
Nothing a client sends raises out of the protocol.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import httptools

from hybridgnn.serving.core.eager import Later, when_done
from hybridgnn.serving.http.message import Message
from hybridgnn.serving.http.reading import RequestReader
from hybridgnn.serving.http.reply import ABORT, Reply, Request

log = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_QUIET_S = 1.0  # lingering after a refusal ends after this long without input
_LINGER_MAX_S = 2.0  # ... or this long after it began, however the client trickles


class Connection(RequestReader, asyncio.Protocol):
    """One client connection: llhttp parses (reading.RequestReader); complete requests
    queue; one is answered at a time."""

    __slots__ = ("server", "transport", "parser", "msg", "queue", "busy", "closed", "eof", "write_paused",
                 "read_paused", "fatal", "started", "head_bytes", "in_head", "idle_since", "write_paused_since",
                 "continue_owed", "lingering", "last_data", "in_flight", "began", "fresh", "waiting_turn",
                 "free_since", "upgraded", "whole_misses", "whole_rest", "unfed", "after_chunk_size")

    def __init__(self, server):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.msg: Message | None = None  # the request being parsed
        self.queue: collections.deque[Message] = collections.deque()  # parsed, not yet answered
        self.busy = False  # a request is being answered (its future pending)
        self.in_flight: Message | None = None
        self.closed = False
        self.eof = False  # the client sent FIN: close once what it asked is answered
        self.write_paused = False
        self.write_paused_since = 0.0
        self.read_paused = False
        self.fatal: Reply | None = None  # answer after the queued ones, then close
        self.started: float | None = None  # first byte of the request being parsed
        self.head_bytes = 0
        self.in_head = True  # bytes fed now belong to a request head (count them)
        self.began = False  # a request began during the current feed
        # after a chunk's size line, before its data: the last chunk's trailer section comes
        # here, and is counted as a head is (llhttp holds a field in memory until it ends)
        self.after_chunk_size = False
        self.fresh = True  # no byte received yet
        self.waiting_turn = False  # in the server's Turns queue
        self.free_since = 0.0  # when the last answer went out (monotonic): a pipelined request waits from then
        self.idle_since = time.monotonic()
        self.continue_owed = False
        self.upgraded = False  # llhttp stopped at an Upgrade: nothing after it is read
        self.whole_misses = 0  # reads in a row whole.py could not take
        self.whole_rest = 0  # reads left that go to llhttp without asking whole.py
        self.unfed = b""  # read, not parsed yet: max_pipelined requests were waiting (_feed)
        self.lingering = 0.0  # after a refusal: when we half-closed (0: not lingering)
        self.last_data = 0.0

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            server.refused_connection()
            server.send(transport, Reply.error(
                503, f"too many connections (limit {server.max_connections}); retry later", server.retry), None, False)
            # Linger (not counted against the cap) so the answer is read rather than reset.
            self._linger()
            asyncio.get_running_loop().call_later(_LINGER_MAX_S, lambda: self.closed or self.close())
            return
        server.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        # The parser holds bound methods of this protocol: a reference cycle that only a
        # garbage collection frees. Under connection churn the closed connections piled
        # up in the oldest generation (98,000 objects against 54,000 live after 4,096
        # clients left, a 20 ms full collection against 8 ms). Dropping the parser lets
        # reference counting free a connection when it closes.
        self.parser = None

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_paused_since = time.monotonic()
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._advance()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.fresh = False
        if self.lingering:
            self.last_data = time.monotonic()
            return  # dropped: the client is still sending what was refused
        if self.fatal is not None:
            return  # the rest of the stream is not parsed once a request was refused
        if self.unfed:  # parsed once the requests waiting are answered (reading is paused till then)
            self.unfed += data
            return
        if self.msg is None and not (self.queue or self.busy or self.upgraded):
            if self.whole_rest:  # whole.py missed WHOLE_MISSES reads in a row: llhttp's for a while
                self.whole_rest -= 1
            else:
                msg = self._whole(data)  # a client that waits for each answer: one whole request
                if msg is not None:
                    self.queue.append(msg)
                    if self.server.max_pipelined <= 1:
                        self._pause_reading()  # as on_message_complete does at max_pipelined
                    self._take_or_wait()
                    return
        self._parse(data)
        self._take_or_wait()

    def _take_or_wait(self) -> None:
        """Answer what is queued now, or in a later turn if this one's share is spent."""
        if self.waiting_turn:
            return
        if self.queue and not (self.busy or self.write_paused) and not self.server.turns.take():
            # This turn's share is spent: answer in a later one. Reading goes on (a client
            # that pipelines is still stopped at max_pipelined): pausing and resuming it
            # would add two epoll_ctl calls to every request that waits.
            self.waiting_turn = True
            self.server.turns.wait(self)
            return
        self._advance()

    def take_turn(self) -> None:
        """Answer what this connection has queued (its turn came; Turns counted it)."""
        self.waiting_turn = False
        self._advance()

    def eof_received(self) -> bool:
        # The client will send nothing more: answer what it asked, then close.
        self.eof = True
        if self.lingering or not (self.busy or self.queue or self.unfed):
            self.close()
            return False
        return True

    # --- answering ----------------------------------------------------------------------
    def _advance(self) -> None:
        """Answer queued requests in order until one is in flight, the write buffer is full
        or the queue is empty (then parse what was read past them, and go on); then resume
        reading if there is room again. The first answer is the caller's (its turn, or a
        completion); each after it spends the turn's share, and goes behind the connections
        waiting for a turn if any do: a client that pipelines requests answered in the call
        (lookups, errors) held the loop for a whole read of them (1,800 lookups in a 256 KiB
        read), and now takes turns with the others, one answer each."""
        answered = 0
        turns = self.server.turns
        while True:
            while not (self.busy or self.closed or self.write_paused) and self.queue:
                if answered and (turns.waiting or not turns.take()):
                    self.waiting_turn = True
                    turns.wait(self)
                    return
                self._answer(self.queue.popleft())
                answered += 1
            if self.closed or self.busy or self.queue or self.write_paused or not self.unfed:
                break
            data, self.unfed = self.unfed, b""
            self._parse(data)
        if self.closed or self.busy or self.queue or self.unfed:
            return
        if self.fatal is not None:
            self.server.send(self.transport, self.fatal, None, False)
            self._linger()
            return
        if self.eof:
            self.close()
            return
        self.idle_since = time.monotonic()
        if self.continue_owed and not self.write_paused:
            self.continue_owed = False
            self.transport.write(_CONTINUE)
        if self.read_paused and not self.write_paused:
            self._resume_reading()

    def _answer(self, msg: Message) -> None:
        head_only = msg.method == "HEAD"
        server = self.server
        found = server.routes.get((msg.method, msg.url))  # clients ask the same few targets
        if found is None:
            url = msg.url
            if not url.startswith(b"/"):
                try:
                    url = httptools.parse_url(url).path or b""  # absolute-form: http://host/path
                except httptools.HttpParserInvalidURLError:
                    url = b""
                if not url.startswith(b"/"):
                    self._write(Reply.error(400, "the request target must be a path"), msg, head_only)
                    return
            path = url.split(b"?", 1)[0].decode("latin-1")
            found = server.api.route(msg.method, path)
            if isinstance(found, Reply):
                self._write(found, msg, head_only)
                return
            server.keep_route(msg.method, msg.url, found)
        endpoint, params = found
        body = msg.body_bytes()
        try:
            # The front end's wait: from the request's arrival whole, or from the answer
            # before it on this connection if that came later. A pipelined request waiting
            # behind the client's own earlier requests is not waiting for the server (HTTP/1.1
            # answers in order), nor is one whose body a slow link brings in over seconds:
            # admission must not refuse them for that on an idle server (it refused every
            # body that took longer than the bound to arrive, however often it was retried).
            # The loop's lag before a read is the admission's own term.
            waited = time.monotonic() - max(msg.whole, self.free_since)
            reply = endpoint(Request(params, msg.headers, body, waited, server.turns.over_target(waited)))
        except Exception:
            reply = server.api.internal_error(f"{msg.method} {msg.url.split(b'?', 1)[0][:200].decode('latin-1')}")
        if isinstance(reply, Later) and reply.done():  # answered in the call (a lookup): no callback,
            reply = reply.result()  # so _advance's loop answers the next, without recursing
            if reply is ABORT:
                self.abort()
                return
        if isinstance(reply, Reply):
            self._write(reply, msg, head_only)
            return
        if not isinstance(reply, (asyncio.Future, Later)):
            reply = asyncio.ensure_future(reply)
        self.busy = True
        self.in_flight = msg
        when_done(reply, lambda fut: self._answered(fut, msg, head_only))

    def _answered(self, fut: asyncio.Future, msg: Message, head_only: bool) -> None:
        if self.in_flight is not msg:
            return  # already answered 503 at close
        self.busy = False
        self.in_flight = None
        if self.closed:
            return  # the client left; its request was still served to completion
        if fut.cancelled():
            reply = Reply.error(503, "request cancelled: server shutting down", self.server.retry)
        elif fut.exception() is not None:
            reply = self.server.api.internal_error("answer", fut.exception())
        else:
            reply = fut.result()
            if reply is ABORT:
                self.abort()
                return
        self._write(reply, msg, head_only)
        self._advance()

    def _write(self, reply: Reply, msg: Message, head_only: bool) -> None:
        """Send the answer to msg; without keep-alive it says "Connection: close", and the
        connection lingers until the client closes (requests after it are not read). While
        draining, the requests already queued behind msg are still answered (the engine
        refuses new work 503) and the last of them says "close"; nothing more is read."""
        keep_alive = msg.keep_alive
        if keep_alive and self.server.draining():
            keep_alive = bool(self.queue)
            self._pause_reading()
        self.server.send(self.transport, reply, msg, keep_alive, head_only)
        self.free_since = time.monotonic()
        if not keep_alive:
            self._linger()  # nothing after a "Connection: close" answer is read

    def _refuse(self, status: int, message: str) -> None:
        """Stop parsing; answer status after the requests already queued, then close."""
        if self.fatal is not None:
            return
        headers = self.server.retry if status in (429, 503) else None
        self.fatal = Reply.error(status, message, headers)
        self.msg = None
        self.unfed = b""
        self.started = None
        self.continue_owed = False
        self._pause_reading()

    def _linger(self) -> None:
        """After a refusal: send FIN once the answer is out, then read and drop what the
        client still sends until it closes or stops (closing a socket with unread input
        sends a reset, which can destroy the answer before the client reads it)."""
        now = time.monotonic()
        self.lingering = self.last_data = now
        self.queue.clear()
        self.unfed = b""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._resume_reading()

    # --- timeouts and shutdown ----------------------------------------------------------
    def check_timeouts(self, now: float) -> None:
        server = self.server
        if self.closed:
            return
        if self.write_paused and now - self.write_paused_since > server.request_timeout_s:
            self.abort()  # the client stopped reading its answers
        elif self.started is not None and now - self.started > server.request_timeout_s and self.fatal is None \
                and not self.unfed:  # unfed: the rest of it was read, and waits for the answers before it
            self._refuse(408, f"request not received whole within {server.request_timeout_s:g} s")
            self._advance()
        elif self.lingering:
            if now - self.last_data > _LINGER_QUIET_S or now - self.lingering > _LINGER_MAX_S:
                self.close()
        elif not self._holds_a_request() and now - self.idle_since > server.idle_timeout_s:
            self.close()

    def _holds_a_request(self) -> bool:
        """Whether a request is in flight, parsed and waiting, or partly read."""
        return bool(self.busy or self.queue or self.unfed or self.started is not None)

    def close_if_idle(self) -> None:
        """At shutdown: close a connection between requests. One that has not sent a byte
        yet stays (its request is on the way: it gets a 503 when it comes, or the close's
        deadline ends it)."""
        if self.fresh:
            return
        if not self._holds_a_request():
            self.close()

    def give_up(self) -> None:
        """At the end of a close: answer what is still in flight or queued 503 (so a
        balancer retries it elsewhere) and close."""
        if self.closed:
            return
        if self._holds_a_request():
            msg = self.in_flight or (self.queue[0] if self.queue else None)
            self.in_flight = None
            self.busy = False
            self.queue.clear()
            self.unfed = b""
            self.server.send(self.transport, Reply.error(
                503, "server shut down before this request could be answered; retry", self.server.retry), msg, False)
        self.close()

    def _pause_reading(self) -> None:
        if not self.read_paused and not self.closed:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.connections.discard(self)
            self.transport.close()  # flushes what is buffered first

    def abort(self) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.transport.abort()
