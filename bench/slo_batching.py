"""Quiver's SLO experiment (§6.2, Fig. 10) on this machine: at a p99 target, how many
requests finish within it, and at what throughput, when batches are bounded by

    PSGS-strict  the largest batch PSGS whose p99 (tail curve) fits the SLO  (--policy slo:<ms>)
    PSGS-loose   the same from the mean curve                                (--policy slo-mean:<ms>)
    fixed size   a seed count tuned to the same target: the strict bound ÷ mean seed PSGS

each driven by the same open-loop Poisson load at 80 % of PSGS-strict's predicted
throughput (capped by --max-rate, what the HTTP front end can carry here). The server
is profiled first (CPU pipeline only) unless --profile is given.

    .venv/bin/python bench/slo_batching.py [--slo-ms 20] [--nodes-per-request 16]      # demo
    .venv/bin/python bench/slo_batching.py --heavy --slo-ms 100 --nodes-per-request 4

--heavy serves the products-scale graph (fanouts 15,10,5) with a 3-layer GraphSAGE of
width 256 (random weights: latency does not depend on them), where compute, not the
HTTP front end, bounds throughput on a small machine, as on Quiver's testbed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine  # noqa: E402
from hybridgnn.bench.loadgen import run_load  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.profiling.profile import Profile  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402


def heavy_setup():
    """The products-scale graph and a 3-layer SAGE (hidden 256) with random weights."""
    import torch

    from bench.common import PRODUCTS, ensure_products
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.gnn import GNN, ModelSpec

    ensure_products(PRODUCTS)
    model_dir = PRODUCTS.parent / "products-sage3-256"
    if not (model_dir / "model.pt").is_file():
        graph = GraphStore.open(PRODUCTS)
        torch.manual_seed(0)
        model = GNN(ModelSpec("sage", graph.feature_dim, 256, 47, num_layers=3)).eval()
        save_checkpoint(model, model_dir, extra={"fanouts": [15, 10, 5], "dataset_fingerprint": graph.fingerprint})
    return PRODUCTS, model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slo-ms", type=float, default=20.0)
    ap.add_argument("--nodes-per-request", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--load-fraction", type=float, default=0.8, help="offered load as a share of the prediction")
    ap.add_argument("--max-rate", type=float, default=1500.0, help="requests/s the load generator may offer")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--heavy", action="store_true", help="products-scale graph and a 3-layer SAGE of width 256")
    args = ap.parse_args()
    raise_open_file_limit()
    dataset, model = heavy_setup() if args.heavy else ensure_demo()
    path = args.profile or Path(tempfile.mkdtemp(prefix="hybridgnn-slo-")) / "demo-cpu.json"
    if args.profile is None:
        extra = ["--max-batch", "256", "--min-samples", "60", "--bins", "10"] if args.heavy else []
        subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "profile", "--dataset",
                        str(dataset), "--model", str(model), "--device", "cpu", "--budget-s", "240", "--no-plot",
                        "--out", str(path), *extra], check=True)
    prof = Profile.load(path)
    strict = prof.policy(f"slo:{args.slo_ms:g}", batching_wait_s=0.002)
    fixed_seeds = max(1, int(strict.max_batch_psgs / prof.mean_seed_psgs))
    rate = min(args.load_fraction * strict.predicted_seeds_per_s / args.nodes_per_request, args.max_rate)
    configs = {
        "psgs_strict": ["--profile", str(path), "--policy", f"slo:{args.slo_ms:g}"],
        "psgs_loose": ["--profile", str(path), "--policy", f"slo-mean:{args.slo_ms:g}"],
        "fixed_batch": ["--max-batch-seeds", str(fixed_seeds)],
    }
    report = {"machine": machine(), "slo_ms": args.slo_ms, "offered_rps": round(rate, 1),
              "load_fraction": args.load_fraction,
              "nodes_per_request": args.nodes_per_request, "fixed_batch_seeds": fixed_seeds,
              "strict_predicted_seeds_per_s": round(strict.predicted_seeds_per_s), "results": {}}
    for name, extra in configs.items():
        srv = ServerProcess(dataset, model, "--device", "cpu", *extra).wait_ready()
        try:
            run_async(run_load(srv.url, "hybridgnn", rate=rate / 4, duration_s=1.0,
                               nodes_per_request=args.nodes_per_request))  # warm
            res = run_async(run_load(srv.url, "hybridgnn", rate=rate, duration_s=args.duration_s,
                                     nodes_per_request=args.nodes_per_request, keep_latencies=True))
        finally:
            srv.stop()
        lat = np.asarray(res.latencies_ms)
        within = float((lat <= args.slo_ms).mean()) if lat.size else 0.0
        report["results"][name] = {"within_slo": round(within, 4), "seeds_per_s": round(res.seeds_per_s),
                                   "p50_ms": round(res.p50_ms, 2), "p99_ms": round(res.p99_ms, 2),
                                   "rejected": res.rejected, "errors": res.errors}
        print(name, json.dumps(report["results"][name]), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
