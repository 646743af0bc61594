"""Precomputed embeddings (PEs): layer-wise precompute, the embedding store, and (later)
SRPE and incremental maintenance."""

from hybridgnn.embeddings.precompute import PrecomputeConfig, block_inputs, precompute
from hybridgnn.embeddings.store import EmbeddingStore

__all__ = ["EmbeddingStore", "PrecomputeConfig", "block_inputs", "precompute"]
