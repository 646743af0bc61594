"""`hybridgnn place`: a feature placement plan for a topology, printed per tier and saved."""

from __future__ import annotations

import hashlib
import json

from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path, user_path_or_word
from hybridgnn.cli.outputs import check_out, staged_directory


def add_parser(sub) -> None:
    p = sub.add_parser("place", help="plan which tier, server and GPU holds each feature row (FAP order)",
                       description="Computes FAP for the fanouts and seed distribution (uniform, degree, or a "
                                   "request log with --from-log), places rows over the topology (Quiver's "
                                   "algorithm, or a baseline with --method), prints a table per tier and saves the "
                                   "plan beside the dataset. --simulate estimates each batch's gather time (the "
                                   "slowest tier it touches) under this plan and the baselines.",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=user_path, required=True, help="dataset directory")
    p.add_argument("--fanouts", default="15,10,5", help="neighbours sampled per hop, hop 1 first (the FAP table's)")
    p.add_argument("--topology", type=user_path, default=None,
                   help="JSON or YAML topology file (default: detect this machine)")
    p.add_argument("--seeds", type=user_path_or_word, default="uniform", help="seed distribution: uniform, degree, or a request-log file")
    p.add_argument("--from-log", type=user_path, default=None,
                   help="request log: node ids (.npy or text) or per-node counts (.counts.npy, what serve --seed-log "
                        "writes); same as --seeds LOG")
    p.add_argument("--method", choices=["fap", "hash", "degree", "importance"], default="fap",
                   help="how rows are placed")
    p.add_argument("--out", type=user_path, default=None, help="plan directory (default <dataset>/placement/<name>)")
    p.add_argument("--simulate", type=int, default=0, metavar="BATCHES",
                   help="also simulate this many sampled batches under every method")
    p.add_argument("--batch-size", type=int, default=64, help="seeds per simulated batch")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.simulate < 0 or args.batch_size < 1:  # before any work (the plan is saved before simulating)
        raise ValueError(f"--simulate must be >= 0 and --batch-size >= 1, got {args.simulate} and {args.batch_size}")
    import numpy as np

    from hybridgnn.config import parse_fanouts
    from hybridgnn.features.placement import (
        holds_only_a_plan,
        make_plan,
        two_hop_importance,
    )
    from hybridgnn.features.topology import Topology, detect
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.workload.tables import WorkloadTables, seed_distribution

    graph = GraphStore.open(args.dataset)
    fanouts = parse_fanouts(args.fanouts)
    # A plan replaces a plan, never other files. The default's name needs FAP's seed key:
    # its folder is checked now, the plan's own directory once it has a name.
    if args.out is not None:
        check_out(args.out, directory=True, staged=True, replaceable=holds_only_a_plan, what="a placement plan")
    else:
        check_out(graph.root / "placement", directory=True)
    seeds = str(args.from_log) if args.from_log is not None else args.seeds
    topo = Topology.load(args.topology) if args.topology else detect()
    tables = WorkloadTables.load_or_build(graph, fanouts, seeds)
    row_bytes = graph.feature_dim * np.asarray(graph.features).itemsize
    inputs = {"fap": tables.fap, "degrees": graph.degrees(), "num_nodes": graph.num_nodes}
    if args.method == "importance" or args.simulate:
        inputs["importance"] = two_hop_importance(np.asarray(graph.indptr), np.asarray(graph.indices))
    plan = make_plan(args.method, topology=topo, row_bytes=row_bytes, **inputs)
    # fanouts in the name: FAP depends on them, and a plan for other fanouts replaced this one
    topo_key = hashlib.sha256(json.dumps(topo.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    name = f"{args.method}-{'_'.join(map(str, fanouts))}-{tables.seed_key}-{topo_key}"
    out = args.out or graph.root / "placement" / name
    check_out(out, directory=True, staged=True, replaceable=holds_only_a_plan, what="a placement plan")
    with staged_directory(out, "placing") as staging:  # an interrupted run leaves the old plan whole
        plan.made_for = {"dataset_fingerprint": graph.fingerprint, "fanouts": list(fanouts), "seeds": tables.seed_key}
        plan.save(staging)
    print(f"{args.method} placement of {graph.num_nodes:,} rows ({row_bytes} B each) on {topo.describe()}, "
          f"seeds {tables.seed_key}, fanouts {','.join(map(str, fanouts))}")
    print(f"{'tier':<6}{'nodes':>14}{'FAP share':>12}{'bytes':>14}{'all copies':>14}")
    for row in plan.summary(tables.fap):
        print(f"{row['tier']:<6}{row['nodes']:>14,}{row['fap_share']:>12.1%}{_gib(row['bytes']):>14}"
              f"{_gib(row['bytes_all_copies']):>14}")
    report = {"plan": str(out), "tiers": plan.summary(tables.fap)}
    if args.simulate:
        from hybridgnn.features.simulate import sample_batches, simulate

        p0, _ = seed_distribution(graph, seeds)
        batches = sample_batches(graph, fanouts, p0, batch_size=args.batch_size, count=args.simulate)
        report["simulated"] = {}
        print(f"\nsimulated gather time over {args.simulate} batches of {args.batch_size} seeds:")
        for method in ("fap", "hash", "degree", "importance"):
            try:
                other = plan if method == args.method else make_plan(method, topology=topo, row_bytes=row_bytes,
                                                                     **inputs)
            except ValueError as exc:  # a baseline that needs more disk than the plan made: was this run's error
                report["simulated"][method] = {"error": str(exc)}
                print(f"  {method:<11} does not fit this topology: {exc}")
                continue
            res = simulate(other, batches)
            report["simulated"][method] = res.to_dict()
            print(f"  {method:<11} p50 {res.quantile_ms(0.5):8.3f} ms   p99 {res.quantile_ms(0.99):8.3f} ms")
    print(f"\nsaved {out}")
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
