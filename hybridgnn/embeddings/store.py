"""Per-layer embedding arrays beside a checkpoint, memory-mapped.

Layout: <model_dir>/embeddings/<dataset fingerprint>/
    layer_1.npy .. layer_L.npy   [N, d_i] float32 or float16 (layer_L = the model's output)
    output.npy                   [N, d_out]: the output of a jumping-knowledge model, which
                                 mixes every layer's rows (absent otherwise)
    state.json                   progress (for resuming), the weights they are computed with
                                 (model_fingerprint) and, when complete, computed_unix_s
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.config import read_json

log = logging.getLogger(__name__)


def embeddings_dir(model_dir: Path, dataset_fingerprint: str) -> Path:
    return Path(model_dir) / "embeddings" / dataset_fingerprint


@dataclass
class EmbeddingStore:
    root: Path
    layers: list[np.ndarray]  # layers[i] = output of layer i+1
    state: dict
    output: np.ndarray | None = None  # jumping-knowledge models: their output per node

    @property
    def final(self) -> np.ndarray:
        return self.output if self.output is not None else self.layers[-1]

    @property
    def computed_unix_s(self) -> float:
        return float(self.state["computed_unix_s"])

    @classmethod
    def open(cls, model_dir: Path, dataset_fingerprint: str) -> "EmbeddingStore | None":
        """The complete store for this model and dataset, or None when absent or unfinished."""
        root = embeddings_dir(model_dir, dataset_fingerprint)
        state_path = root / "state.json"
        if not state_path.is_file():
            return None
        try:
            state = read_json(state_path)
        except ValueError:  # not a state a finished precompute wrote: no stored embeddings
            return None
        if not isinstance(state, dict) or not state.get("complete"):
            return None
        made_with = state.get("model_fingerprint")  # absent in stores written before it was recorded
        if made_with is not None and made_with != weights_of(model_dir):
            log.warning("precomputed embeddings in %s were computed with other weights than %s has now: not "
                        "served (run `hybridgnn precompute` again)", root, model_dir)
            return None
        layers = [np.load(root / f"layer_{i + 1}.npy", mmap_mode="r") for i in range(state["num_layers"])]
        output = np.load(root / "output.npy", mmap_mode="r") if state.get("output") else None
        return cls(root=root, layers=layers, state=state, output=output)

    def lookup(self, node_ids: np.ndarray) -> np.ndarray:
        """The model's output rows (logits) as float32 (constant time per id)."""
        # indexed as a plain array: a memmap's own indexing makes a memmap of the rows, at
        # several times the cost of the copy for the few rows a request names
        return np.asarray(np.asarray(self.final)[node_ids], dtype=np.float32)


def weights_of(model_dir: Path) -> str | None:
    """The fingerprint of the weights in model_dir (what embeddings computed now are
    computed with), or None for a directory without weights (a model given in code)."""
    from hybridgnn.models.checkpoint import WEIGHTS, weights_fingerprint

    return weights_fingerprint(model_dir) if (Path(model_dir) / WEIGHTS).is_file() else None


def hidden_rows(model, layers: list[np.ndarray], features, node_ids: np.ndarray) -> np.ndarray:
    """What the model's head reads (its `embedding`) for node_ids, from stored per-layer
    rows: the jumping-knowledge output, else layer L-1's rows, else (one layer) the
    features. features(ids) gives input rows."""
    if model.readout_needed:
        import torch

        rows = [torch.from_numpy(np.asarray(a[node_ids], dtype=np.float32)) for a in layers]
        with torch.inference_mode():
            return model.embedding(rows, None).float().numpy()
    if len(layers) >= 2:
        return np.asarray(layers[-2][node_ids], dtype=np.float32)
    return np.asarray(features(node_ids), dtype=np.float32)


def write_state(root: Path, state: dict) -> None:
    tmp = root / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(root / "state.json")  # atomic: a crash leaves the old or the new state


def mark_complete(root: Path, state: dict) -> dict:
    state = {**state, "complete": True, "computed_unix_s": time.time()}
    write_state(root, state)
    return state
