"""`hybridgnn workload build`: PSGS and FAP tables beside a dataset."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("workload", help="build PSGS/FAP workload tables")
    wsub = p.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    b = wsub.add_parser("build", help="compute PSGS and FAP by sparse matrix-vector chains and save them")
    b.add_argument("--dataset", type=Path, required=True)
    b.add_argument("--fanouts", required=True, help="comma-separated, hop 1 first, e.g. 15,10,5")
    b.add_argument("--seeds", default="uniform",
                   help="seed distribution: uniform, degree, or a request log (.npy or text of node ids)")
    b.set_defaults(run=run_build)


def run_build(args) -> int:
    import numpy as np

    from hybridgnn.config import parse_fanouts
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.workload.tables import WorkloadTables

    graph = GraphStore.open(args.dataset)
    tables = WorkloadTables.build(graph, parse_fanouts(args.fanouts), args.seeds)
    psgs_path, fap_path = tables.save(graph.root)
    psgs = np.asarray(tables.psgs)
    print(json.dumps({
        "psgs": str(psgs_path), "fap": str(fap_path), "build_s": round(tables.build_s, 3),
        "psgs_mean": float(psgs.mean()), "psgs_p99": float(np.quantile(psgs, 0.99)), "psgs_max": float(psgs.max()),
        "fap_top1pct_mass": float(np.sort(np.asarray(tables.fap))[::-1][: max(1, graph.num_nodes // 100)].sum()
                                  / max(float(np.asarray(tables.fap).sum()), 1e-30)),
    }, indent=2))
    return 0
