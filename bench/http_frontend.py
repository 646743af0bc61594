"""Event-loop CPU per request of the current server against a baseline revision (default
e9a9a2f: the hand-written HTTP parser, before the llhttp front end and queue-delay
admission), same demo graph and model, same offered rate, in the same run; the baseline
runs from a git worktree of that revision (bench/common.py: serve_revision).

Both servers run with --worker-processes, so the event-loop thread does only front-end
work (HTTP, codec, admission, batcher, telemetry; handing batches to the worker threads'
pipes is on other threads) and no model Python competes for its GIL. The figure is the
main thread's CPU seconds (user + system, from /proc) divided by the requests answered,
over --duration-s of open-loop Poisson load after a 2 s warm-up at the same rate; beside
it, the whole server's (every process and thread it started: front ends, workers).
--rounds > 1 alternates the two servers (current, baseline, current, ...) and reports
each round and the median.

--mode precomputed sends one-seed lookups of stored embeddings (JSON, the logits output)
instead of sampled inferences; with --frontends N both servers run N front-end processes.

    .venv/bin/python bench/http_frontend.py [--rate 1000] [--duration-s 10] [--nodes-per-request 1]
    .venv/bin/python bench/http_frontend.py --rate 1500 --rounds 3 --baseline-rev e9a9a2f
    .venv/bin/python bench/http_frontend.py --mode precomputed --rate 3000 --rounds 3 --baseline-rev 99f7a1e
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    BASELINE_REV,
    machine,
    main_thread_cpu_seconds,
    process_tree_cpu_seconds,
    progress,
    serve_revision,
    strict_json,
)
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402


def lookup_bodies(num_nodes: int):
    """run_load's make_bodies: one-seed precomputed JSON lookups of the logits output."""
    head = b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":['
    tail = b']}],"parameters":{"mode":"precomputed"},"outputs":[{"name":"logits"}]}'

    def make(rng, count: int) -> list[tuple[bytes, dict]]:
        return [(head + str(int(i)).encode() + tail, {"Content-Type": "application/json"})
                for i in rng.integers(0, num_nodes, size=count)]

    return make


def measure(dataset, model, rev: str | None, args) -> dict:
    extra = ("--frontends", str(args.frontends)) if args.frontends is not None else ()  # older revisions lack it
    srv = serve_revision(rev, dataset, model, "--worker-processes", *extra)
    meta = Path(dataset) / "meta.json"
    num_nodes = json.loads(meta.read_text())["num_nodes"] if meta.exists() else 50_000  # the demo's
    bodies = lookup_bodies(num_nodes) if args.mode == "precomputed" else None

    def load(duration_s: float):
        return run_async(run_load(srv.url, "hybridgnn", rate=args.rate, duration_s=duration_s,
                                  nodes_per_request=args.nodes_per_request, make_bodies=bodies))

    try:
        load(2.0)  # a short warm-up: connections open, caches fill, the children load their model
        before, tree_before = main_thread_cpu_seconds(srv.pid), process_tree_cpu_seconds(srv.pid)
        res = load(args.duration_s)
        loop_s = main_thread_cpu_seconds(srv.pid) - before
        tree_s = process_tree_cpu_seconds(srv.pid) - tree_before
    finally:
        srv.stop()
    out = {"server": "current" if rev is None else f"baseline {rev}",
           "loop_us_per_request": round(loop_s / max(res.ok, 1) * 1e6, 1),
           "server_us_per_request": round(tree_s / max(res.ok, 1) * 1e6, 1),
           "loop_cores": round(loop_s / args.duration_s, 3),
           "ok": res.ok, "achieved_rps": round(res.achieved_rps), "p50_ms": round(res.p50_ms, 2),
           "p99_ms": round(res.p99_ms, 2), "errors": res.errors, "rejected": res.rejected}
    progress(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0, help="offered requests per second")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--nodes-per-request", type=int, default=1)
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the baseline server")
    ap.add_argument("--rounds", type=int, default=1, help="alternating current/baseline pairs")
    ap.add_argument("--mode", choices=("sampled", "precomputed"), default="sampled",
                    help="sampled inferences, or one-seed lookups of stored embeddings")
    ap.add_argument("--frontends", type=int, default=None,
                    help="front-end processes of both servers (default: the server's own default)")
    args = ap.parse_args()
    raise_open_file_limit()
    dataset, model = ensure_demo()
    current, baseline = [], []
    for _ in range(args.rounds):
        current.append(measure(dataset, model, None, args))
        baseline.append(measure(dataset, model, args.baseline_rev, args))
    cur = round(statistics.median(r["loop_us_per_request"] for r in current), 1)
    base = round(statistics.median(r["loop_us_per_request"] for r in baseline), 1)
    cur_all = round(statistics.median(r["server_us_per_request"] for r in current), 1)
    base_all = round(statistics.median(r["server_us_per_request"] for r in baseline), 1)
    print(strict_json({
        "machine": machine(), "mode": args.mode, "frontends": args.frontends, "rate": args.rate,
        "duration_s": args.duration_s, "nodes_per_request": args.nodes_per_request, "baseline_rev": args.baseline_rev,
        "current": current if args.rounds > 1 else current[0],
        "baseline": baseline if args.rounds > 1 else baseline[0],
        "current_loop_us_per_request": cur, "baseline_loop_us_per_request": base,
        "baseline_over_current_loop_cpu": round(base / cur, 2) if cur else None,
        "current_server_us_per_request": cur_all, "baseline_server_us_per_request": base_all,
        "baseline_over_current_server_cpu": round(base_all / cur_all, 2) if cur_all else None,
    }))


if __name__ == "__main__":
    main()
