"""Replicated graph updates: how far behind the other replicas are, same run, two logs.

Three `hybridgnn serve` replicas (real processes) follow one update log: a Redis stream
(redis-server with appendfsync always, on loopback) and, as the peer, one SQLite file
they share (replicas on one machine). A client sends graph updates open-loop at
--rate updates/s (requests of --request-updates feature rewrites each), round robin over
the replicas as a balancer would. For every --probe-every'th acknowledged update it asks
each *other* replica for a node with parameters.min_graph_version = the version the
update reached: that read waits until the replica has applied it, so its latency is the
replication lag a client sees (plus one read). Plain reads (no version) at the same
pace give the read's own latency. Prints p50/p99 of both, the update acknowledgement
latency, and the Redis/SQLite ratios.

    .venv/bin/python bench/replication.py                 # ~1 min on 2 cores
    .venv/bin/python bench/replication.py --rate 2000 --duration-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, machine  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.support.durability import MODEL, get_json  # noqa: E402
from tests.support.replication import RedisServer, wait_for_version  # noqa: E402
from tests.support.server import ServerProcess, await_ready, metrics_text  # noqa: E402

TOKEN = "replication-bench-token"


def _pct(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1000
    return {"n": len(values), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2)}


async def _drive(urls: list[str], args, num_nodes: int, feature_dim: int) -> dict:
    import aiohttp

    rng = np.random.default_rng(0)
    per_s = args.rate / args.request_updates
    total = int(per_s * args.duration_s)
    acks, lags, plain, failed = [], [], [], []
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    def read_body(node: int, version: int | None) -> bytes:
        params = {"mode": "precomputed"}
        if version is not None:
            params["min_graph_version"] = version
        return json.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [node]}],
                           "parameters": params}).encode()

    async def read(session, url: str, node: int, version: int | None, into: list) -> None:
        t = time.perf_counter()
        async with session.post(f"{url}/v2/models/{MODEL}/infer", data=read_body(node, version),
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status != 200:
                failed.append(f"read {r.status}")
                return
        into.append(time.perf_counter() - t)

    async def update(session, i: int) -> None:
        ids = rng.choice(num_nodes, size=args.request_updates, replace=False)
        body = json.dumps({"inputs": [
            {"name": "update_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids.tolist()},
            {"name": "update_features", "datatype": "FP32", "shape": [len(ids), feature_dim],
             "data": rng.normal(size=len(ids) * feature_dim).round(4).tolist()}]}).encode()
        url = urls[i % len(urls)]
        t = time.perf_counter()
        async with session.post(f"{url}/v2/models/{MODEL}/graph", data=body,
                                headers={**headers, "Idempotency-Key": f"bench-{i}"}) as r:
            out = await r.json()
            if r.status != 200:
                failed.append(f"update {r.status}: {out}")
                return
        acks.append(time.perf_counter() - t)
        if i % args.probe_every == 0:
            version, node = int(out["graph_version"]), int(ids[0])
            others = [u for u in urls if u != url]
            await asyncio.gather(*(read(session, u, node, version, lags) for u in others),
                                 *(read(session, u, node, None, plain) for u in others))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        t0, tasks = time.perf_counter(), []
        for i in range(total):
            delay = t0 + i / per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(update(session, i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return {"requests": total, "updates_per_s_offered": args.rate, "updates_per_s_done": round(
        len(acks) * args.request_updates / elapsed), "ack": _pct(acks), "replica_read_at_version": _pct(lags),
        "plain_read": _pct(plain), "failed": failed[:10], "failed_count": len(failed)}


def run_log(kind: str, args, dataset: Path, model: Path, tmp: Path) -> dict:
    redis = RedisServer(tmp / f"redis-{kind}").start() if kind == "redis" else None
    url = redis.url("bench") if redis is not None else f"sqlite://{tmp / 'shared.sqlite'}"
    flags = ("--workers", "1", "--update-token", TOKEN, "--update-log", url, "--max-catch-up-ms", "10000",
             "--snapshot-dir", str(tmp / f"snapshots-{kind}"), "--max-queue-delay-ms", "10000")
    servers = []
    try:
        servers = [ServerProcess(dataset, model, *flags) for _ in range(args.replicas)]
        for i, s in enumerate(servers):
            await_ready(s, f"replica {i}", 300)
        meta = get_json(servers[0].url, f"/v2/models/{MODEL}")[1]["parameters"]
        out = asyncio.run(_drive([s.url for s in servers], args, int(meta["num_nodes"]), int(meta["feature_dim"])))
        head = max(wait_for_version(s.url, 0)["graph_version"] for s in servers)
        for s in servers:
            wait_for_version(s.url, head)
        out["log"], out["final_graph_version"] = kind, head
        out["lag_gauges"] = [next((line.split()[-1] for line in metrics_text(s.url).splitlines()
                                   if line.startswith("hybridgnn_update_log_lag_seconds ")), None) for s in servers]
        return out
    finally:
        for s in servers:
            s.stop()
        if redis is not None:
            redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="graph updates per second offered")
    ap.add_argument("--request-updates", type=int, default=10, help="updates per request")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--probe-every", type=int, default=2, help="probe the other replicas after every k-th update")
    ap.add_argument("--logs", default="redis,sqlite")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    print(report["machine"], flush=True)
    dataset, model = ensure_demo()
    tmp = Path(tempfile.mkdtemp(prefix="hgnn-repl-"))
    try:
        for kind in args.logs.split(","):
            r = report[kind] = run_log(kind, args, dataset, model, tmp)
            print(f"{kind}: {r['updates_per_s_done']:,} updates/s done of {args.rate:,.0f} offered; ack p50 "
                  f"{r['ack'].get('p50_ms')} ms p99 {r['ack'].get('p99_ms')} ms; read at the new version on another "
                  f"replica p50 {r['replica_read_at_version'].get('p50_ms')} ms p99 "
                  f"{r['replica_read_at_version'].get('p99_ms')} ms (plain read p50 {r['plain_read'].get('p50_ms')} "
                  f"ms p99 {r['plain_read'].get('p99_ms')} ms); failed {r['failed_count']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if "redis" in report and "sqlite" in report:
        for key in ("ack", "replica_read_at_version"):
            for p in ("p50_ms", "p99_ms"):
                a, b = report["redis"][key].get(p), report["sqlite"][key].get(p)
                if a and b:
                    print(f"redis/sqlite {key} {p}: {a / b:.2f}")
    print(f"machine: {report['machine']}")
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
