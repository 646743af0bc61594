"""Feature stores: given node ids, return their rows as one tensor on the caller's device."""

from __future__ import annotations

import warnings
from typing import Protocol

import numpy as np
import torch


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a (possibly read-only, mmap'd) array without copying it."""
    with warnings.catch_warnings():
        # The mmap is read-only on purpose; nothing here writes through the tensor.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(array))


class FeatureStore(Protocol):
    feature_dim: int

    def gather(self, node_ids: np.ndarray) -> torch.Tensor: ...

    def rows_by_tier(self, node_ids: np.ndarray) -> dict[str, int]:
        """How many of these rows each tier serves (for the cache-hit metrics)."""
        ...


class HostFeatureStore:
    """Rows read from the dataset's feature matrix in host memory (mmap'd, shared by all
    workers). torch.index_select runs without the GIL, so worker threads gather in parallel."""

    def __init__(self, features: np.ndarray):
        self._table = host_tensor(features)
        self.feature_dim = int(self._table.shape[1])

    @property
    def table(self) -> torch.Tensor:
        return self._table

    def rows_by_tier(self, node_ids: np.ndarray) -> dict[str, int]:
        return {"host": int(len(node_ids))}

    def gather(self, node_ids: np.ndarray) -> torch.Tensor:
        return torch.index_select(self._table, 0, torch.from_numpy(np.ascontiguousarray(node_ids, dtype=np.int64)))


class DynamicFeatureStore:
    """Rows of a hybridgnn.graph.dynamic.DynamicGraph: the base matrix with updated and new
    nodes' rows patched in. The caller holds the graph's read lock."""

    def __init__(self, graph):
        self.graph = graph
        self.feature_dim = graph.feature_dim

    def rows_by_tier(self, node_ids: np.ndarray) -> dict[str, int]:
        return {"host": int(len(node_ids))}

    def gather(self, node_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.graph.features(node_ids))
