"""A lone sampled request's latency and server CPU: one-seed sampled JSON requests one
after another on one keep-alive connection (closed loop: each batch holds one request
and finds the server quiet), against this working tree's server with its CPU workers as
threads (`--worker-processes off`) and, with --baseline-rev, the same defaults at an
earlier git revision.

The servers run at once and take turns in chunks of --chunk requests, the order rotating
each round, so drift of the machine's speed falls on all of them alike. Reported per
server: median p50 and p99 latency over the rounds, and server CPU (every process and
thread it started, from the scheduler's accounting) per request; then each ÷ the
working tree's defaults.

    .venv/bin/python bench/lone_request.py [--requests 2000] [--rounds 5] [--chunk 400]
    .venv/bin/python bench/lone_request.py --baseline-rev d22d415   # before/after a change
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import emit_report, machine, process_tree_cpu_seconds, serve_revision  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402

MODEL = "hybridgnn"


def turn(server, conn: http.client.HTTPConnection, ids: np.ndarray) -> tuple[list[float], float]:
    """Send one request per id, one after another: (latencies in ms, server CPU seconds)."""
    cpu0 = process_tree_cpu_seconds(server.pid)
    lat = []
    for node in ids.tolist():
        body = json.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [node]}],
                           "parameters": {"mode": "sampled"}}).encode()
        t0 = time.perf_counter()
        conn.request("POST", f"/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        lat.append((time.perf_counter() - t0) * 1e3)
        if resp.status != 200:
            raise RuntimeError(f"{server.label}: HTTP {resp.status}: {data[:200]!r}")
    return lat, process_tree_cpu_seconds(server.pid) - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="per server per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=400, help="requests per turn")
    ap.add_argument("--baseline-rev", help="also the defaults of this git revision")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dataset, model = ensure_demo()
    setups = [("defaults", None, ()), ("worker threads", None, ("--worker-processes", "off"))]
    if args.baseline_rev:
        setups.append((f"defaults at {args.baseline_rev}", args.baseline_rev, ()))
    servers = {}
    try:
        for label, rev, extra in setups:
            servers[label] = serve_revision(rev, dataset, model, *extra)
        conns = {label: http.client.HTTPConnection("127.0.0.1", s.port, timeout=30) for label, s in servers.items()}
        rng = np.random.default_rng(0)
        num_nodes = int(np.load(Path(dataset) / "indptr.npy", mmap_mode="r").shape[0] - 1)
        for label, s in servers.items():  # warm: first requests page the graph in
            turn(s, conns[label], rng.integers(0, num_nodes, 200))
        rounds = {label: [] for label in servers}
        labels = list(servers)
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            lat = {label: [] for label in labels}
            cpu = dict.fromkeys(labels, 0.0)
            for _ in range(max(1, args.requests // args.chunk)):
                for label in order:
                    got, seconds = turn(servers[label], conns[label], rng.integers(0, num_nodes, args.chunk))
                    lat[label] += got
                    cpu[label] += seconds
            for label in labels:
                rounds[label].append({"p50_ms": float(np.percentile(lat[label], 50)),
                                      "p99_ms": float(np.percentile(lat[label], 99)),
                                      "cpu_us": cpu[label] / len(lat[label]) * 1e6})
            print(f"round {r + 1}: " + "; ".join(
                f"{label} p50 {rounds[label][-1]['p50_ms']:.2f} ms, CPU {rounds[label][-1]['cpu_us']:.0f} us"
                for label in labels), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = {label: {k: round(statistics.median(x[k] for x in rs), 3) for k in ("p50_ms", "p99_ms", "cpu_us")}
               for label, rs in rounds.items()}
    ref = summary["defaults"]
    emit_report({
        "machine": machine(),
        "requests_per_round": args.requests, "rounds": args.rounds, "chunk": args.chunk,
        "servers": summary,
        "vs_defaults": {label: {k: round(v[k] / ref[k], 2) for k in ("p50_ms", "cpu_us")}
                        for label, v in summary.items() if label != "defaults"},
    }, args.out)


if __name__ == "__main__":
    main()
