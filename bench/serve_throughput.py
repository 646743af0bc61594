"""Served throughput (seeds/s) within a p99 SLO: `hybridgnn serve` against a naive server
that handles one request at a time without batching (bench/naive_server.py: aiohttp on
uvloop, the same codec, sampler and model, run inline per request), and against `hybridgnn serve`
with batching switched off (isolating what batching itself adds), in its throughput
settings (THROUGHPUT below), and as of a baseline git revision with its defaults
(`baseline`, default e9a9a2f: the hand-written HTTP parser and a fixed --max-pending cap,
before the llhttp front end and queue-delay admission; run from a git worktree by
bench/common.py's serve_revision), so served throughput before and after a change is
measured in one run. Same demo graph, model and machine, driven by the open-loop Poisson
load generator.

    .venv/bin/python bench/serve_throughput.py [--slo-ms 50] [--nodes-per-request 4]
    .venv/bin/python bench/serve_throughput.py --heavy      # products graph, 3-layer SAGE 256
    .venv/bin/python bench/serve_throughput.py --servers throughput   # naive vs throughput settings only
    .venv/bin/python bench/serve_throughput.py --naive-threads 1 --servers defaults,baseline   # before/after
    .venv/bin/python bench/serve_throughput.py --naive-threads 1 --servers defaults,wait   # no wait on a quiet server

`wait` is the defaults with `--wait-when-idle` (each batch held --max-wait-ms to fill even
on a quiet server, the rule before). For `defaults`, `wait` and `baseline` the bench also
reports latency at a light load (--light-rate requests/s, default 100), where a request's
fixed costs show: a request that finds no batch under way goes at once, or waits; a
batch reaches a worker process through a thread, or straight from the event loop.

The naive server runs its model with --naive-threads intra-op threads (default: 1 and 2,
each measured; the better one is the baseline), so it may use the second core too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BASELINE_REV, heavy_setup, machine, serve_revision, strict_json  # noqa: E402
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.bench.search import find_max_rate  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

NO_BATCHING = ("--max-batch-requests", "1", "--max-batch-seeds", "1", "--max-wait-ms", "0")
# Throughput settings: workers in their own processes (the model never holds the event
# loop's GIL) and batches allowed to wait 8 ms to fill (fewer, larger batches: less CPU per seed).
THROUGHPUT = ("--worker-processes", "on", "--max-wait-ms", "8")
NAIVE_COMMAND = [sys.executable, str(Path(__file__).resolve().parent / "naive_server.py")]


def measure(dataset, model, extra, args, label, command=None, rev=None, light=False):
    """find_max_rate against a server: this working tree's (`command` replacing the
    program), or git revision `rev`'s. light: first the latency at --light-rate requests/s
    (returned third; else None)."""
    srv = (serve_revision(rev, dataset, model, *extra) if rev is not None
           else ServerProcess(dataset, model, *extra, command=command).wait_ready())
    try:
        print(f"{label}:", flush=True)
        quiet = None
        if light:
            quiet = run_async(run_load(srv.url, "hybridgnn", rate=args.light_rate, duration_s=args.duration_s,
                                       nodes_per_request=args.nodes_per_request))
            print(f"  at {args.light_rate:g} req/s: p50 {quiet.p50_ms:.2f} ms, p99 {quiet.p99_ms:.2f} ms", flush=True)
        rate, res = run_async(find_max_rate(srv.url, "hybridgnn", slo_ms=args.slo_ms, duration_s=args.duration_s,
                                              nodes_per_request=args.nodes_per_request, start_rate=args.start_rate))
        return rate, res, quiet
    finally:
        srv.stop()


def ratio(a, b) -> float | None:
    return round(a.seeds_per_s / b.seeds_per_s, 2) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--nodes-per-request", type=int, default=1)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--start-rate", type=float, default=50.0)
    ap.add_argument("--naive-threads", default="1,2", help="intra-op thread counts to try for the naive server")
    ap.add_argument("--heavy", action="store_true", help="products-scale graph and a 3-layer SAGE of width 256")
    ap.add_argument("--servers", default="off,defaults,throughput,baseline",
                    help="which hybridgnn servers to measure besides the naive one (off = batching off, "
                         "throughput = the THROUGHPUT settings, baseline = defaults as of --baseline-rev, "
                         "wait = defaults with --wait-when-idle)")
    ap.add_argument("--light-rate", type=float, default=100.0,
                    help="requests/s of the light load at which `defaults` and `wait` latency is also reported")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision the baseline server runs")
    args = ap.parse_args()
    wanted = set(args.servers.split(","))
    unknown = wanted - {"off", "defaults", "throughput", "baseline", "wait"}
    if unknown:  # before the naive server's minutes of measurement, not after
        ap.error(f"unknown --servers entries {sorted(unknown)}; take off, defaults, throughput, baseline, wait")
    raise_open_file_limit()
    dataset, model = heavy_setup() if args.heavy else ensure_demo()
    naive_runs = {}
    for threads in (int(t) for t in args.naive_threads.split(",")):
        _, res, _ = measure(dataset, model, (), args, f"naive server (one request at a time, {threads} torch threads)",
                            command=[*NAIVE_COMMAND, "--torch-threads", str(threads)])
        naive_runs[threads] = res
    measured = {t: r for t, r in naive_runs.items() if r is not None}
    naive_threads = max(measured, key=lambda t: measured[t].seeds_per_s) if measured else None
    naive = measured.get(naive_threads)

    light = {}

    def maybe(name, extra, label, rev=None):
        if name not in wanted:
            return None
        _, res, quiet = measure(dataset, model, extra, args, label, rev=rev,
                                light=name in ("defaults", "wait", "baseline"))
        if quiet is not None:
            light[name] = {"p50_ms": round(quiet.p50_ms, 2), "p99_ms": round(quiet.p99_ms, 2)}
        return res

    unbatched = maybe("off", NO_BATCHING, "hybridgnn serve, batching off")
    ours = maybe("defaults", (), "hybridgnn serve (defaults)")
    waiting = maybe("wait", ("--wait-when-idle",), "hybridgnn serve --wait-when-idle")
    tuned = maybe("throughput", THROUGHPUT, f"hybridgnn serve {' '.join(THROUGHPUT)}")
    baseline = maybe("baseline", (), f"hybridgnn serve (defaults) at revision {args.baseline_rev}",
                     rev=args.baseline_rev)
    report = {
        "machine": machine(),
        "slo_p99_ms": args.slo_ms,
        "nodes_per_request": args.nodes_per_request,
        "dataset": str(dataset), "model": str(model),
        "naive": naive.to_dict() if naive else None,
        "naive_torch_threads": naive_threads,
        "naive_seeds_per_s_by_threads": {t: round(r.seeds_per_s) for t, r in measured.items()},
        "hybridgnn_batching_off": unbatched.to_dict() if unbatched else None,
        "hybridgnn": ours.to_dict() if ours else None,
        "hybridgnn_throughput_settings": tuned.to_dict() if tuned else None,
        "throughput_settings": " ".join(THROUGHPUT),
        "hybridgnn_baseline": baseline.to_dict() if baseline else None,
        "baseline_rev": args.baseline_rev,
        "ratio_vs_naive_seeds_per_s": ratio(ours, naive),
        "ratio_throughput_settings_vs_naive_seeds_per_s": ratio(tuned, naive),
        "ratio_baseline_vs_naive_seeds_per_s": ratio(baseline, naive),
        "ratio_vs_batching_off_seeds_per_s": ratio(ours, unbatched),
        "ratio_vs_baseline_seeds_per_s": ratio(ours, baseline),
        "hybridgnn_wait_when_idle": waiting.to_dict() if waiting else None,
        "ratio_vs_wait_when_idle_seeds_per_s": ratio(ours, waiting),
        "light_load_p50_vs_baseline": (round(light["defaults"]["p50_ms"] / light["baseline"]["p50_ms"], 2)
                                       if "defaults" in light and "baseline" in light else None),
        "light_load_rps": args.light_rate,
        "light_load_latency": light,
    }
    print(strict_json(report))


if __name__ == "__main__":
    main()
