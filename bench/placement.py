"""Placement simulator (issue 5): expected p50/p99 gather time per batch of the FAP plan
against hash partitioning (DGL), degree-ranked caching (PaGraph/BGL) and an
importance-based partition (AliGraph-like), for 1, 2, 4 and 8 GPUs (with and without
NVLink) on one server and for 2 and 8 servers (InfiniBand or Ethernet), on the
products-scale power-law graph with degree-weighted seeds.

Capacities (per Quiver §6.5, which gives every system 20 % spare memory): each GPU holds
--gpu-share of the rows; the servers' host memory together holds all rows plus 20 %;
disk is unbounded. Link figures are hybridgnn.features.topology.DEFAULT_LINKS.

    .venv/bin/python bench/placement.py [--batches 200] [--batch-size 64] [--gpu-share 0.05]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PRODUCTS, ensure_products, machine, strict_json  # noqa: E402
from hybridgnn.features.placement import make_plan, two_hop_importance  # noqa: E402
from hybridgnn.features.simulate import sample_batches, simulate  # noqa: E402
from hybridgnn.features.topology import Topology  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.workload.tables import WorkloadTables, seed_distribution  # noqa: E402

METHODS = ("fap", "hash", "degree", "importance")


def topologies(n: int, row_bytes: int, gpu_share: float):
    gpu = int(gpu_share * n * row_bytes)
    for g in (1, 2, 4, 8):
        for nvlink in ((False, True) if g > 1 else (False,)):
            yield (f"1 server, {g} GPU{'s' if g > 1 else ''}, {'NVLink' if nvlink else 'PCIe only'}",
                   Topology(gpus_per_server=g, nvlink_cliques=1 if nvlink else g, gpu_memory_bytes=gpu,
                            host_memory_bytes=int(1.2 * n * row_bytes)))
    for s in (2, 8):
        for net in ("infiniband", "ethernet"):
            yield (f"{s} servers × 4 GPUs (NVLink pairs), {net}",
                   Topology(servers=s, gpus_per_server=4, nvlink_cliques=2, gpu_memory_bytes=gpu,
                            host_memory_bytes=int(1.2 * n * row_bytes / s), network=net))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path, default=PRODUCTS)
    ap.add_argument("--fanouts", default="15,10,5")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--gpu-share", type=float, default=0.05)
    args = ap.parse_args()
    if args.dataset == PRODUCTS:
        ensure_products(args.dataset)
    graph = GraphStore.open(args.dataset)
    fanouts = tuple(int(f) for f in args.fanouts.split(","))
    tables = WorkloadTables.load_or_build(graph, fanouts, "degree")
    p0, _ = seed_distribution(graph, "degree")
    inputs = {"fap": tables.fap, "degrees": graph.degrees(), "num_nodes": graph.num_nodes,
              "importance": two_hop_importance(np.asarray(graph.indptr), np.asarray(graph.indices))}
    row_bytes = graph.feature_dim * np.asarray(graph.features).itemsize
    batches = sample_batches(graph, fanouts, p0, batch_size=args.batch_size, count=args.batches)
    report = {"machine": machine(), "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges},
              "rows_per_batch": float(np.mean([b.size for b in batches])), "gpu_share": args.gpu_share,
              "cases": []}
    for name, topo in topologies(graph.num_nodes, row_bytes, args.gpu_share):
        results = {m: simulate(make_plan(m, topology=topo, row_bytes=row_bytes, **inputs), batches) for m in METHODS}
        p99 = {m: r.quantile_ms(0.99) for m, r in results.items()}
        best_other = min(v for m, v in p99.items() if m != "fap")
        case = {"topology": name, "p99_ms": {m: round(v, 3) for m, v in p99.items()},
                "fap_vs_best_baseline": round(best_other / p99["fap"], 2), "fap_lowest": p99["fap"] <= best_other,
                "fap_paths": results["fap"].to_dict()["path_share"]}
        report["cases"].append(case)
        print(f"{name:<45} " + "  ".join(f"{m} {v:7.3f}" for m, v in p99.items())
              + f"   best baseline / fap = {case['fap_vs_best_baseline']}", flush=True)
    # Device-cache hit ratio at equal cache sizes, FAP order against degree order (the
    # counting half of the GPU figure; the gather times need a GPU).
    report["cache_hit_ratio"] = []
    all_rows = np.concatenate(batches)
    for share in (0.05, 0.10, 0.20):
        k = int(share * graph.num_nodes)
        row = {"cache_share": share}
        for name, score in (("fap", tables.fap), ("degree", graph.degrees())):
            cached = np.zeros(graph.num_nodes, dtype=bool)
            cached[np.argsort(-np.asarray(score, dtype=np.float64), kind="stable")[:k]] = True
            row[f"{name}_hit_ratio"] = round(float(cached[all_rows].mean()), 4)
        report["cache_hit_ratio"].append(row)
        print(f"cache {share:.0%} of rows: hit ratio FAP order {row['fap_hit_ratio']:.3f}, "
              f"degree order {row['degree_hit_ratio']:.3f}", flush=True)
    print(strict_json(report))


if __name__ == "__main__":
    main()
