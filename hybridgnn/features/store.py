"""Feature stores: given node ids, return their rows as one tensor on the caller's device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from hybridgnn.features import cuda_gather
from hybridgnn.graph.host import host_tensor


class FeatureStore(Protocol):
    feature_dim: int

    def gather(self, node_ids: np.ndarray) -> torch.Tensor: ...

    def rows_by_tier(self, node_ids: np.ndarray) -> dict[str, int]:
        """How many of these rows each tier serves (for the cache-hit metrics)."""
        ...

    def gather_counted(self, node_ids: np.ndarray) -> tuple[torch.Tensor, dict[str, int]]:
        """gather() and rows_by_tier() in one pass (what a pipeline calls per batch)."""
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

    def gather_counted(self, node_ids: np.ndarray) -> tuple[torch.Tensor, dict[str, int]]:
        return self.gather(node_ids), {"host": int(len(node_ids))}

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

    def gather_counted(self, node_ids: np.ndarray) -> tuple[torch.Tensor, dict[str, int]]:
        return self.gather(node_ids), {"host": int(len(node_ids))}

    def gather(self, node_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.graph.features(node_ids))


def gather_pending(store, node_ids) -> tuple[torch.Tensor, Callable[[], dict[str, int]]]:
    """(rows, tiers): tiers() gives gather_counted's per-tier counts, to be called once the
    stream's work is done. A store that counts on the device (CachedFeatureStore's one
    kernel) then adds no wait of its own to the batch; the others count at once."""
    pending = getattr(store, "gather_pending", None)
    if pending is not None:
        return pending(node_ids)
    rows, tiers = store.gather_counted(node_ids)
    return rows, lambda: tiers


def hottest_first(fap: np.ndarray) -> np.ndarray:
    """Node ids by descending feature access probability (ties by id, so plans are stable)."""
    return np.argsort(-np.asarray(fap, dtype=np.float64), kind="stable")


class CachedFeatureStore:
    """Feature rows for a pipeline on `device`: the hottest rows (FAP order) copied into
    device memory up to cache_bytes, the rest read from `host_table` (on CUDA a UVA view
    of pinned host memory, so the GPU reads them itself; on CPU the host matrix). Output:
    one [n, F] tensor on `device`. On a GPU with CuPy one kernel reads hits and misses
    (unless HYBRIDGNN_CUDA_GATHER=0) (features/cuda_gather.py); otherwise torch ops do,
    misses in sorted id order."""

    def __init__(self, features: np.ndarray, device: str | torch.device, cache_bytes: int,
                 order: np.ndarray | None = None, host_table: torch.Tensor | None = None):
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.device = torch.device(device)
        host = host_tensor(features)
        self.host = host_table if host_table is not None else host
        self.feature_dim = int(host.shape[1])
        num_nodes = int(host.shape[0])
        row_bytes = max(1, self.feature_dim * host.element_size())
        self.cached_rows = int(min(num_nodes, cache_bytes // row_bytes))
        hot = np.arange(self.cached_rows) if order is None else np.asarray(order[:self.cached_rows], np.int64)
        hot_t = torch.from_numpy(np.ascontiguousarray(hot, dtype=np.int64))
        # node -> its row in the cache, -1 where it is not cached
        self.slot = torch.full((num_nodes,), -1, dtype=torch.int32)
        self.slot[hot_t] = torch.arange(self.cached_rows, dtype=torch.int32)
        self.slot = self.slot.to(self.device)
        self.cache = torch.index_select(host, 0, hot_t).to(self.device)
        self.cache_bytes = int(self.cache.numel() * self.cache.element_size())
        # hits and misses in one kernel launch where cuda_gather allows it
        self._one_kernel = cuda_gather.usable(self.cache, self.host, self.slot)

    def gather_counted(self, node_ids) -> tuple[torch.Tensor, dict[str, int]]:
        out, tiers = self.gather_pending(node_ids)
        return out, tiers()

    def gather_pending(self, node_ids) -> tuple[torch.Tensor, Callable[[], dict[str, int]]]:
        """gather_counted with the hit count left on the device until tiers() (see
        store.gather_pending): the one-kernel gather then needs no wait of its own.
        tiers() holds this store (its cache) alive: a placement refresh swaps it out while
        the gather may still be queued on a worker's stream, and memory freed then could be
        handed to other work on another stream before the gather had read it. Callers call
        tiers() after their stream's sync."""
        ids = torch.as_tensor(node_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if self._one_kernel:
            out, hits = cuda_gather.gather_cached(ids, self.slot, self.cache, self.host)
            n = int(ids.shape[0])

            def tiers(_held=self) -> dict[str, int]:
                hit_count = int(hits)
                return {"gpu": hit_count, "host": n - hit_count}

            return out, tiers
        out, counts = self._gather_with_ops(ids)

        def counted(_held=self) -> dict[str, int]:
            return counts

        return out, counted

    def _gather_with_ops(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
        slot = self.slot[ids]
        hit = slot >= 0
        out = torch.empty((ids.shape[0], self.feature_dim), dtype=self.cache.dtype, device=self.device)
        hit_pos = torch.nonzero(hit).squeeze(1)
        miss_pos = torch.nonzero(~hit).squeeze(1)
        if hit_pos.numel():
            out[hit_pos] = torch.index_select(self.cache, 0, slot[hit_pos].to(torch.int64))
        if miss_pos.numel():
            miss_ids, order = torch.sort(ids[miss_pos])
            rows = torch.index_select(self.host, 0, miss_ids.to(self.host.device))
            out[miss_pos[order]] = rows.to(self.device, non_blocking=True)
        return out, {"gpu": int(hit_pos.numel()), "host": int(miss_pos.numel())}

    def gather(self, node_ids) -> torch.Tensor:
        return self.gather_counted(node_ids)[0]

    def rows_by_tier(self, node_ids) -> dict[str, int]:
        ids = torch.as_tensor(node_ids, dtype=torch.int64).to(self.device)
        hits = int((self.slot[ids] >= 0).sum())
        return {"gpu": hits, "host": int(ids.shape[0]) - hits}


class SwappableFeatureStore:
    """A feature store that can be replaced while serving: each gather reads `current`
    once, so a batch in flight finishes on the store it started with while new batches
    use the new one; nothing is dropped and no lock is taken on the hot path."""

    def __init__(self, store):
        self.current = store

    @property
    def feature_dim(self) -> int:
        return self.current.feature_dim

    def swap(self, store) -> None:
        if store.feature_dim != self.current.feature_dim:
            raise ValueError(f"new store has {store.feature_dim}-dim rows, the served one {self.current.feature_dim}")
        self.current = store

    def gather_counted(self, node_ids):
        return self.current.gather_counted(node_ids)

    def gather_pending(self, node_ids):
        return gather_pending(self.current, node_ids)

    def gather(self, node_ids):
        return self.current.gather(node_ids)

    def rows_by_tier(self, node_ids):
        return self.current.rows_by_tier(node_ids)
