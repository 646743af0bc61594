"""Quiver's SLO experiment (§6.2, Fig. 10) on this machine: at a p99 target, how many
requests finish within it, and at what throughput, when batches are bounded by

    PSGS-strict  the largest batch PSGS whose p99 (tail curve) fits the SLO  (--policy slo:<ms>)
    PSGS-loose   the same from the mean curve                                (--policy slo-mean:<ms>)
    fixed size   a seed count tuned to the same target: the strict bound ÷ mean seed PSGS

each driven by the same open-loop Poisson load at 80 % of PSGS-strict's predicted
maximum throughput within the SLO (capped by --max-rate). The server is profiled first
(on --device: the CPU pipeline only by default) unless --profile is given. The prediction simulates the batcher and
workers under Poisson load and charges the front end's CPU per request; this script first
measures that cost on this machine (two short calibration runs at different rates: the
slope of the server's event-loop CPU, and of the load generator's own, which shares the
same cores here, against the request rate) and passes it to every server
(--frontend-cpu-us, --colocated-cpu-us, --request-seeds).

    .venv/bin/python bench/slo_batching.py [--slo-ms 20] [--nodes-per-request 16]      # demo
    .venv/bin/python bench/slo_batching.py --heavy --slo-ms 100 --nodes-per-request 4

--heavy serves the products-scale graph (fanouts 15,10,5) with a 3-layer GraphSAGE of
width 256 (random weights: latency does not depend on them), where compute, not the
HTTP front end, bounds throughput on a small machine, as on Quiver's testbed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import heavy_setup, machine, progress, strict_json, thread_cpu_seconds  # noqa: E402
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.capabilities import HAS_CUDA, raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.scheduler.policy import Profile  # noqa: E402
from hybridgnn.scheduler.queueing import ServingLoad  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402


def calibrate(dataset: Path, model: Path, profile: Path, rate: float, args) -> tuple[float, float, float, float]:
    """(event-loop CPU seconds per second in the server, the load generator's CPU seconds
    per second, answered requests per second, how many times as long as profiled the
    server's batches ran: `service_stretch`) while serving --nodes-per-request requests
    at `rate`."""
    srv = ServerProcess(dataset, model, "--device", args.device, "--profile", str(profile), "--policy",
                        f"slo:{args.slo_ms:g}").wait_ready()
    try:
        run_async(run_load(srv.url, "hybridgnn", rate=rate / 4, duration_s=1.0, nodes_per_request=args.nodes_per_request))
        before, own0 = thread_cpu_seconds(srv.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
        res = run_async(run_load(srv.url, "hybridgnn", rate=rate, duration_s=5.0,
                                 nodes_per_request=args.nodes_per_request))
        after, own1 = thread_cpu_seconds(srv.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
        with urllib.request.urlopen(f"{srv.url}/v2/models/hybridgnn") as r:
            stretch = json.loads(r.read())["parameters"]["service_stretch"].get("cpu") or 1.0
    finally:
        srv.stop()
    loop = sum(after[k] - before.get(k, 0.0) for k in after if not k.startswith(("cpu-worker", "gpu-worker")))
    own = (own1.ru_utime + own1.ru_stime) - (own0.ru_utime + own0.ru_stime)
    rps = res.ok / 5.0
    print(f"  at {rps:.0f} req/s: event loop {loop / 5.0:.2f} cores, load generator {own / 5.0:.2f}; batches ran "
          f"{stretch}x as long as profiled (median)", flush=True)
    return loop / 5.0, own / 5.0, rps, float(stretch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slo-ms", type=float, default=20.0)
    ap.add_argument("--nodes-per-request", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=10.0, help="measured seconds per run")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="seconds at the offered rate before each run")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the three policies")
    ap.add_argument("--load-fraction", type=float, default=0.8, help="offered load as a share of the prediction")
    ap.add_argument("--max-rate", type=float, default=1500.0, help="requests/s the load generator may offer")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--heavy", action="store_true", help="products-scale graph and a 3-layer SAGE of width 256")
    ap.add_argument("--device", choices=["cpu", "cuda", "emulate"], default="cpu",
                    help="pipelines profiled and served (cuda: CPU and GPU, hybrid routing)")
    args = ap.parse_args()
    if args.device == "cuda" and not HAS_CUDA:
        sys.exit(f"{ap.prog}: --device cuda: CUDA is not available here (--device emulate runs the GPU pipeline's "
                 "code on CPU tensors)")
    raise_open_file_limit()
    dataset, model = heavy_setup() if args.heavy else ensure_demo()
    path = args.profile or Path(tempfile.mkdtemp(prefix="hybridgnn-slo-")) / "demo-cpu.json"
    if args.profile is None:
        extra = ["--max-batch", "256", "--min-samples", "60", "--bins", "10"] if args.heavy else []
        subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "profile", "--dataset",
                        str(dataset), "--model", str(model), "--device", args.device, "--budget-s", "240", "--no-plot",
                        "--out", str(path), *extra], check=True)
        print(f"profile: {path} (pass it as --profile to skip profiling next time)", flush=True)
    prof = Profile.load(path)
    # Two calibration runs, near the offer the defaults predict and at half of it, measure
    # how much longer than profiled batches run (service_stretch) and the load generator's
    # CPU. The model's slowdown is drift x share(r) / (1 - r x cost): two rates separate the
    # machine's drift since the profile from the front end's cost per request, which
    # slows the workers through the GIL by more than the event loop's CPU time says.
    strict = prof.policy(f"slo:{args.slo_ms:g}", batching_wait_s=0.002,
                         load=ServingLoad(request_seeds=args.nodes_per_request))
    high = min(args.load_fraction * strict.predicted_seeds_per_s / args.nodes_per_request, args.max_rate)
    (loop_hi, gen_hi, rps_hi, s_hi), (loop_lo, gen_lo, rps_lo, s_lo) = (
        calibrate(dataset, model, path, rate, args) for rate in (high, high / 2))
    colocated_s = gen_hi / rps_hi
    model_cpu = prof.devices["cpu"].model()

    def share(rps: float) -> float:
        return model_cpu.stretch(rps, ServingLoad(frontend_cpu_s=0.0, colocated_cpu_s=colocated_s))

    # s_hi / s_lo = share_hi (1 - r_lo c) / (share_lo (1 - r_hi c)), solved for c
    k = (s_hi / share(rps_hi)) / (s_lo / share(rps_lo))
    cost = (k - 1) / (k * rps_hi - rps_lo) if k > 1 and k * rps_hi > rps_lo else 0.0
    cost = max(cost, 0.0)
    drift = max(s_lo * (1 - rps_lo * cost) / share(rps_lo), 0.1)
    frontend_s = cost if cost > 0 else loop_hi / rps_hi  # no rate effect seen: charge the loop CPU
    print(f"calibration at {rps_lo:.0f} and {rps_hi:.0f} req/s: front-end cost {frontend_s * 1e6:.0f} us per "
          f"request (event loop CPU {loop_hi / rps_hi * 1e6:.0f} us), load generator {colocated_s * 1e6:.0f} us, "
          f"machine {drift:.2f}x as slow as profiled", flush=True)
    load = ServingLoad(request_seeds=args.nodes_per_request, frontend_cpu_s=frontend_s, colocated_cpu_s=colocated_s,
                       service_scale=drift)
    strict = prof.policy(f"slo:{args.slo_ms:g}", batching_wait_s=0.002, load=load)
    fixed_seeds = max(1, int(strict.max_batch_psgs / prof.mean_seed_psgs))
    rate = min(args.load_fraction * strict.predicted_seeds_per_s / args.nodes_per_request, args.max_rate)
    costs = ["--request-seeds", str(args.nodes_per_request), "--frontend-cpu-us", f"{frontend_s * 1e6:.0f}",
             "--colocated-cpu-us", f"{colocated_s * 1e6:.0f}", "--service-scale", f"{drift:.3f}"]
    configs = {
        "psgs_strict": ["--profile", str(path), "--policy", f"slo:{args.slo_ms:g}", *costs],
        "psgs_loose": ["--profile", str(path), "--policy", f"slo-mean:{args.slo_ms:g}", *costs],
        "fixed_batch": ["--max-batch-seeds", str(fixed_seeds)],
    }
    report = {"machine": machine(), "device": args.device, "slo_ms": args.slo_ms, "offered_rps": round(rate, 1),
              "load_fraction": args.load_fraction, "nodes_per_request": args.nodes_per_request,
              "frontend_cpu_us": round(frontend_s * 1e6), "loadgen_cpu_us": round(colocated_s * 1e6),
              "service_scale": round(drift, 3),
              "strict_batch_psgs": round(strict.max_batch_psgs), "fixed_batch_seeds": fixed_seeds,
              "strict_predicted_seeds_per_s": round(strict.predicted_seeds_per_s), "results": {}}
    progress({k: v for k, v in report.items() if k != "results"})
    # Rounds visit the policies in turn, each server warmed at the offered rate first: on
    # this VM a run's speed drifts with what ran before it, so one pass in a fixed order
    # would favour whichever policy comes last.
    runs: dict[str, list] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, extra in configs.items():
            srv = ServerProcess(dataset, model, "--device", args.device, *extra).wait_ready()
            try:
                run_async(run_load(srv.url, "hybridgnn", rate=rate, duration_s=args.warmup_s,
                                   nodes_per_request=args.nodes_per_request))
                res = run_async(run_load(srv.url, "hybridgnn", rate=rate, duration_s=args.duration_s,
                                         nodes_per_request=args.nodes_per_request, keep_latencies=True))
            finally:
                srv.stop()
            runs[name].append(res)
            lat = np.asarray(res.latencies_ms)
            print(f"round {round_ + 1} {name}: {float((lat <= args.slo_ms).mean()):.4f} within the SLO, "
                  f"p99 {res.p99_ms:.1f} ms", flush=True)
    for name, results in runs.items():
        lat = np.concatenate([np.asarray(r.latencies_ms) for r in results])
        report["results"][name] = {
            "within_slo": round(float((lat <= args.slo_ms).mean()), 4),
            "within_slo_per_round": [round(float((np.asarray(r.latencies_ms) <= args.slo_ms).mean()), 4)
                                     for r in results],
            "seeds_per_s": round(float(np.mean([r.seeds_per_s for r in results]))),
            # of the answered requests (a refused or failed one is inf: outside the SLO, no latency)
            "answered_p50_ms": round(float(np.quantile(lat[np.isfinite(lat)], 0.5)), 2) if np.isfinite(lat).any()
            else None,
            "answered_p99_ms": round(float(np.quantile(lat[np.isfinite(lat)], 0.99)), 2) if np.isfinite(lat).any()
            else None,
            "rejected": sum(r.rejected for r in results), "errors": sum(r.errors for r in results)}
    fixed = report["results"]["fixed_batch"]
    report["vs_fixed_batch"] = {  # each PSGS bound against the fixed batch size, same run
        name: {"within_slo": round(r["within_slo"] / fixed["within_slo"], 3) if fixed["within_slo"] else None,
               "seeds_per_s": round(r["seeds_per_s"] / fixed["seeds_per_s"], 3) if fixed["seeds_per_s"] else None}
        for name, r in report["results"].items() if name != "fixed_batch"}
    print(strict_json(report))


if __name__ == "__main__":
    main()
