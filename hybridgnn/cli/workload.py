"""`hybridgnn workload build`: PSGS and FAP tables beside a dataset."""

from __future__ import annotations

import json
from pathlib import Path

from hybridgnn.cli.flags import user_path, user_path_or_word
from hybridgnn.cli.outputs import check_out


def add_parser(sub) -> None:
    p = sub.add_parser("workload", help="build PSGS/FAP workload tables")
    wsub = p.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    b = wsub.add_parser("build", help="compute PSGS and FAP by sparse matrix-vector chains and save them")
    b.add_argument("--dataset", type=user_path, required=True, help="dataset directory")
    b.add_argument("--fanouts", required=True,
                   help="comma-separated, hop 1 first, e.g. 15,10,5; for a heterogeneous dataset also a JSON "
                        "object per edge type, e.g. '{\"user__rates__item\": [10, 5], \"rev_rates\": [5, 5]}'")
    b.add_argument("--seeds", type=user_path_or_word, default="uniform",
                   help="seed distribution: uniform (default), degree, or a request log: a .npy or text of node "
                        "ids, or a .counts.npy of per-node counts as serve --seed-log writes; for a heterogeneous "
                        "dataset the .counts.npz of counts per node type that its serve --seed-log writes")
    b.set_defaults(run=run_build)


def run_build(args) -> int:
    import numpy as np

    from hybridgnn.config import parse_fanouts
    from hybridgnn.graph.store import GraphStore, dataset_kind
    from hybridgnn.workload.tables import WorkloadTables

    kind = dataset_kind(args.dataset)
    check_out(Path(args.dataset) / "workload", directory=True)  # before the tables are computed
    if kind == "hetero":
        return _build_typed(args)
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


def parse_typed_fanouts(text: str):
    """'15,10' (every edge type) or a JSON object {edge type: [per hop]}."""
    from hybridgnn.errors import ConfigError

    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ConfigError(f"--fanouts is not a valid JSON object: {exc}") from exc
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        raise ConfigError(f"--fanouts must be comma-separated integers or a JSON object, got {text!r}") from exc


def _build_typed(args) -> int:
    import numpy as np

    from hybridgnn.errors import ConfigError
    from hybridgnn.graph.hetero import HeteroGraphStore
    from hybridgnn.workload.typed import TypedWorkloadTables

    graph = HeteroGraphStore.open(args.dataset)
    try:
        tables = TypedWorkloadTables.build(graph, parse_typed_fanouts(args.fanouts), args.seeds)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    out = tables.save(graph)
    print(json.dumps({
        "tables": str(out), "seeds": tables.seed_key, "build_s": round(tables.build_s, 3),
        "psgs_mean": {t: float(np.asarray(v).mean()) for t, v in tables.psgs.items()},
        "psgs_max": {t: float(np.asarray(v).max(initial=0)) for t, v in tables.psgs.items()},
    }, indent=2))
    return 0
