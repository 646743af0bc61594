"""One front-end process (`python -m hybridgnn.serving.frontend --ipc PATH --index I`,
started by serving/frontends.py): HTTP on the server's port beside the other front ends,
inferences parsed here and sent to the engine's process as binary frames, their answers
encoded here; every other request forwarded as received. With --grpc-port, gRPC too:
HTTP/2 and gRPC framing here, each call's protobuf bytes decoded and encoded by the
engine's process. Imports no torch.

What holds:
- An inference that does not parse is answered here (the engine is told, so its
  statistics count it as it counts its own); one that parses is the engine's to validate,
  admit and answer, and its answer (an array per output) is encoded here as the client
  asked (JSON, or binary tensor data).
- The engine's STOP: stop accepting, answer what was accepted (the engine still serves),
  close, exit 0. SIGTERM and SIGINT are ignored: signals sent to the whole process group
  (a terminal's Ctrl-C, `timeout`, `kill -- -PGID`) reach the engine's process too, which
  drains and then stops its front ends in order.
- The engine's link ending (its process gone): every inference and read waiting for it is
  answered 503 with Retry-After; a request that changes state (a graph update, a
  repository load) may have been done, and its connection is aborted unanswered, as a
  crash of a one-process server leaves it. The listener closes and the process exits 1
  with one log line.
- The engine silent for wire.QUIET_S while its process lives (stopped, hung): what waits
  for it is answered as if it were gone, and every request after (readiness and liveness
  included) is refused 503 until it speaks again, so nothing waits on it without bound
  and probes see it. Its late answers to what was answered here are dropped.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # First, before the imports below: the engine acts for the process group on SIGINT,
    # SIGTERM and SIGHUP, and a front end still importing when one arrives would die of it
    # (CI saw a SIGHUP to a front end that had just been started kill the server's start).
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, signal.SIG_IGN)

import argparse
import asyncio
import functools
import logging
import os
import sys
import time
from urllib.parse import unquote

from hybridgnn.capabilities import own_usage
from hybridgnn.errors import BadRequest, ServingError
from hybridgnn.serving.core.eager import Later, together
from hybridgnn.serving.http.codec import (
    HEADER_LENGTH,
    parse_infer,
)
from hybridgnn.serving.http.lookups import HttpLookups, infer_reply
from hybridgnn.serving.http.reply import (
    ABORT,
    RETRY,
    Refusals,
    Reply,
    Request,
    model_route,
)
from hybridgnn.serving.http.server import HttpServer
from hybridgnn.serving.ipc import wire
from hybridgnn.serving.ipc.channel import Channel, Quiet
from hybridgnn.serving.v2.inference import check_declared_node_ids
from hybridgnn.serving.v2.types import Failure, internal_failure

log = logging.getLogger("hybridgnn.frontend")
_HEADER_LENGTH = HEADER_LENGTH.lower()
_UNANSWERED = "the engine process is gone or not answering; retry (another replica can answer)"
_GONE = Reply.error(503, _UNANSWERED, RETRY)
_UNANSWERED_KEYS = 64  # (model, version) pairs of inferences refused while the engine is quiet, kept apart


class EngineLink:
    """The front end's end of its link to the engine: requests out, each answered by the
    frame that carries its id back."""

    def __init__(self, on_state, on_lost):
        self.channel = Channel(self._on_message, self._lost)
        self.on_flush = None  # () -> None: the engine's FLUSH (send what was counted here, then FLUSHED)
        self.setup: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending: dict[int, tuple] = {}
        self._abandoned: set[int] = set()  # requests answered here while the engine was quiet
        self.quiet = Quiet(wire.KEEPALIVE_S, wire.QUIET_S)
        self._next = 0
        self._on_state = on_state
        self._on_lost = on_lost
        self.sent = 0

    def request(self, make_frame, waiter: tuple) -> bool:
        """Send make_frame(rid); waiter = (later, answer(kind, payload) -> Reply, the Reply
        if the engine's process dies first, or goes quiet) gets the answer frame. False when
        the link is gone or the engine quiet."""
        if self.channel.closed or self.quiet.quiet:
            return False
        rid = self._next = (self._next + 1) & 0xFFFFFFFF
        data = make_frame(rid)  # may raise (then nothing waits)
        self._pending[rid] = waiter
        self.channel.send(data)
        self.sent += 1
        return True

    def note(self, data: bytes) -> None:
        """Send a frame that wants no answer; dropped while the engine is quiet (a stopped
        engine reads nothing, and what a client sends must not pile up here meanwhile)."""
        if not self.quiet.quiet:
            self.channel.send(data)

    def tick(self) -> None:
        """Once a wire.KEEPALIVE_S: if the engine has just gone quiet, answer what waits for it."""
        if self.quiet.tick(time.monotonic()):
            log.error("the engine process has not spoken for %g s; answering 503 until it does", wire.QUIET_S)
            self._on_state({"quiet": True})
            pending, self._pending = self._pending, {}
            self._abandoned.update(pending)
            with together():
                for later, _, gone in pending.values():
                    later.set_result(gone)

    def _on_message(self, kind: int, rid: int, payload: memoryview) -> None:
        if self.quiet.spoke():
            log.warning("the engine process speaks again; serving")
            self._on_state({"quiet": False})
        if kind == wire.ALIVE:
            return
        if kind == wire.SETUP:
            if not self.setup.done():
                self.setup.set_result(wire.loads(payload))
            return
        if kind == wire.STATE:
            self._on_state(wire.loads(payload))
            return
        if kind == wire.STOP:
            self._on_state({"draining": True, "stop": True})
            return
        if kind == wire.FLUSH:
            if self.on_flush is not None:
                self.on_flush()
            self.channel.send(wire.frame(wire.FLUSHED, 0))
            return
        waiter = self._pending.pop(rid, None)
        if waiter is None:
            if rid in self._abandoned:  # answered here while the engine was quiet
                self._abandoned.discard(rid)
                return
            raise wire.WireError(f"an answer to request {rid}, which waits for none")
        later, answer, _ = waiter
        reply = answer(kind, payload)
        if isinstance(reply, Later):  # a large answer, encoded over several turns of the loop
            reply.add_eager_callback(lambda done: later.set_result(done.result()))
            return
        with together():
            later.set_result(reply)

    def _lost(self, exc) -> None:
        pending, self._pending = self._pending, {}
        with together():
            for later, _, gone in pending.values():
                later.set_result(gone)
        if not self.setup.done():
            self.setup.set_exception(ConnectionError("the engine closed the link before setting this front end up"))
        self._on_lost(exc)


class FrontendApi:
    """The HTTP API as a front end serves it: inferences parsed and answered here through
    the engine, everything else forwarded (http/reply.py's Routes)."""

    def __init__(self, link: EngineLink, setup: dict):
        self.link = link
        self.draining = bool(setup.get("draining"))
        self.quiet = False  # the engine silent (EngineLink.tick): lookups are not answered here either
        self.refusals = Refusals()
        self.report = None  # () -> this process's STATS frame: sent before /metrics is forwarded
        self.local = _open_lookups(setup.get("lookups") or [], float(setup.get("queue_bound_s", 0.0)), link)
        # (model, version, max_request_nodes) of the engine's one model, whose requests of too
        # many ids are refused here as the engine refuses them (None: a repository, or typed)
        self.id_limit = setup.get("id_limit")
        # inferences answered 503 here because the engine was quiet (or gone), by (model,
        # version), until the engine can count them: without this a stalled engine's 503s
        # reached no counter and the error-ratio alert saw none of them
        self.unanswered: dict[tuple[str, str | None], int] = {}
        link.on_flush = self.send_counts

    def send_counts(self) -> None:
        """Send the engine every lookup answered here since the last time, and the
        inferences refused here for want of it, to count (only while it reads: a quiet
        engine's link drops what is sent)."""
        if self.local is not None:
            self.local.send_counts()
        if self.unanswered:
            taken, self.unanswered = self.unanswered, {}
            for (model, version), count in taken.items():
                self.link.note(wire.json_frame(wire.UNPARSED, 0, {"model": model, "version": version,
                                                                  "status": _GONE.status, "count": count}))

    def not_sent(self, model: str, version: str | None):
        """The answer to an inference the engine could not be sent (quiet or gone): 503,
        counted by the engine once it reads again. Model names are the client's: past
        _UNANSWERED_KEYS of them, the rest are counted as of no model (the engine's first),
        so a flood of made-up names holds no memory here."""
        key = (model, version)
        if key not in self.unanswered and len(self.unanswered) >= _UNANSWERED_KEYS:
            key = ("", None)
        self.unanswered[key] = self.unanswered.get(key, 0) + 1
        return _GONE

    def route(self, method: str, path: str):
        """The endpoint for method+path (the HTTP server keeps it per request target)."""
        params = model_route(unquote(path) if "%" in path else path)
        if method == "POST" and params is not None and params.pop("action", None) == "infer":
            return self.infer, params
        return functools.partial(self.forward, method, path), {}

    def internal_error(self, where: str, exc: BaseException | None = None) -> Reply:
        return self.refusals.reply_of(internal_failure(exc if exc is not None else sys.exc_info()[1], where, log))

    def infer(self, request: Request):
        params = request.params
        model, version = params["model"], params.get("version")
        local = self.local
        # lookups answered here wait for no engine, but are counted by it: none while it is
        # quiet, so their counts do not pile up unsent
        if local is not None and not self.draining and not self.quiet:
            reply = local.quick_reply(request, model, version)
            if reply is not None:
                return reply
        try:
            inp, binary = parse_infer(request.body, request.headers.get(_HEADER_LENGTH), model, version,
                                      request.waited_s, request.standing)
            limit = self.id_limit
            if limit is not None and model == limit[0] and version in (None, limit[1]):
                check_declared_node_ids(inp, limit[2])  # before the copy: 1.9M ids were copied only to be refused
        except ServingError as exc:
            return self._unparsed(model, version, exc)
        except Exception:
            return self.internal_error("infer")
        if self.local is not None and not self.draining and not self.quiet:
            reply = self.local.reply(inp, binary)
            if reply is not None:
                return reply
        later = Later()

        def answer(kind: int, payload: memoryview) -> Reply:
            try:
                if kind == wire.ANSWER:
                    return infer_reply(wire.decode_answer(payload, model), binary)  # a Later when large
                if kind == wire.FAILED:
                    return self.refusals.reply_of(wire.decode_failure(payload))
                raise wire.WireError(f"message kind {kind} answers an inference")
            except Exception:
                return self.internal_error("infer answer")

        try:
            sent = self.link.request(lambda rid: wire.encode_infer(rid, inp), (later, answer, _GONE))
        except RecursionError:  # JSON (data or parameters) nested so deep that it cannot be written again
            return self._unparsed(model, version, BadRequest(
                "the request is nested too deeply (an input's data is a list of numbers, or one list per row; "
                "parameters hold plain values)"))
        return later if sent else self.not_sent(model, version)

    def _unparsed(self, model: str, version: str | None, exc: ServingError) -> Reply:
        """The answer to an inference refused here, counted by the engine as it counts its own."""
        self.link.note(wire.json_frame(wire.UNPARSED, 0, {"model": model, "version": version, "status": exc.status}))
        return self.refusals.reply_of(Failure(exc.status, exc.message, exc.headers()))

    def forward(self, method: str, path: str, request: Request):
        later = Later()
        if path == "/metrics" and self.report is not None:
            self.link.note(self.report())  # the scrape shows this front end as of now

        def answer(kind: int, payload: memoryview) -> Reply:
            if kind != wire.REPLY:
                return self.internal_error("forwarded answer", wire.WireError(f"message kind {kind}"))
            status, content_type, headers, body = wire.decode_reply(payload)
            return Reply(status, body, content_type, headers)

        # A read is refused if the engine dies first (retrying it is safe); a request that
        # changes state (an update, a load) may have been done: its connection is aborted.
        gone = _GONE if method in ("GET", "HEAD") else ABORT
        sent = self.link.request(lambda rid: wire.encode_forward(rid, method, path, request.headers, request.body,
                                                                 request.waited_s, request.standing),
                                 (later, answer, gone))
        return later if sent else _GONE


def _open_lookups(specs: list[dict], bound_s: float, link: EngineLink) -> HttpLookups | None:
    """The lookups this front end answers from the engine's stored rows, their answers
    counted by the engine; None when there are none (then the engine answers them all)."""

    def send(taken: list[tuple[dict, bytes]]) -> None:
        for head, seconds in taken:
            link.note(wire.encode_local(head, seconds))

    return HttpLookups.open(specs, bound_s, send)


# UNAVAILABLE with retry-after, as the engine's own 503s are sent over gRPC
_GRPC_GONE = ("UNAVAILABLE", _UNANSWERED, (("retry-after", RETRY["Retry-After"]),), b"")


async def start_grpc(link: EngineLink, setup: dict, share: int, refused, not_sent=None):
    """gRPC on setup's port beside the other front ends (SO_REUSEPORT): each call's bytes
    go to the engine's process as received, which decodes, serves and encodes it; its
    answer (the response's bytes, or a status code and message) ends the call here.
    refused() is called for each call refused past `share` in flight (schema.call_cap);
    not_sent(model, version) for each inference that could not be sent to the engine
    (FrontendApi.not_sent: counted by the engine as an HTTP inference refused so is)."""
    import grpc

    from hybridgnn.capabilities import connection_limit
    from hybridgnn.serving.grpc.access import access_interceptors
    from hybridgnn.serving.grpc.schema import (
        METHODS,
        SERVICE,
        bind_grpc,
        call_cap,
        server_options,
    )
    from hybridgnn.serving.grpc.schema import message as proto

    share = connection_limit(share, 2, "gRPC's share of --max-connections")  # beside HTTP, in one process
    capped, backstop = call_cap(share, refused)
    server = grpc.aio.server(options=server_options(setup["max_body_bytes"], share, setup["idle_timeout_s"],
                                                    reuse_port=True),
                             maximum_concurrent_rpcs=backstop, interceptors=access_interceptors(setup.get("access_log")))

    def answer(kind: int, payload: memoryview):
        if kind != wire.GRPC_REPLY:
            raise wire.WireError(f"message kind {kind} answers a gRPC call")
        return wire.decode_grpc_reply(payload)

    def forwarding(method: str):
        async def call(request: bytes, context):
            auth = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
            later = Later()
            if not link.request(lambda rid: wire.encode_grpc(rid, method, auth, request), (later, answer, _GRPC_GONE)):
                later.set_result(_GRPC_GONE)
                if method == "ModelInfer" and not_sent is not None:
                    try:  # decoded only here: the engine decodes what it is sent
                        infer = proto("ModelInferRequest").FromString(request)
                        model, version = infer.model_name, infer.model_version or None
                    except Exception:  # not a request at all: counted as of no model
                        model, version = "", None
                    not_sent(model, version)
            code, message, trailing, response = await later
            if code is not None:
                if trailing:
                    context.set_trailing_metadata(trailing)
                await context.abort(grpc.StatusCode[code], message)
            return response

        return grpc.unary_unary_rpc_method_handler(capped(call))  # bytes in, bytes out

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {name: forwarding(name) for name in METHODS}),))
    bind_grpc(server, setup["host"], setup["grpc_port"])
    await server.start()
    return server


def _report(http: HttpServer, link: EngineLink, grpc_refused: int) -> dict:
    cpu_s, rss = own_usage()
    return {"pid": os.getpid(), "connections": len(http.connections), "refused_connections": http.refused_connections,
            "requests": link.sent, "cpu_s": cpu_s, "rss_bytes": rss, wire.GRPC_REFUSED: grpc_refused}


async def serve(path: str, index: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    lost: list[BaseException | None] = []
    api: FrontendApi | None = None

    def on_state(state: dict) -> None:
        if api is not None:
            if "draining" in state:
                api.draining = bool(state["draining"])
            if "quiet" in state:
                api.quiet = bool(state["quiet"])
        if state.get("stop"):
            stop.set()

    def on_lost(exc) -> None:
        lost.append(exc)
        stop.set()

    link = EngineLink(on_state, on_lost)
    await loop.create_unix_connection(lambda: link.channel, path)
    link.note(wire.json_frame(wire.HELLO, 0, {"index": index, "pid": os.getpid()}))
    try:
        setup = await link.setup
    except ConnectionError as exc:
        log.error("front end %d: %s", index, exc)
        return 1
    logging.getLogger().setLevel(setup.get("log_level", logging.INFO))
    api = FrontendApi(link, setup)
    http = HttpServer(api, max_body_bytes=setup["max_body_bytes"], idle_timeout_s=setup["idle_timeout_s"],
                      request_timeout_s=setup["request_timeout_s"], max_connections=setup["max_connections"],
                      answers_per_turn=setup["answers_per_turn"], queue_bound_s=setup["queue_bound_s"],
                      listeners=2 if setup.get("grpc_port") is not None else 1,
                      access_log=setup.get("access_log", False))
    await http.start(setup["host"], setup["port"], reuse_port=True)
    grpc_refused = 0  # calls refused past this front end's gRPC cap; the engine counts them from its reports

    def refused_call() -> None:
        nonlocal grpc_refused
        grpc_refused += 1

    grpc_server = (await start_grpc(link, setup, setup["max_connections"], refused_call, api.not_sent)
                   if setup.get("grpc_port") is not None else None)
    link.note(wire.json_frame(wire.LISTENING, 0, {"port": http.port}))

    async def report() -> None:
        while True:
            link.tick()
            if not link.quiet.quiet:  # a stopped engine reads nothing: frames would pile up here
                api.send_counts()
                link.note(api.report())
            await asyncio.sleep(wire.KEEPALIVE_S)

    api.report = lambda: wire.json_frame(wire.STATS, 0, _report(http, link, grpc_refused))
    reporter = loop.create_task(report())
    await stop.wait()
    reporter.cancel()
    if lost:
        log.error("front end %d: the engine process is gone; closing (reads waiting for it were answered 503)",
                  index)
        api.draining = True
        await asyncio.gather(http.close(0.5), *([grpc_server.stop(0.5)] if grpc_server is not None else []))
        return 1
    api.draining = True
    grace = setup["shutdown_grace_s"]
    await asyncio.gather(http.close(grace + 1), *([grpc_server.stop(grace)] if grpc_server is not None else []))
    api.send_counts()
    return 0


def log_format(index: int) -> str:
    """A front end's log lines: the engine's format (time, level, logger name) with the
    front end named before the logger, so that `hybridgnn.access` lines (and every other
    logger's) read alike from whichever process wrote them."""
    return f"%(asctime)s %(levelname)s frontend-{index} %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a hybridgnn front-end process (started by `hybridgnn serve "
                                             "--frontends N`)")
    ap.add_argument("--ipc", required=True, help="the engine's Unix socket")
    ap.add_argument("--index", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=log_format(args.index))
    # Signals to the process group reach the engine's process, which acts for all (SIGHUP
    # refreshes its cache; a front end would die of it).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from hybridgnn.capabilities import raise_open_file_limit, run_async

    raise_open_file_limit()
    try:
        return run_async(serve(args.ipc, args.index))
    except (ConnectionError, FileNotFoundError) as exc:
        log.error("front end %d: cannot reach the engine at %s: %s", args.index, args.ipc, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
