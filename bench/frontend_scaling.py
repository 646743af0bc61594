"""Served one-seed precomputed requests per second within a p99 bound, `hybridgnn serve
--frontends N` against `--frontends 1`, in the same run, with a load generator that is
not the bottleneck (the figure is meant for a machine with 8 or more cores).

The server runs on --server-cpus (default: the first half of the cores this process may
use) and the load on --client-cpus (the rest): --clients processes of the project's
open-loop Poisson load generator (hybridgnn/bench/loadgen.py), each pinned to the client
cores and offering rate / clients, their answers' latencies merged (measured from each
request's scheduled arrival: no coordinated omission). For each server the rate doubles
from --start-rate until a trial fails (p99 over --slo-ms, or any refusal or error; a
failed trial is repeated once), then --bisect steps narrow it. Each kept trial reports
the server's CPU (cores busy, all its processes) and the load generator's (cores busy,
and `client_limited` when it used over 90 % of its cores: then the figure is the
client's, not the server's).

Requests are one-seed JSON `mode: precomputed` lookups of the demo model (its embeddings
are made once into the bench cache), which the front ends answer from the stored rows.

    .venv/bin/python bench/frontend_scaling.py [--frontends 1,4] [--slo-ms 30] [--clients 4]
    .venv/bin/python bench/frontend_scaling.py --server-cpus 0-7 --client-cpus 8-15 --out scaling.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    emit_report,
    machine,
    process_tree_cpu_seconds,
    progress,
    serve_revision,
)
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.config.settings import parse_cpus  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402

MODEL = "hybridgnn"
_NUM_NODES = 0  # set in each client process (make_bodies reads it)


def lookup_bodies(rng: np.random.Generator, count: int) -> list[tuple[bytes, dict]]:
    """`count` one-seed precomputed JSON requests (run_load's make_bodies)."""
    ids = rng.integers(0, _NUM_NODES, size=count)
    head = b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":['
    tail = b']}],"parameters":{"mode":"precomputed"}}'
    return [(head + str(int(i)).encode() + tail, {"Content-Type": "application/json"}) for i in ids]


def _client_init(cpus: list[int], num_nodes: int) -> None:
    global _NUM_NODES
    _NUM_NODES = num_nodes
    if cpus:
        os.sched_setaffinity(0, cpus)
    raise_open_file_limit()


def _client_trial(url: str, rate: float, duration_s: float, seed: int) -> tuple[list[float], int, int, float, int]:
    """One client's share of a trial: (latencies ms of its answers, inf where refused or
    failed; refused; errors; its CPU seconds; of the errors, connections it could not open)."""
    cpu0 = time.process_time()
    res = run_async(run_load(url, MODEL, rate=rate, duration_s=duration_s, seed=seed, keep_latencies=True,
                             make_bodies=lookup_bodies))
    return res.latencies_ms, res.rejected, res.errors, time.process_time() - cpu0, res.connect_errors


class Load:
    """--clients load-generator processes on the client cores."""

    def __init__(self, clients: int, cpus: list[int], num_nodes: int):
        self.clients = clients
        self.cpus = cpus
        ctx = multiprocessing.get_context("spawn")
        self.pool = ctx.Pool(clients, initializer=_client_init, initargs=(cpus, num_nodes))
        self.trials = 0

    def trial(self, url: str, rate: float, duration_s: float, server_pid: int) -> dict:
        self.trials += 1
        seeds = [self.trials * 1000 + i for i in range(self.clients)]
        cpu0, t0 = process_tree_cpu_seconds(server_pid), time.perf_counter()
        parts = self.pool.starmap(_client_trial, [(url, rate / self.clients, duration_s, s) for s in seeds])
        wall = time.perf_counter() - t0
        server_cpu = process_tree_cpu_seconds(server_pid) - cpu0
        lat = np.concatenate([np.asarray(p[0], dtype=np.float64) for p in parts])
        ok = lat[np.isfinite(lat)]
        client_cpu = sum(p[3] for p in parts)
        client_busy = client_cpu / wall
        return {"offered_rps": rate, "sent": int(len(lat)), "ok": int(len(ok)),
                "rejected": int(sum(p[1] for p in parts)), "errors": int(sum(p[2] for p in parts)),
                "connect_errors": int(sum(p[4] for p in parts)),
                "achieved_rps": round(len(ok) / duration_s, 1),
                "p50_ms": round(float(np.percentile(ok, 50)), 2) if len(ok) else None,
                "p99_ms": round(float(np.percentile(ok, 99)), 2) if len(ok) else None,
                "server_cores_busy": round(server_cpu / wall, 2), "client_cores_busy": round(client_busy, 2),
                "client_limited": client_busy > 0.9 * max(1, len(self.cpus))}

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def max_rate(load: Load, url: str, pid: int, args) -> tuple[float, dict | None, list[dict]]:
    """The highest offered rate that holds (module docstring), its trial, and every trial."""
    trials: list[dict] = []

    def holds(rate: float) -> dict | None:
        for _ in range(2):
            t = load.trial(url, rate, args.trial_s, pid)
            trials.append(t)
            progress(t)
            if t["ok"] == t["sent"] and t["p99_ms"] is not None and t["p99_ms"] <= args.slo_ms:
                return t
        return None

    load.trial(url, args.start_rate, 1.0, pid)  # warm-up: connections, caches, the page cache's rows
    good, good_t, bad = 0.0, None, None
    rate = args.start_rate
    while rate <= args.max_rate:
        t = holds(rate)
        if t is None:
            bad = rate
            break
        good, good_t, rate = rate, t, rate * 2
    if bad is not None:
        for _ in range(args.bisect):
            mid = (good + bad) / 2 if good else bad / 2
            t = holds(mid)
            if t is not None:
                good, good_t = mid, t
            else:
                bad = mid
    return good, good_t, trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontends", default="1,4", help="front-end counts to measure; the first is the baseline")
    ap.add_argument("--slo-ms", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4, help="load-generator processes")
    ap.add_argument("--server-cpus", default=None, help="default: the first half of the cores")
    ap.add_argument("--client-cpus", default=None, help="default: the cores the server does not use")
    ap.add_argument("--start-rate", type=float, default=1000.0)
    ap.add_argument("--max-rate", type=float, default=400_000.0)
    ap.add_argument("--trial-s", type=float, default=3.0)
    ap.add_argument("--bisect", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    server = list(parse_cpus(args.server_cpus)) if args.server_cpus else allowed[:max(1, len(allowed) // 2)]
    client = list(parse_cpus(args.client_cpus)) if args.client_cpus else [c for c in allowed if c not in server]
    if not client or set(client) & set(server) or not set(server) | set(client) <= set(allowed):
        ap.error(f"server cores {server} and client cores {client} must be apart, within {allowed}")
    counts = [int(n) for n in args.frontends.split(",")]
    dataset, model = ensure_demo()
    meta_path = Path(dataset) / "meta.json"
    num_nodes = int(json.loads(meta_path.read_text()).get("num_nodes", 50_000)) if meta_path.exists() else 50_000
    os.sched_setaffinity(0, client)  # this process only waits for the clients
    load = Load(args.clients, client, num_nodes)
    results = {}
    try:
        for n in counts:
            srv = serve_revision(None, dataset, model, "--frontends", str(n), cpus=set(server))
            try:
                print(f"--frontends {n} on cores {server}", flush=True)
                rate, best, trials = max_rate(load, srv.url, srv.pid, args)
                results[n] = {"max_rps": rate, "at_max": best, "trials": trials}
            finally:
                srv.stop()
    finally:
        load.close()
    base = results[counts[0]]["max_rps"]
    report = {"machine": machine(), "server_cpus": server, "client_cpus": client, "clients": args.clients,
              "slo_ms": args.slo_ms, "request": "one seed, JSON, mode precomputed",
              "max_rps": {f"frontends {n}": r["max_rps"] for n, r in results.items()},
              "over_first": {f"frontends {n}": round(r["max_rps"] / base, 2) if base else None
                             for n, r in results.items()},
              "client_limited_at_max": {f"frontends {n}": bool(r["at_max"] and r["at_max"]["client_limited"])
                                        for n, r in results.items()},
              "runs": {f"frontends {n}": r for n, r in results.items()}}
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
