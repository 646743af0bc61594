"""Precomputed embeddings (PEs): layer-wise precompute, the embedding store, new nodes
(full / PE / SRPE) and incremental maintenance under graph updates."""

from hybridgnn.embeddings.precompute import PrecomputeConfig, block_inputs, precompute
from hybridgnn.embeddings.store import EmbeddingStore

__all__ = ["EmbeddingStore", "PrecomputeConfig", "block_inputs", "precompute"]
