"""Served seeds/s within a p99 SLO for CPU-only, GPU-only and hybrid routing, in process
(requests submitted straight to the engine) and through HTTP (`hybridgnn serve` and the
open-loop Poisson client of bench/overload.py), on a skewed request mix.

Mix: each request's seeds are drawn with p(node) proportional to its degree; request
sizes are 2**k seeds with k uniform in 0..--max-log2-size (1 to 256 by default), so
batches range from a handful of light seeds to thousands of heavy ones.

Policies (same engine code, same graph, same model, same run):
    cpu     --device cpu                                   CPU pipeline only
    gpu     --device cuda --psgs-threshold 0 --no-spill    GPU pipeline only
    hybrid  --device cuda                                  PSGS routing, spill when saturated; on a
                                                           GPU the CPU lane is Quiver's (--cpu-lane split:
                                                           CPU workers sample, the GPU gathers and computes)
    hybrid_model  --device cuda --cpu-lane model           the CPU lane also gathers and runs the model
    hybrid_threads  hybrid with --worker-processes off (--policies to add it)
    hybrid_slo  --device cuda --profile P --policy slo:<SLO> --request-seeds <the mix's mean>
                                                           (with --profile: the profile's choice)

For each, the highest offered rate whose p99 stays within --slo-ms with nothing refused:
doubling from --start-rate, then bisection. The figure is hybrid ÷ the better single
device. Without CUDA, "gpu" runs the GPU pipeline's code on CPU tensors (--device emulate)
and the report says so.

    .venv/bin/python bench/hybrid_policies.py [--heavy [--layers 2]] [--slo-ms 30] [--modes engine,http]

--heavy --layers 2 serves a 2-layer SAGE with fanouts 15,10 instead: Quiver's products
setting (its paper reports 570,000 seeds/s on one A6000), for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, heavy_setup, machine, progress, serve_revision  # noqa: E402
from bench.overload import encode, open_loop  # noqa: E402
from hybridgnn.capabilities import HAS_CUDA  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.errors import ServingError  # noqa: E402
from hybridgnn.types import ServingStats  # noqa: E402

POLICIES = {
    "cpu": ["--device", "cpu"],
    "gpu": ["--device", "{gpu}", "--psgs-threshold", "0", "--no-spill"],
    "hybrid": ["--device", "{gpu}"],
    "hybrid_model": ["--device", "{gpu}", "--cpu-lane", "model"],
    "hybrid_threads": ["--device", "{gpu}", "--worker-processes", "off"],
}


def request_mix(dataset: Path, count: int, max_log2: int, seed: int) -> list[np.ndarray]:
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.workload.tables import seed_distribution

    graph = GraphStore.open(dataset)
    p, _ = seed_distribution(graph, "degree")
    rng = np.random.default_rng(seed)
    sizes = 2 ** rng.integers(0, max_log2 + 1, size=count)
    flat = rng.choice(graph.num_nodes, size=int(sizes.sum()), p=p).astype(np.int64)
    return np.split(flat, np.cumsum(sizes)[:-1])


def summarise(statuses: np.ndarray, latencies_s: np.ndarray, sizes: np.ndarray, duration_s: float) -> dict:
    ok = statuses == 200
    lat = latencies_s[ok] * 1000.0
    return {"sent": int(statuses.size), "ok": int(ok.sum()), "refused": int(np.isin(statuses, (429, 503)).sum()),
            "errors": int((~ok & ~np.isin(statuses, (429, 503))).sum()),
            "seeds_per_s": float(sizes[ok].sum() / duration_s),
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan")}


async def engine_trial(engine, mix: list[np.ndarray], rate: float, duration_s: float, seed: int) -> dict:
    """Poisson arrivals straight into engine.submit; latency from the scheduled arrival."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.2) + 16))
    arrivals = arrivals[arrivals < duration_s]
    n = len(arrivals)
    statuses, latencies = np.zeros(n, dtype=np.int64), np.zeros(n)
    sizes = np.array([mix[i % len(mix)].size for i in range(n)])
    futures = []
    start = time.perf_counter()

    def finished(i: int, at: float, fut: asyncio.Future) -> None:
        latencies[i] = time.perf_counter() - at
        statuses[i] = 500 if fut.cancelled() or fut.exception() is not None else 200

    for i, offset in enumerate(arrivals.tolist()):
        at = start + offset
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            fut = engine.submit(mix[i % len(mix)])
        except ServingError as exc:
            statuses[i] = exc.status
            continue
        fut.add_done_callback(lambda f, i=i, at=at: finished(i, at, f))
        futures.append(fut)
    if futures:
        await asyncio.wait(futures, timeout=60.0)
    return summarise(statuses, latencies, sizes, duration_s)


async def http_trial(url: str, wire: list[bytes], sizes: np.ndarray, rate: float, duration_s: float,
                     seed: int) -> dict:
    res = await open_loop(url, wire, rate, duration_s, seed, preopen=64)
    n = res["statuses"].size
    return summarise(res["statuses"], res["latencies_s"], sizes[np.arange(n) % sizes.size], duration_s)


async def max_rate(trial, *, slo_ms: float, start_rate: float, bisect_steps: int, label: str) -> dict:
    """Highest rate (requests/s) whose trial meets the SLO with nothing refused or failed."""
    def meets(r: dict) -> bool:
        return r["p99_ms"] <= slo_ms and r["refused"] == 0 and r["errors"] == 0 and r["ok"] == r["sent"]

    async def tried(rate: float) -> dict:
        res = await trial(rate)
        print(f"  {label:14s} {rate:9.1f} req/s -> {res['seeds_per_s']:11.0f} seeds/s p99 {res['p99_ms']:8.2f} ms "
              f"refused {res['refused']} errors {res['errors']}", flush=True)
        for lane, b in res.get("batches", {}).items():  # in process: each lane's batches
            print(f"  {'':14s} {lane}: {json.dumps(b)}", flush=True)
        return res

    await trial(start_rate / 2, warm=True)
    good, good_res, bad, rate = 0.0, None, None, start_rate
    while rate < 1e6:
        res = await tried(rate)
        if not meets(res):
            bad = rate
            break
        good, good_res, rate = rate, res, rate * 2
    for _ in range(bisect_steps if bad is not None else 0):
        mid = (good + bad) / 2 if good else bad / 2
        res = await tried(mid)
        if meets(res):
            good, good_res = mid, res
        else:
            bad = mid
    return {"max_rate_rps": good, **(good_res or {"seeds_per_s": 0.0})}


def serve_args(dataset: Path, model: Path, flags: list[str]) -> list[str]:
    return ["serve", "--dataset", str(dataset), "--model", str(model), *flags]


class BatchTally(ServingStats):
    """Each lane's batches over one trial: how many, their seeds and requests, and the
    median of each stage. It says where a lane's capacity goes (batches too small, a
    stage too slow, a queue before the device)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rows: dict[str, list[tuple[float, ...]]] = {}
        self.t0 = time.perf_counter()

    def batch_done(self, pipeline, timings, num_seeds, num_requests, psgs, sampled_edges, gathered_rows) -> None:
        self.rows.setdefault(pipeline, []).append((num_seeds, num_requests, timings.queue_wait_s, timings.sample_s,
                                                    timings.gather_s, timings.compute_s))

    def summary(self) -> dict:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        out = {}
        for lane, rows in self.rows.items():
            a = np.asarray(rows, dtype=np.float64)
            out[lane] = {"batches_per_s": round(len(a) / wall, 1), "mean_seeds": round(float(a[:, 0].mean()), 1),
                         "mean_requests": round(float(a[:, 1].mean()), 2),
                         **{f"median_{k}_ms": round(float(np.median(a[:, i])) * 1e3, 3)
                            for i, k in enumerate(("queue_wait", "sample", "gather", "compute"), start=2)}}
        return out


async def engine_level(dataset, model, flags, mix, args) -> dict:
    from hybridgnn.cli.main import build_parser
    from hybridgnn.cli.serve import build_config
    from hybridgnn.serving.core.engine import open_engine

    cfg = build_config(build_parser().parse_args(serve_args(dataset, model, flags)))
    tally = BatchTally()
    engine = await open_engine(cfg, tally)
    try:
        async def trial(rate, warm=False):
            tally.reset()
            res = await engine_trial(engine, mix, rate, 1.0 if warm else args.trial_s, seed=int(rate))
            return {**res, "batches": tally.summary()}
        res = await max_rate(trial, slo_ms=args.slo_ms, start_rate=args.start_rate,
                             bisect_steps=args.bisect_steps, label="engine")
        return {**res, "diagnostics": diagnostics(engine.metadata())}
    finally:
        await engine.stop()


def diagnostics(meta: dict) -> dict:
    """What the server decided over the trials: its policy and refusal counts."""
    return {k: meta.get(k) for k in ("policy", "psgs_threshold", "max_batch_psgs", "predicted_seeds_per_s",
                                       "service_stretch", "admission")}


async def http_level(dataset, model, flags, mix, args) -> dict:
    srv = serve_revision(None, dataset, model, *flags)
    try:
        wire = encode(srv.url, "hybridgnn", mix, None)
        sizes = np.array([m.size for m in mix])

        async def trial(rate, warm=False):
            return await http_trial(srv.url, wire, sizes, rate, 1.0 if warm else args.trial_s, seed=int(rate))
        res = await max_rate(trial, slo_ms=args.slo_ms, start_rate=args.start_rate,
                             bisect_steps=args.bisect_steps, label="http")
        with urllib.request.urlopen(f"{srv.url}/v2/models/hybridgnn", timeout=10) as r:
            meta = json.loads(r.read())["parameters"]
        return {**res, "diagnostics": diagnostics(meta)}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heavy", action="store_true", help="products-scale graph, 3-layer SAGE of width 256")
    ap.add_argument("--layers", type=int, choices=(2, 3), default=3,
                    help="with --heavy: 2 for the 2-layer SAGE with fanouts 15,10 (Quiver's products setting)")
    ap.add_argument("--slo-ms", type=float, default=30.0)
    ap.add_argument("--modes", default="engine,http")
    ap.add_argument("--policies", default="cpu,gpu,hybrid")
    ap.add_argument("--max-log2-size", type=int, default=8, help="request sizes 1 .. 2**this seeds")
    ap.add_argument("--trial-s", type=float, default=3.0, help="seconds of load per tried rate")
    ap.add_argument("--start-rate", type=float, default=50.0)
    ap.add_argument("--bisect-steps", type=int, default=3)
    ap.add_argument("--extra", default="", help="more serve flags for every policy, space-separated")
    ap.add_argument("--profile", type=Path, default=None,
                    help="a CPU-vs-GPU profile of this graph and model: adds the hybrid_slo policy")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    policies = args.policies.split(",")
    flags_of = dict(POLICIES)
    if args.layers != 3 and not args.heavy:
        ap.error("--layers picks the --heavy model")
    dataset, model = heavy_setup(args.layers) if args.heavy else ensure_demo()
    gpu = "cuda" if HAS_CUDA else "emulate"
    mix = request_mix(dataset, 4096, args.max_log2_size, seed=0)
    mean_seeds = float(np.mean([m.size for m in mix]))
    if args.profile is not None:
        # The SLO choice is told the traffic's mean request size, as an operator who knows
        # it would (--adapt measures it live); its default (8 seeds) would bound batches
        # below one of this mix's mean requests.
        flags_of["hybrid_slo"] = ["--device", "{gpu}", "--profile", str(args.profile), "--policy",
                                  f"slo:{args.slo_ms:g}", "--request-seeds", f"{mean_seeds:.1f}"]
        policies.append("hybrid_slo")
    report = {"machine": machine(), "gpu_pipeline": gpu if HAS_CUDA else "emulate (no GPU: its code on CPU tensors)",
              "dataset": str(dataset), "model": str(model), "slo_ms": args.slo_ms, "mean_request_seeds": mean_seeds,
              "results": {}}
    for mode in args.modes.split(","):
        for name in policies:
            # One admission bound for every policy: this measures routing, and the trials
            # judge p99 against the SLO themselves (an slo: policy would otherwise refuse
            # at a tighter bound than the others and count as failing early).
            flags = [f.format(gpu=gpu) for f in flags_of[name]] + ["--max-queue-delay-ms", "1000"] + args.extra.split()
            print(f"{mode} / {name}: serve {' '.join(flags)}", flush=True)
            run = engine_level if mode == "engine" else http_level
            try:
                res = asyncio.run(run(dataset, model, flags, mix, args))
            except Exception as exc:  # one broken policy must not hide the others' figures
                res = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            report["results"][f"{mode}/{name}"] = res
            progress({f"{mode}/{name}": res})
        single = [report["results"].get(f"{mode}/{p}", {}).get("seeds_per_s", 0.0) for p in ("cpu", "gpu")]
        rate = {p: report["results"].get(f"{mode}/{p}", {}).get("seeds_per_s", 0.0) for p in policies}
        hybrid = max(rate.get(p, 0.0) for p in ("hybrid", "hybrid_model", "hybrid_threads", "hybrid_slo"))
        if max(single) > 0:
            report[f"{mode}_hybrid_vs_best_single"] = round(hybrid / max(single), 3)
        if rate.get("hybrid", 0) > 0 and rate.get("hybrid_model", 0) > 0:  # Quiver's CPU lane against the CPU model
            report[f"{mode}_split_lane_vs_model_lane"] = round(rate["hybrid"] / rate["hybrid_model"], 3)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
