"""Event-loop CPU per request of the two HTTP front ends (`--http-server builtin` against
`--http-server aiohttp`), same engine, demo graph and model, at the same offered rate.

Both servers run with --worker-processes, so the event-loop thread does only front-end
work (HTTP, codec, batcher, telemetry, handing batches to the worker threads' pipes is
on other threads) and no model Python competes for its GIL. The figure is the main
thread's CPU seconds (user + system, from /proc) divided by the requests answered.

    .venv/bin/python bench/http_frontend.py [--rate 1000] [--duration-s 10] [--nodes-per-request 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, main_thread_cpu_seconds  # noqa: E402
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402


def measure(dataset, model, http_server: str, args) -> dict:
    srv = ServerProcess(dataset, model, "--worker-processes", "--http-server", http_server).wait_ready()
    try:
        # a short warm-up: connections open, caches fill, the children load their model
        run_async(run_load(srv.url, "hybridgnn", rate=args.rate, duration_s=2.0,
                           nodes_per_request=args.nodes_per_request))
        before = main_thread_cpu_seconds(srv.proc.pid)
        res = run_async(run_load(srv.url, "hybridgnn", rate=args.rate, duration_s=args.duration_s,
                                 nodes_per_request=args.nodes_per_request))
        loop_s = main_thread_cpu_seconds(srv.proc.pid) - before
    finally:
        srv.stop()
    out = {"http_server": http_server, "loop_us_per_request": round(loop_s / max(res.ok, 1) * 1e6, 1),
           "ok": res.ok, "achieved_rps": round(res.achieved_rps), "p50_ms": round(res.p50_ms, 2),
           "p99_ms": round(res.p99_ms, 2), "errors": res.errors, "rejected": res.rejected}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=1000.0, help="offered requests per second")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--nodes-per-request", type=int, default=1)
    args = ap.parse_args()
    raise_open_file_limit()
    dataset, model = ensure_demo()
    builtin = measure(dataset, model, "builtin", args)
    aio = measure(dataset, model, "aiohttp", args)
    print(json.dumps({
        "machine": machine(), "rate": args.rate, "nodes_per_request": args.nodes_per_request,
        "builtin": builtin, "aiohttp": aio,
        "aiohttp_over_builtin_loop_cpu": round(aio["loop_us_per_request"] / builtin["loop_us_per_request"], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
