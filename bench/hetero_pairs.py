"""Served pairs/s within a p99 SLO for a heterogeneous link-prediction model (user
-rates-> item, to_hetero(GraphSAGE), dot-product scores): `hybridgnn serve` with the
model's fanouts (typed neighbour sampling, batched) and with fanouts above every degree
(exact: whole neighbourhoods), in mode precomputed (after `hybridgnn precompute`: rows
read, no sampling and no model), against a naive PyG server that runs the model's full
forward over the whole graph for every request (bench/naive_hetero_server.py). Same
graph, model, machine and open-loop Poisson load generator; each request scores
--pairs-per-request random (user, item) pairs.

    .venv/bin/python bench/hetero_pairs.py [--slo-ms 50] [--pairs-per-request 16] [--num-nodes 4000] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch_geometric.nn import GraphSAGE, to_hetero  # noqa: E402

import hybridgnn  # noqa: E402
from bench.common import DATA, emit_report, machine  # noqa: E402
from hybridgnn.bench.search import find_max_rate  # noqa: E402
from hybridgnn.capabilities import raise_open_file_limit, run_async  # noqa: E402
from hybridgnn.graph.hetero import HeteroGraphStore  # noqa: E402
from hybridgnn.graph.hetero_generate import generate_hetero  # noqa: E402
from tests.support.hetero import whole  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

NAIVE_COMMAND = [sys.executable, str(Path(__file__).resolve().parent / "naive_hetero_server.py")]
FANOUTS = [10, 5]


def setup(num_nodes: int, avg_degree: float) -> tuple[Path, Path, HeteroGraphStore]:
    """The generated graph and a model saved for it (random weights: the work per request
    does not depend on training), made once under DATA."""
    root = DATA / f"hetero-recsys-{num_nodes}-{avg_degree:g}"
    if not (root / "graph" / "meta.json").is_file():
        generate_hetero(root / "graph", kind="recsys", num_nodes=num_nodes, avg_degree=avg_degree, seed=0)
    graph = HeteroGraphStore.open(root / "graph")
    if not (root / "model" / "config.json").is_file():
        torch.manual_seed(0)
        model = to_hetero(GraphSAGE((-1, -1), 64, num_layers=2, out_channels=32), graph.metadata(), aggr="sum")
        x, ei = whole(graph)
        with torch.no_grad():
            model(x, ei)
        hybridgnn.save_model(model.eval(), root / "model", metadata=graph.metadata(), fanouts=FANOUTS,
                             link_decoder="dot")
    return root / "graph", root / "model", graph


def pair_bodies(graph: HeteroGraphStore, pairs: int, mode: str = "sampled"):
    n_users, n_items = graph.num_nodes("user"), graph.num_nodes("item")

    def make(rng, count: int) -> list[tuple[bytes, dict]]:
        out = []
        for _ in range(count):
            src, dst = rng.integers(0, n_users, pairs).tolist(), rng.integers(0, n_items, pairs).tolist()
            body = json.dumps({"inputs": [{"name": "src_ids", "datatype": "INT64", "shape": [pairs], "data": src},
                                          {"name": "dst_ids", "datatype": "INT64", "shape": [pairs], "data": dst}],
                               "parameters": {"src_type": "user", "dst_type": "item", "mode": mode}}).encode()
            out.append((body, {"Content-Type": "application/json"}))
        return out

    return make


def measure(label: str, dataset: Path, model: Path, args, make, *extra: str, command=None) -> dict:
    srv = ServerProcess(dataset, model, *extra, command=command).wait_ready(300)
    try:
        print(f"{label}:", flush=True)
        rate, res = run_async(find_max_rate(srv.url, "hybridgnn", slo_ms=args.slo_ms, duration_s=args.duration_s,
                                              nodes_per_request=args.pairs_per_request, start_rate=args.start_rate,
                                              make_bodies=make))
    finally:
        srv.stop()
    return {"requests_per_s": round(rate, 1), "pairs_per_s": round(res.seeds_per_s, 1) if res else 0.0,
            "p50_ms": round(res.p50_ms, 2) if res else None, "p99_ms": round(res.p99_ms, 2) if res else None}


def precomputed(dataset: Path, model: Path, graph: HeteroGraphStore, args) -> dict:
    """Mode precomputed, after precomputing every node's rows (timed) into the model."""
    import time

    from hybridgnn.embeddings.hetero import HeteroEmbeddingStore, hetero_precompute
    from hybridgnn.models.hetero_checkpoint import open_hetero_model

    t0 = time.perf_counter()
    if HeteroEmbeddingStore.open(model, graph.fingerprint) is None:
        hetero_precompute(open_hetero_model(model, graph)[0], graph, model, progress=False)
    took = time.perf_counter() - t0
    res = measure("hybridgnn serve, mode precomputed", dataset, model, args,
                  pair_bodies(graph, args.pairs_per_request, "precomputed"))
    return {**res, "precompute_s": round(took, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--pairs-per-request", type=int, default=16)
    ap.add_argument("--num-nodes", type=int, default=4000,
                    help="users (items: half as many); the naive server must meet the SLO at some rate")
    ap.add_argument("--avg-degree", type=float, default=10.0)
    ap.add_argument("--duration-s", type=float, default=4.0, help="length of each load trial")
    ap.add_argument("--start-rate", type=float, default=5.0)
    ap.add_argument("--servers", default="naive,hybridgnn,hybridgnn_exact,hybridgnn_precomputed",
                    help="which to measure")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the report here (bench/results/hetero_pairs.json is the committed one)")
    args = ap.parse_args()
    known = ("naive", "hybridgnn", "hybridgnn_exact", "hybridgnn_precomputed")
    unknown = sorted(set(args.servers.split(",")) - set(known))
    if unknown:
        ap.error(f"unknown --servers entries {unknown}; take {', '.join(known)}")
    raise_open_file_limit()
    dataset, model, graph = setup(args.num_nodes, args.avg_degree)
    max_degree = max(int(np.diff(d.indptr).max()) for d in graph.edges.values())
    make = pair_bodies(graph, args.pairs_per_request)
    print(f"machine: {machine()}")
    print(f"graph: {graph.num_nodes('user')} users, {graph.num_nodes('item')} items, "
          f"{sum(d.num_edges for d in graph.edges.values())} edges (largest in-degree {max_degree}); "
          f"{args.pairs_per_request} pairs per request, p99 <= {args.slo_ms:g} ms", flush=True)
    servers = {
        "naive": lambda: measure("naive PyG server (full forward per request)", dataset, model, args, make,
                                 command=NAIVE_COMMAND),
        "hybridgnn": lambda: measure(f"hybridgnn serve (fanouts {FANOUTS})", dataset, model, args, make),
        "hybridgnn_exact": lambda: measure(f"hybridgnn serve (fanouts {max_degree + 1}: every neighbour, exact)",
                                           dataset, model, args, make, "--fanouts",
                                           f"{max_degree + 1},{max_degree + 1}"),
    }
    servers["hybridgnn_precomputed"] = lambda: precomputed(dataset, model, graph, args)
    results = {name: servers[name]() for name in args.servers.split(",")}
    naive = results.get("naive", {}).get("pairs_per_s")
    ratios = {k: (round(v["pairs_per_s"] / naive, 1) if naive else None) for k, v in results.items()
              if k != "naive"}
    for k, v in ratios.items():
        print(f"{k}: {results[k]['pairs_per_s']:.0f} pairs/s = {v}x the naive server's {naive or 0:.0f}")
    emit_report({"machine": machine(), "slo_ms": args.slo_ms, "pairs_per_request": args.pairs_per_request,
                 "num_nodes": args.num_nodes, "avg_degree": args.avg_degree, "max_in_degree": max_degree,
                 "fanouts": FANOUTS, "results": results, "ratio_vs_naive": ratios}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
