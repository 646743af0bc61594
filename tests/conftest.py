"""Shared fixtures: small graphs, a tiny trained model, and helpers for server tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridgnn.graph.generate import generate_csbm
from hybridgnn.graph.store import GraphStore
from tests.support.graphs import make_graph, skewed_edges


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
