"""Incremental embedding maintenance: update throughput and per-batch latency against
recomputing the affected region and against a full re-precompute, same graph, model and
update stream, same run.

Graphs: an ogbn-arxiv-scale power-law graph (169k nodes, ~2.3M edges, 128-dim features:
sparse) and the ogbn-products-scale one (2.4M nodes, 123M edges, 100-dim: dense).
Models: two layers, hidden 64, one per aggregation (SAGE mean, SAGE sum, GIN sum, GCN
weighted sum, SAGE max, GAT attention), random weights (timing does not depend on them).
Updates: a stream of 45% edge insertions, 45% edge deletions, 10% feature updates, in
batches of 10, 100 and 1,000.

    .venv/bin/python bench/incremental.py [--graphs arxiv,products] [--aggs mean,sum,...] [--batches 1000:3,100:8,10:20]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    DATA,
    PRODUCTS,
    emit_report,
    ensure_graph,
    ensure_products,
    machine,
)
from hybridgnn.embeddings.incremental import (  # noqa: E402
    IncrementalConfig,
    IncrementalEmbeddings,
    layer_kind,
)
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute  # noqa: E402
from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.decompose import decompose  # noqa: E402

ARXIV = DATA / "arxiv-powerlaw"
ARXIV_ARGS = ["--num-nodes", "169343", "--avg-degree", "13.7", "--feature-dim", "128", "--seed", "0"]
AGGS = ("mean", "sum", "gin", "gcn", "max", "gat")


def build_model(agg: str, in_dim: int, hidden: int = 64, out: int = 32):
    from torch_geometric.nn.models import GAT, GCN, GIN, GraphSAGE

    torch.manual_seed(0)
    if agg in ("mean", "sum", "max"):
        return GraphSAGE(in_dim, hidden, 2, out_channels=out, aggr=agg).eval()
    if agg == "gin":
        return GIN(in_dim, hidden, 2, out_channels=out).eval()
    if agg == "gcn":
        return GCN(in_dim, hidden, 2, out_channels=out).eval()
    return GAT(in_dim, hidden, 2, out_channels=out, heads=2).eval()


def update_stream(dyn: DynamicGraph, size: int, rng: np.random.Generator) -> UpdateBatch:
    """A valid batch against the graph as it is: insertions of absent edges, deletions of
    present ones, feature rewrites; no edge twice."""
    n = dyn.num_nodes
    n_add, n_rm = int(size * 0.45), int(size * 0.45)
    n_feat = size - n_add - n_rm
    base = dyn.base
    indptr = np.asarray(base.indptr)
    pos = rng.integers(0, base.num_edges, size=2 * n_rm + 8)
    dst = np.searchsorted(indptr, pos, side="right") - 1
    src = np.asarray(base.indices)[pos].astype(np.int64)
    keep = dyn.has_edges(src, dst)  # some base edges were deleted by earlier batches
    rm = np.unique(np.stack([src[keep], dst[keep]], 1), axis=0)
    rm = rm[rng.permutation(len(rm))[:n_rm]]
    cand = rng.integers(0, n, size=(2 * n_add + 8, 2))
    cand = cand[~dyn.has_edges(cand[:, 0], cand[:, 1])]
    add = np.unique(cand, axis=0)
    add = add[rng.permutation(len(add))[:n_add]]
    ids = rng.choice(n, size=n_feat, replace=False)
    feats = rng.normal(size=(n_feat, dyn.feature_dim)).astype(np.float32)
    return UpdateBatch(add_edges=add, remove_edges=rm, update_ids=ids, update_features=feats if n_feat else None)


def run_stream(graph: GraphStore, model, layers, mode: str, plan: list[tuple[int, int]], seed: int) -> dict:
    t0 = time.perf_counter()
    dyn = DynamicGraph(graph)
    inc = IncrementalEmbeddings(dyn, model, layers, IncrementalConfig(mode=mode))
    setup_s = time.perf_counter() - t0
    out = {"setup_s": setup_s}
    rng = np.random.default_rng(seed)
    for size, batches in plan:
        lat, affected = [], []
        for _ in range(batches):
            batch = update_stream(dyn, size, rng)
            t = time.perf_counter()
            rep = inc.apply(batch)
            lat.append(time.perf_counter() - t)
            affected.append(rep.affected_nodes)
        out[size] = {"updates_per_s": size * batches / sum(lat), "p50_ms": 1e3 * float(np.median(lat)),
                     "max_ms": 1e3 * max(lat), "affected_mean": float(np.mean(affected))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="arxiv,products")
    ap.add_argument("--aggs", default=",".join(AGGS))
    ap.add_argument("--batches", default="1000:3,100:8,10:20", help="size:count pairs")
    ap.add_argument("--no-recompute", action="store_true", help="skip the recompute-the-region baseline")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    plan = [tuple(int(v) for v in p.split(":")) for p in args.batches.split(",")]
    unknown = sorted(set(args.graphs.split(",")) - {"arxiv", "products"})
    if unknown:  # any other name ran the arxiv graph under that name
        ap.error(f"unknown --graphs entries {unknown}; take arxiv, products")
    print(machine())
    results = []
    for gname in args.graphs.split(","):
        if gname == "products":
            ensure_products()
            path = PRODUCTS
        else:
            ensure_graph(ARXIV, ARXIV_ARGS)
            path = ARXIV
        graph = GraphStore.open(path)
        print(f"\n## {gname}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, {graph.feature_dim} features")
        header = (f"{'agg':5} {'batch':>5} | {'incremental upd/s':>17} {'p50 ms':>8} | {'recompute upd/s':>15} "
                  f"{'p50 ms':>8} {'x':>6} | {'full re-precompute s':>20} {'x':>8}")
        print(header)
        for agg in args.aggs.split(","):
            model = build_model(agg, graph.feature_dim)
            tmp = Path(tempfile.mkdtemp(prefix="hgnn-inc-"))
            try:
                t = time.perf_counter()
                store = precompute(graph, model, tmp, PrecomputeConfig(), progress=False)
                full_s = time.perf_counter() - t
                layers = [np.asarray(a) for a in store.layers]
                inc = run_stream(graph, model, layers, "auto", plan, seed=1)
                # Max and attention layers recompute in "auto" too: the baseline would rerun the same path.
                same_path = all(layer_kind(c) == "recompute" for c in decompose(model).convs)
                rec = (None if args.no_recompute or same_path
                       else run_stream(graph, model, layers, "recompute", plan, seed=1))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            for size, _ in plan:
                a = inc[size]
                r = rec[size] if rec else None
                # Full re-precompute per batch: every batch would need one whole pass.
                vs_full = full_s / (a["p50_ms"] / 1e3)
                rtxt = (f"{r['updates_per_s']:>15,.0f} {r['p50_ms']:>8.1f} {a['updates_per_s'] / r['updates_per_s']:>5.1f}x"
                        if r else f"{'(same path)':>15} {'-':>8} {'-':>6}")
                print(f"{agg:5} {size:>5} | {a['updates_per_s']:>17,.0f} {a['p50_ms']:>8.1f} | {rtxt} | "
                      f"{full_s:>20.1f} {vs_full:>7,.0f}x", flush=True)
                results.append({"graph": gname, "agg": agg, "batch": size, "incremental": a, "recompute": r,
                                "full_precompute_s": full_s, "setup_s": inc["setup_s"]})
    emit_report(results, args.json)


if __name__ == "__main__":
    main()
