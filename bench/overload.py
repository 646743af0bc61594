"""Overload: what the server does when offered more than it can serve, the current code
against a baseline revision (default e9a9a2f: a fixed --max-pending 2048 cap and no
queue-delay admission), both with their default flags, in the same run.

1. Capacity of the current server, measured here (not assumed): a rising open-loop ramp
   (--capacity rising, default: from --start-rate in x1.25 steps of --step-s, then
   --refine bisection steps (default 2) between the last rate kept and the first that
   failed; capacity = the highest offered rate whose goodput keeps up: >= 95 % of it
   answered 200 within the step, <= 1 % refused, no failures, the client on schedule, and
   the median latency of the step's second half under half of --bound-ms: a rate a few
   per cent over capacity fills the queue admission allows only after a second or more,
   so a short step could keep it without a refusal, and the multiples would then be
   taken of a rate the server cannot sustain) or
   a closed loop (--capacity closed: --concurrency connections each sending its next
   request as soon as the last is answered; capacity = 200s per second after a warm-up
   second; batches form in lock-step there, so it reads higher than the ramp). The
   baseline's own capacity is measured the same way and reported, but the offered rates
   and the goodput criterion use the current server's.
2. Open-loop Poisson load at --multiples x capacity (default 1, 2, 4) for --duration-s
   each (default 8), against each server. Requests carry --nodes-per-request ids (default
   1) drawn by --seeds (default degree: p(node) proportional to its degree, the skewed
   draw the workload tables and bench/placement.py use). Latency is measured at the
   client from each request's scheduled arrival (no coordinated omission).
3. The same at --precomputed-multiples (default 4) x the precomputed capacity, with
   "parameters": {"mode": "precomputed"} requests, on servers started with
   --update-token (with updates on, a lookup runs off the event loop, through the
   "lookup" admission lane on the current server).

Per run: offered rate, goodput (200s answered within the offered window, per second),
share of 429 and of 503 (429s split by message: queue_delay, the current server's
admission, or pending_cap, the --max-pending cap), admitted (200) latency p50/p99 at the
client, the batches' p99 service time from /metrics (the sum of the per-stage p99s of
hybridgnn_stage_seconds{stage=sample|gather|compute} scraped before and after the run: an
estimate, usually above the p99 of the sum; precomputed lookups record no service stages,
so for them the client p99 of a light run, --light-multiple x capacity, stands in), the
server's batching / queue_wait / total stage p99s, and two checks:

    latency_ok   admitted p99 <= (--bound-ms + p99 service) x 1.2, or, with --slo-ms,
                 admitted p99 <= the SLO
    goodput_ok   goodput >= 90 % of capacity

With --slo-ms the current server runs --policy slo:<ms> with a profile (--profile, else
one made first on the servers' cores): its admission bound is then the room the SLO
leaves, and an admitted request should meet the SLO at any offered load.

Each server's CPU is read from /proc: its main process (front end) and its worker
processes (pipelines). A least-squares fit over its runs gives the CPU a served and a
refused request cost it, and, where the server's front end and pipelines share cores of
their own (--client-cpus apart from --server-cpus, no --worker-cpus), the share of those
cores each run spent refusing: at 4x, 3C refusals a second take CPU that serving C needs,
whatever admission decides, so a refusal that costs a sizeable share of a served request
bounds goodput there.

--bound-ms (default 100) is the current server's default --max-queue-delay-ms; the
baseline has no such bound and is held to the same line. Ratios current/baseline per
multiple and the machine line close the report. The load generator shares the machine's
cores with the server: the client's and the server's CPU (cores busy) are reported,
send_lag_s says how far behind its schedule the client fell, and client_limited marks a
run whose schedule was not offered as planned (the client fell behind, or all its
--client-connections were busy with unanswered requests and requests waited in the
client; latency still counts from the schedule). The client opens its connections before
each run (--preopen): opened in a burst at overload they overflow the listen queue and
stall for seconds of SYN-ACK retransmission, which measures the kernel, not the server.

At one seed per request on the demo graph a 2-core machine's capacity is bound by the
event loop (thousands of req/s), so 2x and 4x measure front-end overload; --heavy (or
more --nodes-per-request) makes the pipelines the bottleneck, where queue-delay admission
is meant to act.

    .venv/bin/python bench/overload.py                                   # everything, ~5 min on 2 cores
    .venv/bin/python bench/overload.py --parts sampled --multiples 1,4 --duration-s 4
    .venv/bin/python bench/overload.py --servers current --capacity rising
    .venv/bin/python bench/overload.py --capacity-rps 900 --precomputed-capacity-rps 3000   # skip measuring
    .venv/bin/python bench/overload.py --servers current --parts sampled --slo-ms 50 --nodes-per-request 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    BASELINE_REV,
    DATA,
    descendants_cpu_seconds,
    emit_report,
    heavy_setup,
    machine,
    progress,
    serve_revision,
    thread_cpu_seconds,
)
from hybridgnn.bench.loadgen import (  # noqa: E402
    HEADER_LENGTH,
    _http_request,
    parse_response_head,
    wait_until,
)
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.config import parse_cpus  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.support.server import metrics_text  # noqa: E402

SERVICE_STAGES = ("sample", "gather", "compute")
# 429 messages: the current server's queue-delay admission, and the cap on requests in
# flight (--max-pending, both revisions)
REFUSAL_KINDS = (("queue_delay", b"predicted queueing delay"), ("standing_queue", b"standing queue"),
                 ("pending_cap", b"requests in flight (limit"))
UPDATE_TOKEN = "overload-bench-token"


# --- requests ---------------------------------------------------------------------------
def draw_ids(dataset: Path, kind: str, count: int, per_request: int, seed: int) -> np.ndarray:
    """count x per_request node ids: 'degree' (p ~ degree), 'uniform', or 'zipf:<s>'
    (p ~ rank^-s over a random ranking of the nodes)."""
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.workload.tables import seed_distribution

    graph = GraphStore.open(dataset)
    n = graph.num_nodes
    rng = np.random.default_rng(seed)
    if kind.startswith("zipf:"):
        s = float(kind.split(":", 1)[1])
        p = np.empty(n)
        p[rng.permutation(n)] = np.arange(1, n + 1, dtype=np.float64) ** -s
        p /= p.sum()
    else:
        p, _ = seed_distribution(graph, kind)
    return rng.choice(n, size=(count, per_request), p=p).astype(np.int64)


def encode(url: str, model: str, ids: np.ndarray, mode: str | None) -> list[bytes]:
    """Pre-encoded HTTP/1.1 requests (binary KServe v2 bodies), one per row of ids."""
    parsed = urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    path = f"/v2/models/{model}/infer"
    params = {"binary_data_output": True, **({"mode": mode} if mode else {})}
    wire = []
    for row in ids:
        header = json.dumps({
            "inputs": [{"name": "node_ids", "shape": [int(row.size)], "datatype": "INT64",
                        "parameters": {"binary_data_size": int(row.size) * 8}}],
            "parameters": params}).encode()
        body = header + row.astype("<i8").tobytes()
        wire.append(_http_request(host, port, path, body, {HEADER_LENGTH: str(len(header)),
                                                           "Content-Type": "application/octet-stream"}))
    return wire


# --- load: open loop (Poisson) and closed loop --------------------------------------------
class _OpenConnection(asyncio.Protocol):
    """One keep-alive connection of the open loop, at most one request in flight; the
    response is read by Content-Length in the transport's callbacks (as loadgen.py's)."""

    def __init__(self, pool: "_OpenPool", first: int | None):
        self.pool = pool
        self.first = first
        self.transport = None
        self.buf = bytearray()
        self.inflight = -1

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.first is None:  # opened ahead of the schedule
            self.pool.release(self)
        else:
            self.send(self.first)

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
        if status == 429:  # which rule refused it, from the message
            body = bytes(self.buf[head:head + length])
            self.pool.refusals[next((k for k, m in REFUSAL_KINDS if m in body), "other")] += 1
        del self.buf[:head + length]
        i, self.inflight = self.inflight, -1
        self.pool.finish(i, status)
        if keep:
            self.pool.release(self)
        else:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.inflight >= 0:
            self.pool.finish(self.inflight, -1)
            self.inflight = -1
        self.pool.closed(self)


class _OpenPool:
    """Keep-alive connections for the open loop: a request takes an idle connection or
    opens one, up to max_connections (the client's descriptors); past that it waits in
    the client for the next free connection, which is counted (client_queued): such a
    run offered less than its schedule says. Latency is still measured from the
    scheduled arrival."""

    def __init__(self, host: str, port: int, wire: list[bytes], scheduled: np.ndarray, max_connections: int):
        self.host, self.port, self.wire, self.scheduled = host, port, wire, scheduled
        self.max_connections = max_connections
        self.latencies = np.full(len(wire), np.nan)
        self.statuses = np.zeros(len(wire), dtype=np.int64)
        self.idle: list[_OpenConnection] = []
        self.backlog: collections.deque[int] = collections.deque()
        self.open = self.opened = self.outstanding = self.client_queued = 0
        self.connect_errors: collections.Counter = collections.Counter()
        self.refusals: collections.Counter = collections.Counter()
        self.done = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._conns: set[_OpenConnection] = set()

    async def preopen(self, count: int, chunk: int = 64) -> None:
        """Open `count` idle connections before the schedule starts, `chunk` at a time, so
        the run does not begin with a burst of handshakes (which overflows the server's
        listen queue: the kernel then drops handshakes and their requests stall for seconds
        of SYN-ACK retransmission, whatever the server does)."""
        loop = asyncio.get_running_loop()

        async def one() -> None:
            conn = _OpenConnection(self, None)
            self.open += 1
            try:
                await loop.create_connection(lambda: conn, self.host, self.port)
                self._conns.add(conn)
            except OSError as exc:
                self.open -= 1
                self.connect_errors[exc.strerror or str(exc.errno)] += 1

        for k in range(0, count, chunk):
            await asyncio.gather(*(one() for _ in range(min(chunk, count - k))))

    def start(self, i: int) -> None:
        self.outstanding += 1
        if self.idle:
            self.idle.pop().send(i)
        elif self.open < self.max_connections:
            self._connect(i)
        else:
            self.client_queued += 1
            self.backlog.append(i)

    def _connect(self, i: int) -> None:
        self.open += 1
        self.opened += 1
        task = asyncio.get_running_loop().create_task(self._open(i))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, i: int) -> None:
        conn = _OpenConnection(self, i)
        try:
            await asyncio.get_running_loop().create_connection(lambda: conn, self.host, self.port)
            self._conns.add(conn)
        except OSError as exc:
            self.connect_errors[exc.strerror or str(exc.errno)] += 1
            self.finish(i, -1)
            self.open -= 1
            self._next_from_backlog()

    def release(self, conn: _OpenConnection) -> None:
        if self.backlog:
            conn.send(self.backlog.popleft())
        else:
            self.idle.append(conn)

    def closed(self, conn: _OpenConnection) -> None:
        self.open -= 1
        self._conns.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        self._next_from_backlog()

    def _next_from_backlog(self) -> None:
        if self.backlog and self.open < self.max_connections:
            self._connect(self.backlog.popleft())

    def finish(self, i: int, status: int) -> None:
        if self.statuses[i] != 0:
            return
        self.statuses[i] = status
        self.latencies[i] = time.perf_counter() - self.scheduled[i]
        self.outstanding -= 1
        if self.outstanding == 0:
            self.done.set()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for conn in self._conns:
            if conn.transport is not None:
                conn.transport.close()


async def open_loop(url: str, wire: list[bytes], rate: float, duration_s: float, seed: int,
                    max_connections: int = 4096, preopen: int = 0, timeout_s: float = 60.0) -> dict:
    """Poisson arrivals at `rate` for duration_s; statuses, latencies from the scheduled
    arrival (seconds), the schedule (from the window's start), how far behind its schedule
    the client fell, and connection counts."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.2) + 16))
    arrivals = arrivals[arrivals < duration_s]
    parsed = urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    reqs = [wire[i % len(wire)] for i in range(len(arrivals))]
    scheduled = np.zeros(len(arrivals))
    pool = _OpenPool(host, port, reqs, scheduled, max_connections)
    await pool.preopen(min(preopen, max_connections))
    preopened = len(pool.idle)
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    scheduled[:] = start + arrivals
    lag = 0.0
    try:
        for i, at in enumerate(scheduled.tolist()):
            lag = max(lag, await wait_until(at))
            pool.start(i)
        sent_s = time.perf_counter() - start
        if pool.outstanding:
            pool.done.clear()
            try:
                await asyncio.wait_for(pool.done.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
    finally:
        gc.unfreeze()
        pool.close()
    statuses = pool.statuses.copy()
    statuses[statuses == 0] = -1
    return {"statuses": statuses, "latencies_s": pool.latencies.copy(), "scheduled": scheduled - start,
            "duration_s": duration_s, "send_lag_s": lag, "sent_s": sent_s, "connections": pool.opened,
            "client_queued": pool.client_queued, "connect_errors": dict(pool.connect_errors), "preopened": preopened,
            "refusals_429": dict(pool.refusals),
            "wall_s": time.perf_counter() - start}


class _ClosedConnection(asyncio.Protocol):
    """One connection of the closed loop: sends its next request when the last is answered."""

    def __init__(self, run: "_ClosedLoop"):
        self.run = run
        self.buf = bytearray()
        self.transport = None
        self.sent_at = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.send()

    def send(self) -> None:
        run = self.run
        if time.perf_counter() >= run.deadline:
            self.transport.close()
            return
        self.sent_at = time.perf_counter()
        self.transport.write(run.wire[run.next % len(run.wire)])
        run.next += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        parsed = parse_response_head(self.buf)
        if parsed is None:
            return
        status, head, length, keep = parsed
        if len(self.buf) < head + length:
            return
        del self.buf[:head + length]
        now = time.perf_counter()
        self.run.record(status, now - self.sent_at, now)
        if keep:
            self.send()
        else:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.run.lost()


class _ClosedLoop:
    def __init__(self, host: str, port: int, wire: list[bytes], concurrency: int, duration_s: float):
        self.host, self.port, self.wire = host, port, wire
        self.concurrency, self.duration_s = concurrency, duration_s
        self.next = 0
        self.statuses: list[int] = []
        self.latencies: list[float] = []
        self.done_at: list[float] = []
        self.open = 0
        self.finished = asyncio.Event()
        self.deadline = math.inf

    def record(self, status: int, latency: float, at: float) -> None:
        self.statuses.append(status)
        self.latencies.append(latency)
        self.done_at.append(at)

    def lost(self) -> None:
        self.open -= 1
        if time.perf_counter() < self.deadline:  # the server closed it: keep the concurrency
            asyncio.get_running_loop().create_task(self.connect())
        elif self.open == 0:
            self.finished.set()

    async def connect(self) -> None:
        self.open += 1
        try:
            await asyncio.get_running_loop().create_connection(lambda: _ClosedConnection(self), self.host, self.port)
        except OSError:
            self.open -= 1
            await asyncio.sleep(0.05)
            if time.perf_counter() < self.deadline:
                asyncio.get_running_loop().create_task(self.connect())
            elif self.open == 0:
                self.finished.set()

    async def run(self) -> float:
        start = time.perf_counter()
        self.deadline = start + self.duration_s
        await asyncio.gather(*(self.connect() for _ in range(self.concurrency)))
        try:
            await asyncio.wait_for(self.finished.wait(), self.duration_s + 60.0)
        except asyncio.TimeoutError:
            pass
        return start


async def closed_loop(url: str, wire: list[bytes], concurrency: int, duration_s: float, warmup_s: float) -> dict:
    parsed = urlsplit(url)
    run = _ClosedLoop(parsed.hostname or "127.0.0.1", parsed.port or 80, wire, concurrency, warmup_s + duration_s)
    start = await run.run()
    statuses, lat, at = np.array(run.statuses), np.array(run.latencies), np.array(run.done_at) - start
    window = (at >= warmup_s) & (at <= warmup_s + duration_s)
    ok = window & (statuses == 200)
    q = np.percentile(lat[ok] * 1e3, [50, 99]) if ok.any() else [math.nan] * 2
    return {"throughput_rps": float(ok.sum() / duration_s), "answered": int(window.sum()),
            "refused": int((window & np.isin(statuses, (429, 503))).sum()),
            "errors": int((window & ~np.isin(statuses, (200, 429, 503))).sum()),
            "p50_ms": float(q[0]), "p99_ms": float(q[1]), "concurrency": concurrency}


# --- /metrics ---------------------------------------------------------------------------
def stage_buckets(url: str) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """hybridgnn_stage_seconds buckets: (stage, pipeline) -> [(le, cumulative count)]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for fam in text_string_to_metric_families(metrics_text(url)):
        if fam.name != "hybridgnn_stage_seconds":
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                key = (s.labels["stage"], s.labels["pipeline"])
                out.setdefault(key, []).append((float(s.labels["le"]), float(s.value)))
    for v in out.values():
        v.sort()
    return out


def delta_quantile(before: dict, after: dict, key: tuple[str, str], q: float) -> tuple[float | None, int]:
    """The q-quantile (seconds) of what a histogram observed between two scrapes, linear
    within a bucket as Prometheus' histogram_quantile; (None, 0) when it observed nothing."""
    b = dict(before.get(key, []))
    buckets = [(le, c - b.get(le, 0.0)) for le, c in after.get(key, [])]
    if not buckets or buckets[-1][1] <= 0:
        return None, 0
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le, int(total)
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12)), int(total)
        prev_le, prev_c = le, c
    return prev_le, int(total)


def server_cpu_s(pid: int) -> float:
    return sum(thread_cpu_seconds(pid).values())


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --- one measured run --------------------------------------------------------------------
def measured_run(srv, wire: list[bytes], rate: float, args, *, label: str, multiple: float, capacity: float,
                 mode: str, fallback_service_ms: float | None, seed: int) -> dict:
    before = stage_buckets(srv.url)
    cpu0, own0, workers0 = server_cpu_s(srv.pid), own_cpu_s(), descendants_cpu_seconds(srv.pid)
    r = run_async(open_loop(srv.url, wire, rate, args.duration_s, seed, args.client_connections, args.preopen))
    cpu1, own1, workers1 = server_cpu_s(srv.pid), own_cpu_s(), descendants_cpu_seconds(srv.pid)
    wall = r["wall_s"]
    after = stage_buckets(srv.url)
    st, lat, sched, dur = r["statuses"], r["latencies_s"], r["scheduled"], r["duration_s"]
    sent = len(st)
    ok = st == 200
    done_at = sched + np.nan_to_num(lat, nan=np.inf)
    ok_in_window = ok & (done_at <= dur)
    lat_ok = lat[ok] * 1e3
    q = np.percentile(lat_ok, [50, 90, 99]) if lat_ok.size else [math.nan] * 3
    refused = np.isin(st, (429, 503))
    lat_refused = lat[refused] * 1e3
    service_ms, batches = None, 0
    parts = [delta_quantile(before, after, (stage, "cpu"), 0.99) for stage in SERVICE_STAGES]
    if all(p is not None for p, _ in parts) and parts[0][1] > 0:
        service_ms, batches = sum(p for p, _ in parts) * 1e3, parts[0][1]
    total_p99, _ = delta_quantile(before, after, ("total", "precomputed" if mode == "precomputed" else "cpu"), 0.99)
    qwait_p99, _ = delta_quantile(before, after, ("queue_wait", "cpu"), 0.99)
    batching_p99, _ = delta_quantile(before, after, ("batching", "cpu"), 0.99)
    source = "metrics: sum of per-stage p99 (sample+gather+compute), per batch"
    if service_ms is None and fallback_service_ms is not None:
        service_ms, source = fallback_service_ms, f"client p99 at {args.light_multiple:g}x capacity (no service stages)"
    # with an SLO policy the promise is the SLO itself; else the bound plus a batch's service
    limit_ms = args.slo_ms if args.slo_ms else (args.bound_ms + (service_ms or 0.0)) * 1.2
    goodput = float(ok_in_window.sum() / dur)
    out = {
        "server": label, "mode": mode, "multiple": multiple, "offered_rps": round(rate, 1), "sent": sent,
        "goodput_rps": round(goodput, 1), "ok_total": int(ok.sum()),
        "share_429": round(float((st == 429).sum() / max(sent, 1)), 4),
        "share_503": round(float((st == 503).sum() / max(sent, 1)), 4),
        "share_other": round(float((~ok & ~refused).sum() / max(sent, 1)), 4),
        "refusals_429": r["refusals_429"],
        "other_statuses": {str(k): int(v) for k, v in zip(*np.unique(st[~ok & ~refused], return_counts=True), strict=True)},
        "p50_ms": round(float(q[0]), 2), "p90_ms": round(float(q[1]), 2), "p99_ms": round(float(q[2]), 2),
        "max_ms": round(float(lat_ok.max()), 2) if lat_ok.size else None,
        "refused_p50_ms": round(float(np.percentile(lat_refused, 50)), 2) if lat_refused.size else None,
        "service_p99_ms": round(service_ms, 2) if service_ms is not None else None,
        "service_p99_source": source if service_ms is not None else None,
        "service_batches": batches,
        "server_total_p99_ms": round(total_p99 * 1e3, 2) if total_p99 is not None else None,
        "server_queue_wait_p99_ms": round(qwait_p99 * 1e3, 2) if qwait_p99 is not None else None,
        "server_batching_p99_ms": round(batching_p99 * 1e3, 2) if batching_p99 is not None else None,
        "latency_limit_ms": round(limit_ms, 2),
        "latency_ok": bool(lat_ok.size and q[2] <= limit_ms),
        "goodput_ok": goodput >= 0.9 * capacity,
        "server_cpu_cores": round((cpu1 - cpu0) / wall, 2), "client_cpu_cores": round((own1 - own0) / wall, 2),
        # the server's pipeline worker processes (0 where the pipelines run in its threads)
        "workers_cpu_cores": round((workers1 - workers0) / wall, 2),
        "server_cpu_s": round(cpu1 - cpu0, 4), "workers_cpu_s": round(workers1 - workers0, 4),
        "refused_total": int(refused.sum()),
        "wall_s": round(wall, 2), "send_lag_s": round(r["send_lag_s"], 3),
        "sent_rps": round(sent / max(r["sent_s"], 1e-9), 1), "preopened": r["preopened"],
        "connections_opened_in_run": r["connections"],
        "client_queued": r["client_queued"], "connect_errors": r["connect_errors"],
        # the schedule was not offered as planned: the client fell behind it, or all its
        # --client-connections were busy (the server held that many requests unanswered)
        # and requests waited in the client for one
        "client_limited": bool(r["send_lag_s"] > max(0.05, 0.02 * dur) or r["client_queued"] > 0),
    }
    progress(out)
    return out


def cpu_cost_model(runs: list[dict], cores: int | None) -> dict | None:
    """What a served and a refused request cost one server in CPU, fitted over its runs
    (least squares: front-end CPU = served x f + refused x r; workers' CPU = served x w),
    and, where its front end and pipelines share `cores` cores and nothing else runs there,
    the share of those cores each run spent refusing (refused per second x r / cores). When
    r is a sizeable share of f + w, refusing 3C a second at 4x takes CPU that serving C
    needs, whatever admission decides; f and w are averages over batch sizes that grow with
    load. None without a run that refused."""
    rows = [r for r in runs if r.get("server_cpu_s") is not None]
    if not any(r["refused_total"] for r in rows) or not any(r["ok_total"] for r in rows):
        return None
    served = np.array([r["ok_total"] for r in rows], dtype=np.float64)
    refused = np.array([r["refused_total"] for r in rows], dtype=np.float64)
    front = np.array([r["server_cpu_s"] for r in rows])
    workers = np.array([r["workers_cpu_s"] for r in rows])
    (f, cost), *_ = np.linalg.lstsq(np.stack([served, refused], axis=1), front, rcond=None)
    w = float(served @ workers / (served @ served))
    out = {"served_frontend_us": round(f * 1e6, 1), "served_workers_us": round(w * 1e6, 1),
           "served_us": round((f + w) * 1e6, 1), "refused_us": round(cost * 1e6, 1),
           "refused_over_served": round(cost / (f + w), 4) if f + w > 0 else None}
    if cores:
        out["cores"] = cores
        out["refusing_share_of_cores"] = {f"{r['multiple']:g}x": round(r["refused_total"] * cost / r["wall_s"] / cores, 3)
                                          for r in rows if r["multiple"] >= 1}
    return out


def measure_capacity(srv, wire: list[bytes], args, label: str) -> dict:
    if args.capacity == "closed":
        res = run_async(closed_loop(srv.url, wire, args.concurrency, args.capacity_s, 1.0))
        res["capacity_rps"] = res["throughput_rps"]
    else:
        rate, best, failed = args.start_rate, None, None
        steps = []

        def step(rate: float) -> bool:
            """One ramp step at `rate`: whether the server kept up with it."""
            r = run_async(open_loop(srv.url, wire, rate, args.step_s, len(steps), args.client_connections,
                                    args.preopen))
            st, lat, sched = r["statuses"], r["latencies_s"], r["scheduled"]
            good = float(((st == 200) & (sched + np.nan_to_num(lat, nan=np.inf) <= args.step_s)).sum() / args.step_s)
            refused = float(np.isin(st, (429, 503)).sum() / max(len(st), 1))
            limited = r["send_lag_s"] > max(0.05, 0.02 * args.step_s) or r["client_queued"] > 0
            late_ok = (st == 200) & (sched >= args.step_s / 2)
            late_p50_ms = float(np.median(lat[late_ok])) * 1e3 if late_ok.any() else math.inf
            keeps = (good >= 0.95 * rate and refused <= 0.01 and not np.isin(st, (-1, 500)).any() and not limited
                     and late_p50_ms <= args.bound_ms / 2)
            steps.append({"offered_rps": round(rate, 1), "goodput_rps": round(good, 1), "refused": round(refused, 4),
                          "second_half_p50_ms": round(late_p50_ms, 1), "client_limited": limited})
            print(f"  {label}: ramp {rate:8.1f} req/s -> goodput {good:8.1f}, refused {refused:.3f}, "
                  f"second-half p50 {late_p50_ms:.1f} ms", flush=True)
            return keeps

        while True:
            if step(rate):
                best = rate
                rate *= 1.25
            elif best is None and rate > 10.0:  # the first rate was already too much: go down
                failed = rate
                rate /= 2
            else:
                failed = rate
                break
        # x1.25 steps leave capacity anywhere in [best, 1.25 best): bisect that gap, so a
        # goodput measured at multiples of it is judged against what the server can do
        for _ in range(args.refine if best else 0):
            mid = (best + failed) / 2
            if step(mid):
                best = mid
            else:
                failed = mid
        res = {"capacity_rps": best or 0.0, "ramp": steps}
    print(f"  {label}: capacity {res['capacity_rps']:.1f} req/s ({args.capacity})", flush=True)
    return res


def shared_cores(args, server: str) -> int | None:
    """How many cores a server's front end and pipelines share with each other and nothing
    else (its own cores, off the client's, with no --worker-cpus for the current server); None
    when the layout differs (the share of cores spent refusing would then mean little)."""
    if not args.client_cpus or not args.server_cpus:
        return None
    if set(parse_cpus(args.client_cpus)) & args.server_cpus:
        return None
    if "--worker-cpus" in args.server_flags or (server == "current" and "--worker-cpus" in args.current_flags):
        return None
    return len(args.server_cpus)


def part(name: str, mode: str | None, multiples: list[float], extra: tuple[str, ...], dataset, model, args,
         given_capacity: float | None) -> dict:
    """One comparison: each server in turn, capacity (of the current server) first."""
    ids = draw_ids(dataset, args.seeds, args.distinct_requests, args.nodes_per_request, args.seed)
    capacity = given_capacity
    runs, info = [], {}
    for server in args.servers:
        rev = None if server == "current" else args.baseline_rev
        label = "current" if rev is None else f"baseline {rev}"
        t0 = time.perf_counter()
        own = tuple(args.current_flags.split()) if rev is None else ()
        srv = serve_revision(rev, dataset, model, *extra, *own, cpus=args.server_cpus)
        try:
            start_s = time.perf_counter() - t0
            wire = encode(srv.url, "hybridgnn", ids, mode)
            # warm-up: kernels compiled, caches filled, the admission lanes' cost fit measured
            run_async(closed_loop(srv.url, wire, min(args.concurrency, 32), args.warmup_s, 0.0))
            cap = measure_capacity(srv, wire, args, f"{name}/{label}")
            if capacity is None:
                if server != "current":
                    print(f"  no capacity of the current server: using {label}'s", flush=True)
                capacity = cap["capacity_rps"]
            if not capacity > 0:
                raise RuntimeError(f"{name}: measured capacity is {capacity}; nothing to offer")
            light = measured_run(srv, wire, args.light_multiple * capacity, args, label=label,
                                 multiple=args.light_multiple, capacity=capacity * args.light_multiple,
                                 mode=mode or "sampled", fallback_service_ms=None, seed=99)
            info[server] = {"revision": rev or "working tree", "start_s": round(start_s, 1),
                            "capacity": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in cap.items()},
                            "light": light}
            for k, m in enumerate(multiples):
                time.sleep(args.settle_s)
                runs.append(measured_run(srv, wire, m * capacity, args, label=label, multiple=m, capacity=capacity,
                                         mode=mode or "sampled", fallback_service_ms=light["p99_ms"], seed=k))
        finally:
            rc = srv.stop()
            if rc not in (0, None):
                print(f"  {label} exited with {rc}; its output:\n{srv.output()[-3000:]}", flush=True)
    for server, res in info.items():
        label = "current" if server == "current" else f"baseline {args.baseline_rev}"
        mine = [r for r in runs if r["server"] == label] + [res["light"]]
        model = cpu_cost_model(mine, shared_cores(args, server))
        res["cpu_model"] = model
        if model:
            print(f"  {name}/{label}: CPU per served request {model['served_us']:.0f} us (front end "
                  f"{model['served_frontend_us']:.0f}), per refusal {model['refused_us']:.0f} us"
                  + (f"; share of its {model['cores']} core(s) spent refusing: "
                     + ", ".join(f"{k} {v:.0%}" for k, v in model["refusing_share_of_cores"].items())
                     if "refusing_share_of_cores" in model else ""), flush=True)
    ratios = {}
    for m in multiples:
        cur = next((r for r in runs if r["multiple"] == m and r["server"] == "current"), None)
        base = next((r for r in runs if r["multiple"] == m and r["server"] != "current"), None)
        if cur and base:
            ratios[f"{m:g}x"] = {
                "goodput_current_over_baseline": round(cur["goodput_rps"] / base["goodput_rps"], 2)
                if base["goodput_rps"] else None,
                "p99_baseline_over_current": round(base["p99_ms"] / cur["p99_ms"], 2)
                if cur["p99_ms"] and math.isfinite(cur["p99_ms"]) else None,
                "p50_baseline_over_current": round(base["p50_ms"] / cur["p50_ms"], 2)
                if cur["p50_ms"] and math.isfinite(cur["p50_ms"]) else None,
                "refused_share_current": round(cur["share_429"] + cur["share_503"], 4),
                "refused_share_baseline": round(base["share_429"] + base["share_503"], 4),
            }
    return {"mode": mode or "sampled", "server_flags": list(extra), "current_flags": args.current_flags.split(),
            "capacity_rps": round(capacity, 1),
            "servers": info, "runs": runs, "ratios": ratios}


def table(report: dict) -> str:
    lines = [f"{'part':<12} {'server':<18} {'x':>4} {'offered':>8} {'goodput':>8} {'429':>6} {'503':>6} "
             f"{'p50 ms':>8} {'p99 ms':>8} {'svc p99':>8} {'limit':>7} {'lat':>4} {'good':>4}"]
    for name, p in report["parts"].items():
        for r in p["runs"]:
            svc = r["service_p99_ms"]
            lines.append(f"{name:<12} {r['server']:<18} {r['multiple']:>4g} {r['offered_rps']:>8.0f} "
                         f"{r['goodput_rps']:>8.0f} {r['share_429']:>6.3f} {r['share_503']:>6.3f} "
                         f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {svc if svc is not None else math.nan:>8.1f} "
                         f"{r['latency_limit_ms']:>7.1f} {'ok' if r['latency_ok'] else 'NO':>4} "
                         f"{'ok' if r['goodput_ok'] else 'NO':>4}")
    return "\n".join(lines)


def slo_profile(dataset, model, args) -> Path:
    """The profile `--policy slo:<ms>` needs: --profile, else one made now on the servers'
    cores (`hybridgnn profile --budget-s 60`, its default pipelines), so it describes this
    machine as it is."""
    if args.profile is not None:
        return args.profile
    out = DATA / "overload-slo-profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"profiling the server for --slo-ms into {out} (about a minute)", flush=True)
    pin = (lambda: os.sched_setaffinity(0, args.server_cpus)) if args.server_cpus else None
    subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "profile", "--dataset",
                    str(dataset), "--model", str(model), "--budget-s", "60", "--no-plot", "--out", str(out)],
                   check=True, preexec_fn=pin)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="sampled,precomputed", help="sampled, precomputed (comma-separated)")
    ap.add_argument("--servers", default="current,baseline", help="current, baseline (comma-separated, in order)")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the baseline server")
    ap.add_argument("--multiples", default="1,2,4", help="offered load, in multiples of capacity (sampled part)")
    ap.add_argument("--precomputed-multiples", default="4", help="the same for the precomputed part")
    ap.add_argument("--duration-s", type=float, default=8.0, help="offered window per run")
    ap.add_argument("--capacity", choices=["closed", "rising"], default="rising")
    ap.add_argument("--capacity-s", type=float, default=4.0, help="closed loop: measured seconds (after 1 s)")
    ap.add_argument("--concurrency", type=int, default=128, help="closed loop: connections")
    ap.add_argument("--start-rate", type=float, default=1000.0, help="rising: first offered rate")
    ap.add_argument("--step-s", type=float, default=2.0, help="rising: seconds per step")
    ap.add_argument("--refine", type=int, default=2,
                    help="rising: bisection steps between the last rate kept and the first that failed")
    ap.add_argument("--capacity-rps", type=float, default=None, help="sampled capacity to use instead of measuring")
    ap.add_argument("--precomputed-capacity-rps", type=float, default=None)
    ap.add_argument("--light-multiple", type=float, default=0.25,
                    help="a light run at this x capacity first (its client p99 stands in for service time "
                         "where /metrics has none)")
    ap.add_argument("--warmup-s", type=float, default=1.5, help="closed-loop warm-up after each start")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause between runs")
    ap.add_argument("--bound-ms", type=float, default=100.0,
                    help="queue-delay bound the latency check allows (the current default --max-queue-delay-ms)")
    ap.add_argument("--heavy", action="store_true",
                    help="sampled part on the products-scale graph with a 3-layer SAGE of width 256 (compute-bound; "
                         "generated once into data/); the precomputed part stays on the demo, which has embeddings")
    ap.add_argument("--client-connections", type=int, default=4096,
                    help="most connections the open-loop client holds (lowered to its descriptor limit less "
                         "512); past it requests wait in the client for a free one and the run is client_limited")
    ap.add_argument("--preopen", type=int, default=None,
                    help="connections opened (64 at a time) before each open-loop run's schedule starts "
                         "(default: --client-connections); 0 opens them on demand, in bursts")
    ap.add_argument("--seeds", default="degree", help="id distribution: degree, uniform or zipf:<s>")
    ap.add_argument("--nodes-per-request", type=int, default=1)
    ap.add_argument("--server-flags", default="", help="more serve flags for the sampled part (both servers)")
    ap.add_argument("--current-flags", default="",
                    help="more serve flags for the current server only (flags a baseline revision may not know, "
                         "e.g. --worker-cpus 1)")
    ap.add_argument("--distinct-requests", type=int, default=20000, help="pre-encoded requests, reused in turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-cpus", default=None,
                    help="cores for the load generator (e.g. 0 or 0-1); the servers get the others, so "
                         "offering 4x does not take CPU from the server (default: shared)")
    ap.add_argument("--server-cpus", default=None,
                    help="cores for the servers (default: those --client-cpus leaves, else all); may overlap "
                         "the client's, e.g. --client-cpus 0 --server-cpus 0,1 --current-flags '--worker-cpus 1' "
                         "gives the pipeline a core of its own and the front end the client's")
    ap.add_argument("--slo-ms", type=float, default=None,
                    help="serve the current server with --policy slo:<ms> and a profile; admitted p99 is then "
                         "judged against the SLO itself, and the ramp keeps a rate only while its median stays "
                         "under half of the SLO (meant for --parts sampled)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="the profile for --slo-ms (default: one made first on the servers' cores, about a minute)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    if args.profile is not None and not args.slo_ms:
        ap.error("--profile is for --slo-ms")
    if args.slo_ms is not None and not args.slo_ms > 0:
        ap.error("--slo-ms must be positive")
    args.servers = [s for s in args.servers.split(",") if s]
    if not set(args.servers) <= {"current", "baseline"} or not args.servers:
        ap.error("--servers takes current and/or baseline")
    parts = [p for p in args.parts.split(",") if p]
    if not set(parts) <= {"sampled", "precomputed"} or not parts:
        ap.error("--parts takes sampled and/or precomputed")
    allowed = os.sched_getaffinity(0)
    args.server_cpus = set(parse_cpus(args.server_cpus)) if args.server_cpus else None
    if args.server_cpus is not None and not (args.server_cpus and args.server_cpus <= allowed):
        ap.error(f"--server-cpus {sorted(args.server_cpus)}: this process may use {sorted(allowed)}")
    if args.client_cpus:
        client = set(parse_cpus(args.client_cpus))
        if args.server_cpus is None:
            args.server_cpus = allowed - client
        if not args.server_cpus or not client <= allowed:
            ap.error(f"--client-cpus {args.client_cpus} leaves no core for the server "
                     f"(this process may use {sorted(allowed)})")
        os.sched_setaffinity(0, client)
    limit = raise_open_file_limit()
    args.client_connections = max(64, min(args.client_connections, (limit if limit > 0 else 1024) - 512))
    args.preopen = args.client_connections if args.preopen is None else args.preopen
    dataset, model = ensure_demo()
    sampled_dataset, sampled_model = heavy_setup() if args.heavy else (dataset, model)
    if args.slo_ms:
        profile = slo_profile(sampled_dataset, sampled_model, args)
        args.current_flags = f"{args.current_flags} --profile {profile} --policy slo:{args.slo_ms:g}".strip()
        args.bound_ms = args.slo_ms  # the ramp's median limit: half of the SLO
    report = {"machine": machine(), "cpu_count": os.cpu_count(), "baseline_rev": args.baseline_rev,
              "duration_s": args.duration_s, "capacity_method": args.capacity, "seeds": args.seeds,
              "nodes_per_request": args.nodes_per_request, "bound_ms": args.bound_ms, "slo_ms": args.slo_ms,
              "current_flags": args.current_flags,
              "client_cpus": args.client_cpus, "server_cpus": sorted(args.server_cpus or []),
              "client_connections": args.client_connections,
              "sampled_dataset": str(sampled_dataset), "sampled_model": str(sampled_model),
              "dataset": str(dataset), "model": str(model), "parts": {}}
    print(report["machine"], flush=True)
    if "sampled" in parts:
        print("sampled (defaults):", flush=True)
        report["parts"]["sampled"] = part("sampled", None, [float(m) for m in args.multiples.split(",")],
                                          tuple(args.server_flags.split()), sampled_dataset, sampled_model, args,
                                          args.capacity_rps)
    if "precomputed" in parts:
        print("precomputed (--update-token):", flush=True)
        report["parts"]["precomputed"] = part(
            "precomputed", "precomputed", [float(m) for m in args.precomputed_multiples.split(",")],
            ("--update-token", UPDATE_TOKEN), dataset, model, args, args.precomputed_capacity_rps)
    print(table(report))
    for name, p in report["parts"].items():
        for m, r in p["ratios"].items():
            print(f"{name} {m}: goodput current/baseline {r['goodput_current_over_baseline']}, "
                  f"p99 baseline/current {r['p99_baseline_over_current']}, refused current "
                  f"{r['refused_share_current']:.3f} vs baseline {r['refused_share_baseline']:.3f}")
    print(f"machine: {report['machine']}")
    emit_report(report, args.json)  # last: what a device run's output tail carries


if __name__ == "__main__":
    main()
