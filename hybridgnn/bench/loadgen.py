"""Open-loop load generator (Poisson arrivals) for a KServe v2 endpoint.

Arrival times are fixed in advance; each request's latency is measured from its
scheduled arrival, not from when it was actually sent, so a slow server cannot hide
queueing by slowing the client down (no coordinated omission).

The client is a minimal HTTP/1.1 keep-alive client on raw asyncio streams (requests are
pre-encoded bytes, responses are read by Content-Length): on a small machine the load
generator shares the cores with the server, and a heavy client would cap what can be
measured.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import numpy as np

from hybridgnn.bench.metadata import fetch_num_nodes
from hybridgnn.bench.report import MESSAGE_BODY_BYTES, ErrorSamples
from hybridgnn.bench.stopping import run_until_stopped

HEADER_LENGTH = "Inference-Header-Content-Length"
# An open loop wakes at most once per WAKE_S: requests due meanwhile go out together, up to
# WAKE_S late (their latency counts from the schedule, so that lateness is charged to the
# server, never hidden). A wake-up per request costs the client a timer and a loop turn,
# CPU that a load generator sharing the server's cores takes from the server.
WAKE_S = 0.001


async def wait_until(at: float) -> float:
    """Sleep until time.perf_counter() reaches `at` (at least WAKE_S, if it sleeps at
    all); return how late the caller already was (0 when it slept)."""
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(max(delay, WAKE_S))
        return 0.0
    return -delay


@dataclass
class LoadResult:
    offered_rps: float
    duration_s: float
    sent: int
    ok: int
    rejected: int  # 429/503
    errors: int  # other statuses and transport errors
    achieved_rps: float
    seeds_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    # per request (ms; inf where it failed or was refused), and its scheduled arrival (s
    # after the start), when asked for
    latencies_ms: list[float] | None = None
    arrivals_s: list[float] | None = None
    # of the errors, requests whose connection could not be opened (the client's ports or
    # descriptors, or the server's listen backlog): a client limit, not an answer
    connect_errors: int = 0
    # the errors by status ("-1": no answer, "-2": no connection), so a run whose every
    # request failed says how (it printed an error count alone)
    error_statuses: dict[str, int] = field(default_factory=dict)
    # what the failing and refused answers said, by status: the first few distinct messages
    # (a JSON body's "error", else its text; why a connection failed), each cut short
    error_messages: dict[str, list[str]] = field(default_factory=dict)
    # the signal that stopped the run early ("SIGINT", "SIGTERM"; None: it ran its course):
    # the figures then cover the requests sent until then (sent), over the time they took,
    # and those still in flight are counted here, not as errors
    interrupted: str | None = None
    unanswered: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("latencies_ms")
        d.pop("arrivals_s")
        return d


_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)", re.IGNORECASE)
_CONNECTION_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)


def parse_response_head(buf: bytearray) -> tuple[int, int, int, bool] | None:
    """(status, head length including the blank line, body length, keep-alive) of the
    response at the start of buf, or None until its head is whole. Shared by every
    keep-alive client in the load generators."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end])
    m = _CONTENT_LENGTH.search(head)
    return int(head[9:12]), end + 4, int(m.group(1)) if m else 0, _CONNECTION_CLOSE.search(head) is None


def binary_body(ids: np.ndarray, parameters: dict | None = None) -> tuple[bytes, dict]:
    """parameters: the request's own besides binary_data_output (e.g. a node_type)."""
    header = json.dumps({
        "inputs": [{"name": "node_ids", "shape": [int(ids.size)], "datatype": "INT64",
                    "parameters": {"binary_data_size": int(ids.size) * 8}}],
        "parameters": {"binary_data_output": True, **(parameters or {})},
    }).encode()
    return header + ids.astype("<i8").tobytes(), {HEADER_LENGTH: str(len(header)),
                                                 "Content-Type": "application/octet-stream"}


def json_body(ids: np.ndarray, parameters: dict | None = None) -> tuple[bytes, dict]:
    body = json.dumps({"inputs": [{"name": "node_ids", "shape": [int(ids.size)], "datatype": "INT64",
                                   "data": ids.tolist()}],
                       **({"parameters": parameters} if parameters else {})}).encode()
    return body, {"Content-Type": "application/json"}


def _http_request(host: str, port: int, path: str, body: bytes, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


_CONNECT_FAILED = -2  # a request's status when its connection could not be opened
class _Connection(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight; responses are read
    by Content-Length straight from the transport's callbacks (no task, future or stream
    per request: the client's CPU per request is what a small machine can least spare)."""

    def __init__(self, pool: _ConnectionPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.inflight = -1  # index of the request awaiting its response
        self.waiting: list[int] = []  # sent once the connection is up

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.waiting:
            self.send(self.waiting.pop(0))
        else:
            self.pool.idle.append(self)

    def send(self, i: int) -> None:
        self.inflight = i
        self.transport.write(self.pool.wire[i])

    def data_received(self, data: bytes) -> None:
        self.buf += data
        parsed = parse_response_head(self.buf) if self.inflight >= 0 else None
        if parsed is None:
            return
        status, head, length, keep = parsed
        if len(self.buf) < head + length:
            return
        if status != 200 and self.pool.samples.wants(status):
            self.pool.samples.add_body(status, bytes(self.buf[head:head + min(length, MESSAGE_BODY_BYTES)]))
        del self.buf[:head + length]
        i, self.inflight = self.inflight, -1
        self.pool.finish(i, status)
        if not keep:
            self.transport.close()
        elif self.waiting:
            self.send(self.waiting.pop(0))
        else:
            self.pool.idle.append(self)

    def connection_lost(self, exc) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        lost = ([self.inflight] if self.inflight >= 0 else []) + self.waiting
        if lost and not self.pool.closing:  # (closing: the run's end cut it, said already)
            self.pool.samples.add(-1, "the connection closed before the answer" + (f" ({exc})" if exc else ""))
        for i in lost:
            self.pool.finish(i, -1)
        self.inflight, self.waiting = -1, []


class _ConnectionPool:
    """Keep-alive connections; a request takes an idle one or opens a new one, so the
    offered load is never throttled by the pool (open loop)."""

    def __init__(self, host: str, port: int, wire: list[bytes], scheduled: np.ndarray):
        self.host, self.port = host, port
        self.wire = wire
        self.scheduled = scheduled
        self.latencies = np.full(len(wire), np.nan)
        self.statuses = np.zeros(len(wire), dtype=np.int64)
        self.samples = ErrorSamples()
        self.closing = False
        self.idle: list[_Connection] = []
        self.all: list[_Connection] = []
        self.outstanding = 0
        self.started = 0  # requests sent (or waiting for their connection)
        self.done = asyncio.Event()
        self._opening: set[asyncio.Task] = set()

    def start(self, i: int) -> None:
        self.outstanding += 1
        self.started += 1
        if self.idle:
            self.idle.pop().send(i)
            return
        conn = _Connection(self)
        conn.waiting.append(i)
        self.all.append(conn)
        task = asyncio.get_running_loop().create_task(self._open(conn))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    async def _open(self, conn: _Connection) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: conn, self.host, self.port)
        except OSError as exc:
            self.samples.add(_CONNECT_FAILED, f"{type(exc).__name__}: {exc}")
            for i in conn.waiting:
                self.finish(i, _CONNECT_FAILED)
            conn.waiting = []
            conn.connection_lost(None)

    def finish(self, i: int, status: int) -> None:
        if self.statuses[i] != 0:
            return
        self.statuses[i] = status
        self.latencies[i] = time.perf_counter() - self.scheduled[i]
        self.outstanding -= 1
        if self.outstanding == 0:
            self.done.set()

    def close(self) -> None:
        """Reset every connection (SO_LINGER 0): an overloaded run opens tens of thousands,
        and closed normally each held its client port in TIME_WAIT for a minute, so the
        next runs of a search could not connect."""
        self.closing = True
        for task in self._opening:
            task.cancel()
        for conn in self.all:
            if conn.transport is not None and not conn.transport.is_closing():
                sock = conn.transport.get_extra_info("socket")
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except (AttributeError, OSError):  # closed meanwhile: nothing to reset
                    pass
                conn.transport.abort()


def grpc_body(model: str, ids: np.ndarray, parameters: dict | None = None) -> bytes:
    """A serialized KServe v2 ModelInferRequest for node ids (raw INT64 contents);
    parameters: string parameters of the request (e.g. a node_type)."""
    from hybridgnn.serving.grpc.schema import message

    req = message("ModelInferRequest")(model_name=model)
    req.inputs.add(name="node_ids", datatype="INT64", shape=[int(ids.size)])
    req.raw_input_contents.append(ids.astype("<i8").tobytes())
    for key, value in (parameters or {}).items():
        req.parameters[key].string_param = value
    return req.SerializeToString()


# gRPC status code -> the HTTP status a REST client would have got (the server's GRPC_CODES
# read backwards; RESOURCE_EXHAUSTED is admission's 429 far more often than a 413); an
# answer that never came (DEADLINE_EXCEEDED, CANCELLED) counts as -1, as over REST
_GRPC_STATUS = {"OK": 200, "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
                "NOT_FOUND": 404, "UNIMPLEMENTED": 405, "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429,
                "UNAVAILABLE": 503, "INTERNAL": 500, "UNKNOWN": 500}


async def _grpc_load(target: str, model: str, scheduled: np.ndarray, ids: np.ndarray, arrivals: np.ndarray,
                     timeout_s: float, parameters: dict | None = None, samples: ErrorSamples | None = None,
                     stop: asyncio.Future | None = None) -> tuple[np.ndarray, np.ndarray, int, str | None]:
    """(latencies from the scheduled arrival, statuses as HTTP codes, requests sent, the
    signal that stopped it early or None) over one gRPC channel (HTTP/2 multiplexes the
    requests); requests are serialized before the clock starts and answers are not
    parsed, so the client stays light."""
    import grpc

    from hybridgnn.serving.grpc.schema import SERVICE

    bodies = [grpc_body(model, row, parameters) for row in ids]
    latencies = np.full(len(arrivals), np.inf)
    statuses = np.zeros(len(arrivals), dtype=np.int64)
    samples = samples if samples is not None else ErrorSamples()
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer")  # bytes in, bytes out
        await asyncio.wait_for(channel.channel_ready(), 10.0)  # a server that is not there: TimeoutError

        async def one(i: int) -> None:
            try:
                await infer(bodies[i], timeout=timeout_s)
                statuses[i] = 200
            except grpc.aio.AioRpcError as exc:
                statuses[i] = _GRPC_STATUS.get(exc.code().name, -1)
                if samples.wants(int(statuses[i])):
                    samples.add(int(statuses[i]), f"{exc.code().name}: {exc.details() or ''}")
            latencies[i] = time.perf_counter() - scheduled[i]

        tasks = []

        async def send() -> None:
            for i, at in enumerate(scheduled.tolist()):
                await wait_until(at)
                tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.gather(*tasks)

        gc.collect()
        gc.freeze()
        try:
            start = time.perf_counter()
            scheduled[:] = start + arrivals
            interrupted = await run_until_stopped(send(), stop)
        finally:
            gc.unfreeze()
            for task in tasks:  # in flight when stopped: left unanswered (status 0)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return latencies, statuses, len(tasks), interrupted


async def run_load(url: str, model: str, *, rate: float, duration_s: float, nodes_per_request: int = 1,
                   binary: bool = True, seed: int = 0, num_nodes: int | None = None,
                   timeout_s: float = 30.0, keep_latencies: bool = False, grpc_target: str | None = None,
                   make_bodies=None, node_type: str | None = None, stop: asyncio.Future | None = None
                   ) -> LoadResult:
    """grpc_target (host:port): send KServe v2 gRPC requests there instead of REST to url
    (url still answers the model's metadata when num_nodes is not given). make_bodies(rng,
    count): the REST bodies (bytes, headers) to send instead of node_ids requests (e.g.
    pair requests; nodes_per_request then counts what one body asks for). node_type: on a
    heterogeneous model, the type of the node ids sent (parameters.node_type). stop: a
    future (bench.stopping.stop_signals) that ends the run early once done; the result is
    then the requests sent until then, marked interrupted."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    if num_nodes is None and make_bodies is None:
        num_nodes = await fetch_num_nodes(url, model, node_type)
    parameters = {"node_type": node_type} if node_type is not None else None
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.2) + 16))
    arrivals = arrivals[arrivals < duration_s]
    if make_bodies is not None:
        return await _replay(url, model, make_bodies(rng, len(arrivals)), arrivals, rate, duration_s,
                             nodes_per_request, timeout_s, keep_latencies, stop)
    ids = rng.integers(0, num_nodes, size=(len(arrivals), nodes_per_request))
    if grpc_target is not None:
        start, samples = time.perf_counter(), ErrorSamples()
        latencies, statuses, sent, interrupted = await _grpc_load(
            grpc_target, model, np.zeros(len(arrivals)), ids, arrivals, timeout_s, parameters, samples, stop)
        return _result(rate, duration_s, time.perf_counter() - start, nodes_per_request, latencies, statuses,
                       keep_latencies, arrivals, samples, sent=sent, interrupted=interrupted)
    encode = binary_body if binary else json_body
    return await _replay(url, model, [encode(row, parameters) for row in ids], arrivals, rate, duration_s,
                         nodes_per_request, timeout_s, keep_latencies, stop)


async def _replay(url: str, model: str, bodies: list[tuple[bytes, dict]], arrivals: np.ndarray, rate: float,
                  duration_s: float, nodes_per_request: int, timeout_s: float, keep_latencies: bool,
                  stop: asyncio.Future | None = None) -> LoadResult:
    """Send bodies[i] at arrivals[i] seconds from now (open loop) and measure each answer;
    until `stop` is done, if given (run_load's)."""
    parsed = urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    path = f"/v2/models/{model}/infer"
    wire = [_http_request(host, port, path, body, headers) for body, headers in bodies]
    scheduled = np.zeros(len(arrivals))
    pool = _ConnectionPool(host, port, wire, scheduled)
    # A full collection over the client's heap would stall every request in flight and
    # be charged to the server; nothing allocated here lives past the run.
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    scheduled[:] = start + arrivals

    async def send_and_drain() -> None:
        for i, at in enumerate(scheduled.tolist()):
            await wait_until(at)
            pool.start(i)
        if pool.outstanding:
            pool.done.clear()  # set whenever the run went idle before; only the final drain counts
            try:
                await asyncio.wait_for(pool.done.wait(), timeout_s)
            except asyncio.TimeoutError:  # what is still unanswered counts as failed
                pool.samples.add(-1, f"no answer within {timeout_s:g} s of the last arrival")

    try:
        interrupted = await run_until_stopped(send_and_drain(), stop)
        # as they were: closing fails the requests still in flight, which a stopped run
        # counts as unanswered, not as the server's errors
        latencies, statuses = pool.latencies.copy(), pool.statuses.copy()
    finally:
        gc.unfreeze()
        pool.close()
    return _result(rate, duration_s, time.perf_counter() - start, nodes_per_request, latencies, statuses,
                   keep_latencies, arrivals, pool.samples, sent=pool.started, interrupted=interrupted)


def _result(rate: float, duration_s: float, elapsed: float, nodes_per_request: int, latencies: np.ndarray,
            statuses: np.ndarray, keep_latencies: bool, arrivals: np.ndarray,
            samples: ErrorSamples | None = None, *, sent: int | None = None,
            interrupted: str | None = None) -> LoadResult:
    """The report of a run: statuses (0: never answered) and latencies (s) per scheduled
    request. A run `interrupted` by a signal reports only the first `sent` requests, those
    without an answer as unanswered, and its rates over the time it ran."""
    if interrupted is not None:
        latencies, statuses, arrivals = latencies[:sent], statuses[:sent], arrivals[:sent]
        unanswered = statuses == 0  # in flight as the signal came: no verdict on the server
    else:
        unanswered = np.zeros(len(statuses), dtype=bool)
    statuses[statuses == 0] = -1  # a run to its end: no answer within the timeout
    ok = statuses == 200
    refused = np.isin(statuses, (429, 503))
    failed = ~ok & ~refused & ~unanswered
    lat_ok = latencies[ok] * 1000.0
    q = np.percentile(lat_ok, [50, 90, 99]) if lat_ok.size else [float("nan")] * 3
    window = max(min(elapsed, duration_s) if interrupted is not None else duration_s, 1e-9)
    return LoadResult(
        offered_rps=rate, duration_s=elapsed, sent=len(statuses), ok=int(ok.sum()),
        rejected=int(refused.sum()), errors=int(failed.sum()),
        achieved_rps=float(ok.sum() / window), seeds_per_s=float(ok.sum() * nodes_per_request / window),
        p50_ms=float(q[0]), p90_ms=float(q[1]), p99_ms=float(q[2]),
        max_ms=float(lat_ok.max()) if lat_ok.size else float("nan"),
        latencies_ms=np.where(ok, latencies * 1000.0, np.inf).tolist() if keep_latencies else None,
        arrivals_s=arrivals.tolist() if keep_latencies else None,
        connect_errors=int((statuses == _CONNECT_FAILED).sum()),
        error_statuses={str(int(c)): int(n) for c, n in zip(*np.unique(statuses[failed], return_counts=True),
                                                             strict=True)},
        error_messages=samples.to_dict() if samples is not None else {},
        interrupted=interrupted, unanswered=int(unanswered.sum()),
    )


def error_summary(res: LoadResult) -> str:
    """The first message of each failing status, for a one-line summary ("" if none)."""
    return "; ".join(f"{status}: {messages[0]}" for status, messages in res.error_messages.items() if messages)
