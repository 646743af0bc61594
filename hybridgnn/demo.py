"""The embedded default: a generated CSBM demo graph, a GraphSAGE model trained on it and
its precomputed embeddings, built once into the cache directory and reused afterwards."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from hybridgnn.capabilities import exclusive
from hybridgnn.config import default_cache_dir
from hybridgnn.embeddings.precompute import precompute
from hybridgnn.embeddings.store import EmbeddingStore
from hybridgnn.graph.generate import generate_csbm
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import load_checkpoint, save_checkpoint
from hybridgnn.models.train import TrainConfig, train
from hybridgnn.workload.tables import WorkloadTables

log = logging.getLogger(__name__)

DEMO_FANOUTS = (10, 5)
DEMO_GRAPH = dict(num_nodes=50_000, num_classes=8, feature_dim=64, avg_degree=12.0, seed=7)
DEMO_TRAIN = TrainConfig(kind="sage", hidden_dim=64, num_layers=2, fanouts=DEMO_FANOUTS, epochs=3)


def ensure_demo(cache_dir: Path | None = None) -> tuple[Path, Path]:
    """Return (dataset_dir, model_dir), generating and training on first use. Each artifact
    is written under a temporary name and renamed, so an interrupted run leaves no half state."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    # two first runs at once (two servers started together) would remove each other's
    # temporaries: one builds, the other waits and finds it built
    with exclusive(root / "demo" / ".lock", f"waiting for another process building the demo in {root / 'demo'}"):
        return _ensure_demo(root / "demo" / "dataset", root / "demo" / "model")


def _ensure_demo(data_dir: Path, model_dir: Path) -> tuple[Path, Path]:
    if not (data_dir / "meta.json").is_file():
        log.info("first run: generating the demo graph in %s", data_dir)
        tmp = data_dir.with_name("dataset.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        generate_csbm(tmp, name="demo-csbm", **DEMO_GRAPH)
        shutil.rmtree(data_dir, ignore_errors=True)
        tmp.rename(data_dir)
    graph = GraphStore.open(data_dir)
    if not (model_dir / "golden.pt").is_file():  # absent too in model directories of older versions
        log.info("first run: training the demo GraphSAGE model into %s", model_dir)
        model, metrics = train(graph, DEMO_TRAIN)
        tmp = model_dir.with_name("model.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(model, tmp, extra={"dataset_fingerprint": graph.fingerprint,
                                           "fanouts": list(DEMO_FANOUTS), "metrics": metrics})
        shutil.rmtree(model_dir, ignore_errors=True)
        tmp.rename(model_dir)
        log.info("demo model: val accuracy %.3f, test accuracy %.3f", metrics["val_acc"], metrics["test_acc"])
    WorkloadTables.load_or_build(graph, DEMO_FANOUTS)
    if EmbeddingStore.for_graph(model_dir, graph) is None:
        log.info("first run: precomputing the demo model's embeddings of every node")
        precompute(graph, load_checkpoint(model_dir)[0], model_dir)
    return data_dir, model_dir
