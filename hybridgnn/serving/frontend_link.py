"""The engine's end of one front-end process's link (serving/frontends.py starts the
processes; serving/frontend.py is the other end): frames in, each answered through the
engine's Api, answers out. `hub` is the Frontends that owns the link."""

from __future__ import annotations

import asyncio
import logging

from hybridgnn.errors import CONNECTION_CAP, GRPC_CALL_CAP, ServingError
from hybridgnn.serving.core.eager import Later, when_done
from hybridgnn.serving.http.reply import Reply, Request
from hybridgnn.serving.ipc import wire
from hybridgnn.serving.ipc.channel import Channel, Quiet

log = logging.getLogger("hybridgnn.serve")


class FrontendLink:
    """The engine's end of one front end's link: frames in, answers out."""

    def __init__(self, hub):  # hub: the Frontends that owns it
        self.hub = hub
        self.index: int | None = None
        self.pid: int | None = None
        self.quiet: Quiet | None = None  # from its LISTENING on: whether it has stopped speaking
        self.quiet_since = 0.0  # when it was last found quiet
        self.ran: int | None = None  # its event loop thread's CPU time at the last look while silent
        self.ran_at = 0.0  # when its loop was last seen running (or its silence first looked at)
        self.waited = False  # the log says it is waited for
        self.channel = Channel(self._on_message, self._on_lost, self._on_read)
        self.report: dict = {}
        self.flushed: asyncio.Future | None = None  # set by the FLUSHED that answers a FLUSH

    def _send(self, data: bytes) -> None:
        self.channel.send(data)

    def _on_read(self) -> None:
        # any bytes, part of a frame too: a large request crosses in many reads, and the
        # keep-alives queued behind it arrive only after it
        if self.quiet is not None and self.quiet.spoke() and self.waited:
            log.warning("front end %s (pid %s) speaks again", self.index, self.pid)

    def _on_message(self, kind: int, rid: int, payload: memoryview) -> None:
        if kind == wire.INFER:
            self._infer(rid, payload)
        elif kind == wire.FORWARD:
            self._forward(rid, payload)
        elif kind == wire.GRPC:
            self.hub.spawn(self._grpc(rid, *wire.decode_grpc(payload)))
        elif kind == wire.UNPARSED:
            note = wire.loads(payload)
            self.hub.api.service.count_unparsed(note["model"], note["version"], int(note["status"]),
                                                int(note.get("count", 1)))
        elif kind == wire.LOCAL:
            model, version, seconds, respond_s, rows = wire.decode_local(payload)
            self.hub.api.service.count_local(model, version, seconds, respond_s, rows)
        elif kind == wire.FLUSHED:
            if self.flushed is not None and not self.flushed.done():
                self.flushed.set_result(None)
        elif kind == wire.STATS:
            report = wire.loads(payload)
            # connections and gRPC calls its caps refused since its last report: counted
            # here, where every refusal reason is (a process started again reports from
            # zero, on a new link)
            for key, reason in ((wire.GRPC_REFUSED, GRPC_CALL_CAP), ("refused_connections", CONNECTION_CAP)):
                refused = int(report.get(key, 0)) - int(self.report.get(key, 0))
                if refused > 0:
                    self.hub.api.engine.stats.refused(reason, refused)
            self.report = report
        elif kind == wire.HELLO:
            hello = wire.loads(payload)
            self.index, self.pid = int(hello["index"]), int(hello["pid"])
            self.hub.links[self.index] = self
            self._send(wire.json_frame(wire.SETUP, 0, self.hub.setup(self.index)))
        elif kind == wire.LISTENING:
            # its reports start now: before, it may import for seconds (gRPC) in silence
            self.quiet = Quiet(wire.KEEPALIVE_S, wire.QUIET_S)
            self.hub.listening(self.index)
        else:
            raise wire.WireError(f"unknown message kind {kind}")

    def _on_lost(self, exc) -> None:
        if self.index is not None:
            self.hub.ended(self.index, self.report)
            if self.hub.links.get(self.index) is self:
                del self.hub.links[self.index]
        if self.flushed is not None and not self.flushed.done():
            self.flushed.set_result(None)

    def flush(self) -> asyncio.Future:
        """Resolves once every lookup this front end answered itself so far is counted here."""
        if self.flushed is None or self.flushed.done():
            self.flushed = asyncio.get_running_loop().create_future()
            if not self.channel.send(wire.frame(wire.FLUSH, 0)):
                self.flushed.set_result(None)
        return self.flushed

    def _infer(self, rid: int, payload: memoryview) -> None:
        service = self.hub.api.service
        try:
            inp = wire.decode_infer(payload)
        except ServingError as exc:  # a client's input that cannot be read back here (nested too deeply)
            self._send(wire.encode_failure(rid, service.failure(exc, "infer")))
            return

        def encode(answer):
            return wire.encode_answer(rid, answer)

        def fail(failure):
            return wire.encode_failure(rid, failure)

        out = None
        if inp.standing:
            out = service.refuse_standing(inp.model, inp.version, self.hub.api.standing_target_s, fail)
        if out is None:
            out = service.infer(inp, encode, fail)
        if isinstance(out, bytes):
            self._send(out)
            return

        def done(fut) -> None:
            if fut.cancelled() or fut.exception() is not None:
                exc = None if fut.cancelled() else fut.exception()
                self._send(fail(service.failure(exc, "infer")))
            else:
                self._send(fut.result())

        when_done(out if isinstance(out, (Later, asyncio.Future)) else asyncio.ensure_future(out), done)

    def _forward(self, rid: int, payload: memoryview) -> None:
        method, path, headers, body, waited, standing = wire.decode_forward(payload)
        if self.hub.counts_elsewhere and (path == "/metrics" or path.endswith("/stats")):
            # what it reads counts lookups the front ends answered: count them all first
            self.hub.spawn(self._forward_counted(rid, method, path, headers, body, waited, standing))
            return
        self._answer_forwarded(rid, method, path, headers, body, waited, standing)

    async def _forward_counted(self, rid: int, *request) -> None:
        await self.hub.flush()
        self._answer_forwarded(rid, *request)

    def _answer_forwarded(self, rid: int, method: str, path: str, headers: dict[str, str], body: bytes,
                          waited: float, standing: bool) -> None:
        api = self.hub.api
        found = api.route(method, path)
        if isinstance(found, Reply):
            self._reply(rid, found)
            return
        endpoint, params = found
        try:
            reply = endpoint(Request(params, headers, body, waited, standing))
        except Exception:
            reply = api.internal_error(f"{method} {path}")
        if isinstance(reply, Reply):
            self._reply(rid, reply)
            return

        def done(fut) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self._reply(rid, api.internal_error("answer", None if fut.cancelled() else fut.exception()))
            else:
                self._reply(rid, fut.result())

        when_done(reply if isinstance(reply, (Later, asyncio.Future)) else asyncio.ensure_future(reply), done)

    async def _grpc(self, rid: int, method: str, authorization: str, request: bytes) -> None:
        from hybridgnn.serving.grpc.service import (
            answer_forwarded,  # grpcio only with --grpc-port
        )

        metadata = (("authorization", authorization),) if authorization else ()
        if method == "ModelStatistics" and self.hub.counts_elsewhere:
            await self.hub.flush()
        response, code, message, trailing = await answer_forwarded(self.hub.grpc, method, request, metadata)
        self._send(wire.encode_grpc_reply(rid, response, code, message, trailing))

    def _reply(self, rid: int, reply: Reply) -> None:
        self._send(wire.encode_reply(rid, reply.status, reply.content_type, reply.headers, reply.body))
