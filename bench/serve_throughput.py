"""Served throughput (seeds/s) within a p99 SLO: `hybridgnn serve` against a naive server
(the same binary with batching off and one worker: one request at a time), same demo
graph, model and machine, driven by the open-loop Poisson load generator.

    .venv/bin/python bench/serve_throughput.py [--slo-ms 50] [--nodes-per-request 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine  # noqa: E402
from hybridgnn.bench.loadgen import find_max_rate  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

NAIVE = ("--workers", "1", "--max-batch-requests", "1", "--max-batch-seeds", "1", "--max-wait-ms", "0")


def measure(dataset, model, extra, args, label):
    srv = ServerProcess(dataset, model, *extra).wait_ready()
    try:
        print(f"{label}:", flush=True)
        rate, res = asyncio.run(find_max_rate(srv.url, "hybridgnn", slo_ms=args.slo_ms, duration_s=args.duration_s,
                                              nodes_per_request=args.nodes_per_request, start_rate=args.start_rate))
        return rate, res
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--nodes-per-request", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--start-rate", type=float, default=50.0)
    args = ap.parse_args()
    dataset, model = ensure_demo()
    naive_rate, naive = measure(dataset, model, NAIVE, args, "naive (one request at a time)")
    ours_rate, ours = measure(dataset, model, (), args, "hybridgnn serve (defaults)")
    report = {
        "machine": machine(),
        "slo_p99_ms": args.slo_ms,
        "nodes_per_request": args.nodes_per_request,
        "naive": naive.to_dict() if naive else None,
        "hybridgnn": ours.to_dict() if ours else None,
        "ratio_seeds_per_s": round(ours.seeds_per_s / naive.seeds_per_s, 2) if ours and naive else None,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
