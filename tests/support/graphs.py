"""Small graphs for tests and benches: a dataset from an edge list, and a skewed random
edge list (a hub, isolated nodes, self-loops)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.store import GraphStore, write_dataset


def make_graph(path: Path, edges: list[tuple[int, int]], num_nodes: int, feature_dim: int = 4, seed: int = 0) -> GraphStore:
    """A dataset from (node, neighbour) pairs: row `node` lists `neighbour` (self-loops kept)."""
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    indptr, indices = coo_to_csr([e[:, 0]], [e[:, 1]], num_nodes, dedup=True, drop_self_loops=False)
    feats = np.random.default_rng(seed).standard_normal((num_nodes, feature_dim), dtype=np.float32)
    write_dataset(path, indptr=indptr, indices=indices, features=feats)
    return GraphStore.open(path, validate="full")


def skewed_edges(num_nodes: int = 60, seed: int = 0) -> list[tuple[int, int]]:
    """Random graph with a hub, a few isolated nodes (the last three) and self-loops."""
    rng = np.random.default_rng(seed)
    active = num_nodes - 3
    edges = []
    for i in range(active):
        deg = int(min(active - 1, rng.zipf(1.8) + 1))
        for j in rng.choice(active, size=deg, replace=False):
            edges.append((i, int(j)))
    edges += [(0, j) for j in range(1, 35)]  # hub row
    edges += [(i, i) for i in range(0, active, 7)]  # self-loops
    return edges


def dynamic_setup(path: Path):
    """A 60-node skewed graph with 4 features under `path`, its DynamicGraph and fresh
    IncrementalEmbeddings of a 2-layer SAGE (seeded: the same every call)."""
    import torch

    from hybridgnn.embeddings.incremental import IncrementalEmbeddings
    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.graph.dynamic import DynamicGraph
    from hybridgnn.models.gnn import GNN, ModelSpec

    graph = make_graph(path / "g", skewed_edges(), 60, feature_dim=4)
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", 4, 8, 3, num_layers=2)).eval()
    store = precompute(graph, model, path / "m", progress=False)
    dyn = DynamicGraph(graph)
    return dyn, IncrementalEmbeddings(dyn, model, store.layers)


def update_body(*inputs: tuple[str, object, str]) -> bytes:
    """A JSON graph-update body from (name, array, datatype) triples."""
    import json

    def tensor(name, arr, dt):
        arr = np.asarray(arr)
        return {"name": name, "datatype": dt, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}

    return json.dumps({"inputs": [tensor(*i) for i in inputs]}).encode()


def four_in_edges_graph_and_sage(path: Path, num_nodes: int = 20000, hidden: int = 128):
    """(graph, model): num_nodes nodes of 4 random in-edges and 4-dim features, and a
    3-layer SAGE of width `hidden` in eval mode; a store of it is tens of MB, so what a
    reader holds beside it is measurable."""
    import torch

    from hybridgnn.models.gnn import GNN, ModelSpec

    rng = np.random.default_rng(0)
    n = num_nodes
    write_dataset(path, indptr=np.arange(0, 4 * n + 1, 4), indices=rng.integers(0, n, 4 * n).astype(np.int32),
                  features=rng.standard_normal((n, 4)).astype(np.float32))
    torch.manual_seed(0)
    return GraphStore.open(path), GNN(ModelSpec("sage", 4, hidden, 3, num_layers=3)).eval()

