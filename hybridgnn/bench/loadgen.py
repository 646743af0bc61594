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
import time
from dataclasses import asdict, dataclass

from urllib.parse import urlsplit

import aiohttp
import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"


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
    # per request (ms; inf where it failed or was refused), when asked for
    latencies_ms: list[float] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("latencies_ms")
        return d


def binary_body(ids: np.ndarray) -> tuple[bytes, dict]:
    header = json.dumps({
        "inputs": [{"name": "node_ids", "shape": [int(ids.size)], "datatype": "INT64",
                    "parameters": {"binary_data_size": int(ids.size) * 8}}],
        "parameters": {"binary_data_output": True},
    }).encode()
    return header + ids.astype("<i8").tobytes(), {HEADER_LENGTH: str(len(header)),
                                                 "Content-Type": "application/octet-stream"}


def json_body(ids: np.ndarray) -> tuple[bytes, dict]:
    body = json.dumps({"inputs": [{"name": "node_ids", "shape": [int(ids.size)], "datatype": "INT64",
                                   "data": ids.tolist()}]}).encode()
    return body, {"Content-Type": "application/json"}


def _http_request(host: str, port: int, path: str, body: bytes, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _ConnectionPool:
    """Keep-alive connections; a request takes an idle one or opens a new one, so the
    offered load is never throttled by the pool (open loop)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._all: list[asyncio.StreamWriter] = []

    async def send(self, request: bytes) -> int:
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            self._all.append(writer)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, keep = 0, True
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        await reader.readexactly(length)
        if keep:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return status

    def close(self) -> None:
        for w in self._all:
            w.close()


async def fetch_num_nodes(url: str, model: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v2/models/{model}") as r:
            r.raise_for_status()
            return int((await r.json())["parameters"]["num_nodes"])


async def run_load(url: str, model: str, *, rate: float, duration_s: float, nodes_per_request: int = 1,
                   binary: bool = True, seed: int = 0, num_nodes: int | None = None,
                   timeout_s: float = 30.0, keep_latencies: bool = False) -> LoadResult:
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration_s}")
    if num_nodes is None:
        num_nodes = await fetch_num_nodes(url, model)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.2) + 16))
    arrivals = arrivals[arrivals < duration_s]
    ids = rng.integers(0, num_nodes, size=(len(arrivals), nodes_per_request))
    encode = binary_body if binary else json_body
    bodies = [encode(row) for row in ids]
    parsed = urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    path = f"/v2/models/{model}/infer"
    wire = [_http_request(host, port, path, body, headers) for body, headers in bodies]
    latencies = np.full(len(arrivals), np.nan)
    statuses = np.zeros(len(arrivals), dtype=np.int64)
    pool = _ConnectionPool(host, port)

    async def one(i: int, scheduled: float):
        try:
            statuses[i] = await asyncio.wait_for(pool.send(wire[i]), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            statuses[i] = -1
        latencies[i] = time.perf_counter() - scheduled

    # A full collection over the client's heap would stall every request in flight and
    # be charged to the server; nothing allocated here lives past the run.
    gc.collect()
    gc.freeze()
    tasks = []
    start = time.perf_counter()
    try:
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, start + at)))
        await asyncio.gather(*tasks)
    finally:
        gc.unfreeze()
    elapsed = time.perf_counter() - start
    pool.close()
    ok = statuses == 200
    lat_ok = latencies[ok] * 1000.0
    q = np.percentile(lat_ok, [50, 90, 99]) if lat_ok.size else [float("nan")] * 3
    window = max(duration_s, 1e-9)
    return LoadResult(
        offered_rps=rate, duration_s=elapsed, sent=len(arrivals), ok=int(ok.sum()),
        rejected=int(np.isin(statuses, (429, 503)).sum()),
        errors=int((~ok & ~np.isin(statuses, (429, 503))).sum()),
        achieved_rps=float(ok.sum() / window), seeds_per_s=float(ok.sum() * nodes_per_request / window),
        p50_ms=float(q[0]), p90_ms=float(q[1]), p99_ms=float(q[2]),
        max_ms=float(lat_ok.max()) if lat_ok.size else float("nan"),
        latencies_ms=np.where(ok, latencies * 1000.0, np.inf).tolist() if keep_latencies else None,
    )


async def find_max_rate(url: str, model: str, *, slo_ms: float, duration_s: float, nodes_per_request: int,
                        start_rate: float = 100.0, max_rate: float = 1e6, binary: bool = True,
                        bisect_steps: int = 4, log=print) -> tuple[float, LoadResult | None]:
    """Highest offered rate whose p99 stays within slo_ms with nothing rejected or failed:
    double until the SLO breaks, then bisect. Returns (rate, result at that rate)."""
    num_nodes = await fetch_num_nodes(url, model)

    async def trial(rate: float) -> LoadResult:
        res = await run_load(url, model, rate=rate, duration_s=duration_s, nodes_per_request=nodes_per_request,
                             binary=binary, num_nodes=num_nodes)
        log(f"  rate {rate:9.1f} req/s -> ok {res.achieved_rps:9.1f} req/s, p99 {res.p99_ms:8.2f} ms, "
            f"rejected {res.rejected}, errors {res.errors}")
        return res

    def meets(res: LoadResult) -> bool:
        return res.p99_ms <= slo_ms and res.rejected == 0 and res.errors == 0 and res.ok == res.sent

    async def holds(rate: float) -> LoadResult | None:
        """A rate holds if a trial meets the SLO; a failed trial is repeated once, so one
        stall on a shared machine does not end the search."""
        for _ in range(2):
            res = await trial(rate)
            if meets(res):
                return res
        return None

    # Warm the server (compiled kernels, first-call allocations) outside the measurement.
    await run_load(url, model, rate=start_rate, duration_s=1.0, nodes_per_request=nodes_per_request,
                   binary=binary, num_nodes=num_nodes)
    good, good_res, bad = 0.0, None, None
    rate = start_rate
    while rate <= max_rate:
        res = await holds(rate)
        if res is None:
            bad = rate
            break
        good, good_res = rate, res
        rate *= 2
    if bad is None:
        return good, good_res
    for _ in range(bisect_steps):
        mid = (good + bad) / 2 if good else bad / 2
        res = await holds(mid)
        if res is not None:
            good, good_res = mid, res
        else:
            bad = mid
    return good, good_res
    for _ in range(5):
        mid = (good + bad) / 2 if good else bad / 2
        res = await trial(mid)
        if meets(res):
            good, good_res = mid, res
        else:
            bad = mid
    return good, good_res
