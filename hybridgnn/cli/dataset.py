"""`hybridgnn dataset generate|import|info`."""

from __future__ import annotations

import json
import time

from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path
from hybridgnn.cli.outputs import check_out, staged_directory

FORCE_HELP = "replace --out when it already holds something (once the new dataset is whole)"


def add_parser(sub) -> None:
    p = sub.add_parser("dataset", help="generate, import or describe datasets")
    dsub = p.add_subparsers(dest="dataset_command", metavar="ACTION", required=True)
    fmt = DefaultsHelpFormatter

    gen = dsub.add_parser("generate", help="generate a synthetic dataset")
    gsub = gen.add_subparsers(dest="kind", metavar="KIND", required=True)
    pl = gsub.add_parser("powerlaw", help="skewed-degree Chung-Lu graph (ogbn-products scale: "
                                          "--num-nodes 2400000 --avg-degree 51.5 --feature-dim 100)",
                         formatter_class=fmt)
    pl.add_argument("--out", type=user_path, required=True, help="dataset directory to write")
    pl.add_argument("--num-nodes", type=int, default=100_000, help="nodes")
    pl.add_argument("--avg-degree", type=float, default=20.0, help="directed edges per node (after dedup)")
    pl.add_argument("--exponent", type=float, default=2.1, help="degree power-law exponent")
    pl.add_argument("--max-degree", type=int, default=None, help="cap on a node's degree (none: the power law's own)")
    pl.add_argument("--feature-dim", type=int, default=100, help="random features per node")
    pl.add_argument("--seed", type=int, default=0, help="random seed")
    pl.add_argument("--force", action="store_true", help=FORCE_HELP)
    pl.set_defaults(run=run_generate)

    cs = gsub.add_parser("csbm", help="labelled contextual stochastic block model", formatter_class=fmt)
    cs.add_argument("--out", type=user_path, required=True, help="dataset directory to write")
    cs.add_argument("--num-nodes", type=int, default=20_000, help="nodes")
    cs.add_argument("--num-classes", type=int, default=8, help="classes (communities)")
    cs.add_argument("--feature-dim", type=int, default=64, help="features per node")
    cs.add_argument("--avg-degree", type=float, default=12.0, help="mean in-degree")
    cs.add_argument("--homophily", type=float, default=0.7, help="share of edges inside a class")
    cs.add_argument("--feature-signal", type=float, default=0.12, help="std of the class means per dimension")
    cs.add_argument("--seed", type=int, default=0, help="random seed")
    cs.add_argument("--force", action="store_true", help=FORCE_HELP)
    cs.set_defaults(run=run_generate)

    het = gsub.add_parser("hetero", help="heterogeneous graph: recsys (user, item) or academic (paper, author, "
                                         "field), with reverse edge types", formatter_class=fmt)
    het.add_argument("--out", type=user_path, required=True, help="dataset directory to write")
    het.add_argument("--schema", choices=["recsys", "academic"], default="recsys",
                     help="recsys: user -rates-> item; academic: author -writes-> paper -has_topic-> field, cites")
    het.add_argument("--num-nodes", type=int, default=20_000, help="nodes of the largest type")
    het.add_argument("--avg-degree", type=float, default=10.0, help="mean in-degree per edge type")
    het.add_argument("--num-groups", type=int, default=5, help="communities (item classes, paper fields)")
    het.add_argument("--seed", type=int, default=0, help="random seed")
    het.add_argument("--force", action="store_true", help=FORCE_HELP)
    het.set_defaults(run=run_generate)

    imp = dsub.add_parser("import", help="import a PyG Data or HeteroData file (.pt), an .npz, a text edge list, "
                                         "or a directory of edge lists per edge type",
                          formatter_class=fmt)
    imp.add_argument("source", type=user_path,
                     help="a PyG Data/HeteroData file (.pt), an edge list (.txt/.csv/.tsv), an .npz, or a directory "
                          "of edge lists per type")
    imp.add_argument("--out", type=user_path, required=True, help="dataset directory to write")
    imp.add_argument("--undirected", action="store_true",
                     help="add every edge in both directions (heterogeneous: a rev_<rel> type per edge type)")
    imp.add_argument("--feature-dim", type=int, default=64, help="random features when the source has none")
    imp.add_argument("--ids", choices=["auto", "dense", "map"], default="auto",
                     help="map node ids to dense ones and store the map (requests then use the original ids): "
                          "auto maps names, negative and sparse integer ids of an edge list")
    imp.add_argument("--force", action="store_true", help=FORCE_HELP)
    imp.set_defaults(run=run_import)

    info = dsub.add_parser("info", help="print a dataset's summary as JSON")
    info.add_argument("path", type=user_path, help="dataset directory")
    info.add_argument("--full", action="store_true",
                      help="validate every index (every open now does: kept for scripts that pass it)")
    info.set_defaults(run=run_info)


def run_generate(args) -> int:
    from hybridgnn.graph.generate import generate_csbm, generate_powerlaw
    from hybridgnn.graph.hetero import open_any
    from hybridgnn.graph.hetero_generate import generate_hetero

    check_out(args.out, directory=True, staged=True, force=args.force)  # before the graph is drawn, not after
    t0 = time.perf_counter()
    out = args.out.resolve()
    name = out.name
    with staged_directory(out, "generating") as staging:  # an interrupted run replaces nothing
        if args.kind == "hetero":
            generate_hetero(staging, kind=args.schema, num_nodes=args.num_nodes, avg_degree=args.avg_degree,
                            num_groups=args.num_groups, seed=args.seed, name=name)
        elif args.kind == "powerlaw":
            generate_powerlaw(staging, num_nodes=args.num_nodes, avg_degree=args.avg_degree, exponent=args.exponent,
                              max_degree=args.max_degree, feature_dim=args.feature_dim, seed=args.seed, name=name)
        else:
            generate_csbm(staging, num_nodes=args.num_nodes, num_classes=args.num_classes,
                          feature_dim=args.feature_dim, avg_degree=args.avg_degree, homophily=args.homophily,
                          feature_signal=args.feature_signal, seed=args.seed, name=name)
    info = open_any(args.out).describe()
    info["generate_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(info, indent=2))
    return 0


def run_import(args) -> int:
    """The dataset is made in a hidden sibling of --out and moved there whole: a failed or
    interrupted import leaves --out as it was, and --force removes the old one only then."""
    from hybridgnn.errors import ConfigError
    from hybridgnn.graph.hetero import open_any
    from hybridgnn.graph.importers import import_graph

    out, source = args.out.resolve(), args.source.resolve()
    if out == source or out in source.parents or source in out.parents:
        # --force removed --out before reading the source: the user's own edge list went with it
        raise ConfigError(f"--out {args.out} and the source {args.source} overlap: write the dataset elsewhere")
    check_out(args.out, directory=True, staged=True, force=args.force)
    with staged_directory(out, "importing") as staging:
        import_graph(args.source, staging, undirected=args.undirected, feature_dim=args.feature_dim, ids=args.ids,
                     name=out.name)
        open_any(staging, validate="full")  # a dataset that does not open replaces nothing
    print(json.dumps(open_any(args.out).describe(), indent=2))
    return 0


def run_info(args) -> int:
    from hybridgnn.graph.hetero import open_any

    description = open_any(args.path, validate="full" if args.full else "quick").describe()
    description["validated"] = "sizes, meta.json and every index"  # with --full or without: the same checks
    print(json.dumps(description, indent=2))
    return 0
