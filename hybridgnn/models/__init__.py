"""Models: the contract of what can be served (zoo), model directories with golden outputs
(checkpoint, golden), the layer-wise view (decompose), built-in GNNs and training."""

from hybridgnn.models.checkpoint import (
           load_checkpoint,
           load_model,
           save_checkpoint,
           save_model,
)
from hybridgnn.models.gnn import GNN, MODEL_KINDS, ModelSpec, build_model

__all__ = ["GNN", "MODEL_KINDS", "ModelSpec", "build_model", "load_checkpoint", "load_model", "save_checkpoint",
           "save_model"]
