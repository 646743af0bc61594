"""PyG model builders, checkpoints (state_dict + JSON, weights_only), training."""

from hybridgnn.models.checkpoint import load_checkpoint, save_checkpoint
from hybridgnn.models.gnn import GNN, MODEL_KINDS, ModelSpec, build_model

__all__ = ["GNN", "MODEL_KINDS", "ModelSpec", "build_model", "load_checkpoint", "save_checkpoint"]
