"""Shared fixtures: small graphs, a tiny trained model, and helpers for server tests."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.generate import generate_csbm
from hybridgnn.graph.store import GraphStore, write_dataset


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def skewed_graph(tmp_path) -> GraphStore:
    return make_graph(tmp_path / "skewed", skewed_edges(), 60)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "csbm"
    generate_csbm(path, num_nodes=3000, num_classes=4, feature_dim=16, avg_degree=8, feature_signal=0.3, seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_dataset, tmp_path_factory) -> Path:
    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.train import TrainConfig, train

    graph = GraphStore.open(tiny_dataset)
    model, metrics = train(graph, TrainConfig(kind="sage", hidden_dim=16, fanouts=(5, 3), epochs=3, batch_size=64), progress=False)
    out = tmp_path_factory.mktemp("model") / "sage"
    save_checkpoint(model, out, extra={"dataset_fingerprint": graph.fingerprint, "fanouts": [5, 3],
                                       "metrics": metrics})
    return out


@pytest.fixture(scope="session")
def tiny_model_pe(tiny_dataset, tiny_model, tmp_path_factory) -> Path:
    """The tiny model, copied, with precomputed embeddings."""
    import shutil

    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.models.checkpoint import load_checkpoint

    out = tmp_path_factory.mktemp("model_pe") / "sage"
    shutil.copytree(tiny_model, out)
    precompute(GraphStore.open(tiny_dataset), load_checkpoint(out)[0], out, progress=False)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
