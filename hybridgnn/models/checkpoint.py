"""Checkpoints: a directory with model.pt (state_dict only) and config.json.

Loading uses torch.load(weights_only=True): a checkpoint can carry tensors, never code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridgnn.errors import ConfigError
from hybridgnn.models.gnn import GNN, ModelSpec


class CheckpointError(ConfigError):
    """A model directory is missing files or does not match its config."""


def save_checkpoint(model: GNN, path: str | Path, *, extra: dict | None = None) -> Path:
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), root / "model.pt")
    config = {"spec": model.spec.to_dict(), **(extra or {})}
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[GNN, dict]:
    root = Path(path)
    cfg_path, weights_path = root / "config.json", root / "model.pt"
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise CheckpointError(f"model directory {root} lacks {p.name}")
    try:
        config = json.loads(cfg_path.read_text())
        spec = ModelSpec(**config["spec"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path} does not describe a model: {exc}") from exc
    model = GNN(spec)
    try:
        state = torch.load(weights_path, map_location=map_location, weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:  # unpickling and shape errors come in several types
        raise CheckpointError(f"cannot load weights from {weights_path}: {exc}") from exc
    model.eval()
    return model, config
