"""A user's own PyG model served against the built-in one: served seeds/s within a p99 SLO
and latency for the demo's built-in GraphSAGE (hidden 64, 2 layers) and a
torch_geometric.nn.models.GraphSAGE of the same width with BatchNorm and jk='last' (an
extra norm per layer and a linear head), both on the demo graph, in one run; and the
golden check's cost at load (median of repeated load_model calls, against loading the
weights alone).

    .venv/bin/python bench/user_model.py [--slo-ms 50] [--nodes-per-request 4] [--out F.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, machine  # noqa: E402
from hybridgnn.bench.search import find_max_rate  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.demo import DEMO_FANOUTS, ensure_demo  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402


def user_model_dir(dataset: Path, builtin: Path) -> Path:
    """The user's GraphSAGE (random weights, non-trivial BatchNorm statistics), saved once
    with save_model and precomputed like the built-in one."""
    import torch
    from torch_geometric.nn.models import GraphSAGE

    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import read_config, save_model

    out = builtin.parent / "user-sage-bn-jk"
    if (out / "golden.pt").is_file():
        return out
    cfg = read_config(builtin)
    torch.manual_seed(0)
    model = GraphSAGE(cfg["in_dim"], cfg["args"]["hidden_dim"], cfg["num_layers"], cfg["out_dim"], norm="batch",
                      jk="last")
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    save_model(model.eval(), out, fanouts=list(DEMO_FANOUTS))
    precompute(GraphStore.open(dataset), model, out, progress=False)
    return out


def golden_cost_ms(model_dir: Path, repeats: int) -> dict:
    from hybridgnn.models.checkpoint import load_model

    with_check, weights_only = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        load_model(model_dir)
        with_check.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_model(model_dir, check=False)
        weights_only.append(time.perf_counter() - t0)
    return {"load_with_golden_check_ms": round(1000 * statistics.median(with_check), 2),
            "load_without_check_ms": round(1000 * statistics.median(weights_only), 2),
            "golden_check_ms": round(1000 * (statistics.median(with_check) - statistics.median(weights_only)), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--nodes-per-request", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--start-rate", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=30, help="load_model calls timed for the golden-check cost")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    raise_open_file_limit()
    dataset, builtin = ensure_demo()
    user = user_model_dir(dataset, builtin)
    report = {"machine": machine(), "slo_ms": args.slo_ms, "nodes_per_request": args.nodes_per_request,
              "golden": {"builtin": golden_cost_ms(builtin, args.repeats), "user": golden_cost_ms(user, args.repeats)}}
    for label, model in (("builtin", builtin), ("user", user)):
        srv = ServerProcess(dataset, model).wait_ready()
        try:
            print(f"{label} ({model.name}):", flush=True)
            _, res = run_async(find_max_rate(srv.url, "hybridgnn", slo_ms=args.slo_ms, duration_s=args.duration_s,
                                             nodes_per_request=args.nodes_per_request, start_rate=args.start_rate))
        finally:
            srv.stop()
        report[label] = res.to_dict() if res else None
    b, u = report["builtin"], report["user"]
    report["user_over_builtin_seeds_per_s"] = round(u["seeds_per_s"] / b["seeds_per_s"], 3) if b and u else None
    print(f"machine: {report['machine']}")
    for label in ("builtin", "user"):
        r = report[label]
        if r:
            print(f"{label:8s} {r['seeds_per_s']:9.0f} seeds/s within p99 {args.slo_ms:g} ms "
                  f"(p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms); golden check "
                  f"{report['golden'][label]['golden_check_ms']} ms at load")
    print(f"user / builtin served seeds/s: {report['user_over_builtin_seeds_per_s']}")
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
