"""PSGS/FAP table build time on the products-scale graph, against estimating PSGS by
sampling every node once (Quiver's open-source method), timed on a subset and scaled.

    .venv/bin/python bench/workload_tables.py [--fanouts 15,10,5] [--subset 20000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PRODUCTS, ensure_products, machine, strict_json  # noqa: E402
from hybridgnn.config import parse_fanouts  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402
from hybridgnn.workload.tables import WorkloadTables  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path, default=PRODUCTS)
    ap.add_argument("--fanouts", default="15,10,5")
    ap.add_argument("--subset", type=int, default=20_000, help="nodes the sampling baseline is timed on")
    args = ap.parse_args()
    gen = ensure_products(args.dataset) if args.dataset == PRODUCTS else {}
    graph = GraphStore.open(args.dataset)
    fanouts = parse_fanouts(args.fanouts)

    tables = WorkloadTables.build(graph, fanouts, "uniform")
    build_s = tables.build_s

    sampler = CPUSampler(graph, fanouts, seed=0)
    rng = np.random.default_rng(0)
    subset = rng.choice(graph.num_nodes, size=min(args.subset, graph.num_nodes), replace=False)
    sampler.sample(subset[:10])  # compile outside the timing
    t0 = time.perf_counter()
    sizes = np.empty(len(subset))
    for i in range(len(subset)):
        sizes[i] = sampler.sample(subset[i:i + 1]).num_edges + 1
    per_node_s = (time.perf_counter() - t0) / len(subset)
    sampling_total_s = per_node_s * graph.num_nodes
    report = {
        "machine": machine(),
        "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges},
        "generate": gen,
        "fanouts": list(fanouts),
        "tables_build_s": round(build_s, 2),
        "sampling_estimate_s_scaled": round(sampling_total_s, 1),
        "speedup_tables_vs_sampling": round(sampling_total_s / build_s, 1),
        "mean_psgs_exact": float(np.asarray(tables.psgs, np.float64).mean()),
        "mean_sampled_size_on_subset": float(sizes.mean()),
    }
    print(strict_json(report))


if __name__ == "__main__":
    main()
