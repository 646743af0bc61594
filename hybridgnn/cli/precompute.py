"""`hybridgnn precompute`: layer-wise embeddings of every node, stored beside the model."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("precompute", help="precompute every node's per-layer embeddings (layer-wise inference)",
                       description="Runs the model layer by layer over all nodes and writes each layer's "
                                   "embeddings to <model>/embeddings/<dataset fingerprint>/layer_<i>.npy. "
                                   "An interrupted run resumes where it stopped.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    p.add_argument("--batch-size", type=int, default=16384, help="initial targets per batch (adapts)")
    p.add_argument("--order", choices=["natural", "rcm"], default="natural",
                   help="rcm: reverse Cuthill-McKee order so batches share inputs")
    p.set_defaults(run=run)


def run(args) -> int:
    from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import load_checkpoint

    graph = GraphStore.open(args.dataset)
    model, model_cfg = load_checkpoint(args.model)
    trained_on = model_cfg.get("dataset_fingerprint")
    if trained_on and trained_on != graph.fingerprint:  # as serve warns: allowed, but rarely meant
        logging.getLogger("hybridgnn.precompute").warning(
            "model was trained on dataset %s, precomputing for dataset %s", trained_on, graph.fingerprint)
    if model.in_dim != graph.feature_dim:
        raise ValueError(f"model expects {model.in_dim}-dim features, dataset has {graph.feature_dim}")
    store = precompute(graph, model, args.model, PrecomputeConfig(batch_size=args.batch_size, dtype=args.dtype,
                                                                  device=args.device, order=args.order))
    print(json.dumps({"embeddings": str(store.root), "layers": [list(a.shape) for a in store.layers],
                      "precompute_s": round(store.state.get("precompute_s", 0.0), 2),
                      "computed_unix_s": store.computed_unix_s}, indent=2))
    return 0
