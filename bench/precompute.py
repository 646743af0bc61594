"""Layer-wise precompute of every node's embeddings against node-wise full-neighbourhood
inference (each node's whole K-hop neighbourhood expanded and run on its own), timed on
a random subset and scaled to all nodes, same model and graph, same run.

    .venv/bin/python bench/precompute.py [--subset 300]          # demo graph and model
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

from bench.common import machine, strict_json  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute  # noqa: E402
from hybridgnn.features.store import HostFeatureStore  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.checkpoint import load_checkpoint  # noqa: E402
from hybridgnn.pipelines.executor import BatchExecutor  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402

EVERY_NEIGHBOUR = 1 << 30  # a fanout no degree reaches: the sampler keeps whole neighbourhoods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--subset", type=int, default=300)
    args = ap.parse_args()
    if args.dataset is None:
        args.dataset, args.model = ensure_demo()
    torch.set_num_threads(1)  # both sides on one core: a like-for-like ratio
    graph = GraphStore.open(args.dataset)
    model, _ = load_checkpoint(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        scratch_model = Path(tmp) / "model"
        shutil.copytree(args.model, scratch_model, ignore=shutil.ignore_patterns("embeddings"))
        t0 = time.perf_counter()
        precompute(graph, model, scratch_model, PrecomputeConfig(), progress=False)
        layerwise_s = time.perf_counter() - t0

    hops = (EVERY_NEIGHBOUR,) * model.num_layers
    executor = BatchExecutor(CPUSampler(graph, hops), HostFeatureStore(graph.features), model)
    rng = np.random.default_rng(0)
    subset = rng.choice(graph.num_nodes, size=min(args.subset, graph.num_nodes), replace=False)
    executor.run(subset[:1])
    t0 = time.perf_counter()
    for v in subset:
        executor.run(np.array([v]))
    nodewise_s = (time.perf_counter() - t0) / len(subset) * graph.num_nodes
    print(strict_json({
        "machine": machine(),
        "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges},
        "model": model.spec.to_dict(),
        "layerwise_precompute_s": round(layerwise_s, 2),
        "nodewise_all_nodes_s_scaled": round(nodewise_s, 1),
        "speedup": round(nodewise_s / layerwise_s, 1),
    }))


if __name__ == "__main__":
    main()
