"""Seed counts and the live placement refresh (SIGHUP): which nodes requests named, and
a GPU feature cache rebuilt from them while requests keep flowing; on a heterogeneous
graph, which nodes of each type (TypedSeedCounts, for the seed log only)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hybridgnn.capabilities import DEVICE_GATE, write_replacing
from hybridgnn.runtime.resources import Resources
from hybridgnn.types import ServingStats
from hybridgnn.workload.typed import write_typed_counts

log = logging.getLogger(__name__)


class SeedCounts:
    """Per-node request counts of a homogeneous graph since start, written as the seed log
    (a .counts.npy; the partitioned engine's, and PlacementRefresh's)."""

    def __init__(self, num_nodes: int, counts: np.ndarray | None = None):
        """counts: an array to count into, shared (every model of a repository counts into
        its graph's one); else a new one."""
        # Requests per node of the stored graph: the seed distribution FAP is computed from.
        self.seed_counts = counts if counts is not None else np.zeros(num_nodes, dtype=np.int64)

    def count(self, seeds: np.ndarray) -> None:
        """Count requested seeds of the stored graph (nodes added by updates are not counted:
        placement plans cover the stored graph)."""
        n = self.seed_counts.shape[0]
        np.add.at(self.seed_counts, seeds[seeds < n] if seeds.size and seeds.max() >= n else seeds, 1)

    def save_seed_log(self, path) -> None:
        """Write the per-node request counts (atomically) for `hybridgnn place --from-log`."""
        # a temporary of this process's own, fsynced before the rename: two replicas given
        # one path no longer write into one temporary, nor leave a torn file after a crash
        counts = self.seed_counts.copy()
        write_replacing(Path(path), lambda tmp: np.save(tmp, counts))


class PlacementRefresh(SeedCounts):
    """Per-node request counts since start and the refresh of the device cache from them."""

    def __init__(self, resources: Resources, stats: ServingStats):
        super().__init__(resources.graph.num_nodes, resources.seed_counts)
        self.resources = resources
        self.stats = stats

    def _build(self, counts: np.ndarray, old):
        """The new cache, FAP, order and the rows it keeps of the old one (a worker thread,
        never the event loop). Only the device copies hold the device gate: the FAP is
        seconds of CPU work, and a capture waiting on the gate holds all new device work."""
        fap, order = self.resources.hottest_for_seed_counts(counts)
        with DEVICE_GATE.work():
            cache = self.resources.device_cache(order)
            kept = int(np.intersect1d(np.flatnonzero(old.slot.cpu().numpy() >= 0),
                                      np.flatnonzero(cache.slot.cpu().numpy() >= 0)).size)
        return cache, fap, order, kept

    async def refresh(self) -> dict:
        """Recompute FAP from the seeds requested so far and swap in a device cache of the
        new hottest rows; requests keep flowing (see SwappableFeatureStore)."""
        r = self.resources
        if r.gpu_features is None:
            raise LookupError("no GPU feature cache to refresh (the server runs the CPU pipeline only)")
        if r.plan is not None:
            raise LookupError("serving a fixed placement plan: recompute it with `hybridgnn place --from-log` "
                              "and restart with the new --placement")
        counts = self.seed_counts.copy()
        if counts.sum() == 0:
            raise LookupError("no requests counted yet: nothing to compute a seed distribution from")
        old = r.gpu_features.current
        t0 = time.perf_counter()
        cache, fap, order, kept = await asyncio.to_thread(self._build, counts, old)
        seconds = time.perf_counter() - t0
        r.gpu_features.swap(cache)
        self.stats.placement_refreshed()
        report = {"cached_rows": cache.cached_rows, "rows_kept": kept, "requests_counted": int(counts.sum()),
                  "seconds": round(seconds, 3), "cached_fap_share": float(fap[order[:cache.cached_rows]].sum()
                                                                            / max(fap.sum(), 1e-12))}
        log.info("placement refreshed from %d counted requests in %.2fs: %d of %d cached rows kept",
                 report["requests_counted"], seconds, kept, cache.cached_rows)
        return report


class TypedSeedCounts:
    """Per-node request counts of each node type of a heterogeneous graph: the nodes its
    samples are rooted at (a node request's ids, a pair's both ends, a top-k's seeds and
    candidates), written as one .counts.npz for `hybridgnn workload build --seeds`."""

    def __init__(self, num_nodes: dict[str, int]):
        # every type's array made now: the writer's thread never sees the dict change size
        self.counts = {t: np.zeros(n, dtype=np.int64) for t, n in num_nodes.items()}

    def count(self, seeds: Iterable[tuple[str, np.ndarray]]) -> None:
        """Count (node type, ids) pairs of validated requests (ids within their type)."""
        for node_type, ids in seeds:
            np.add.at(self.counts[node_type], ids, 1)

    def save_seed_log(self, path) -> None:
        """Write the counts of every node type a request named (atomically: temporary,
        fsync, rename)."""
        counts = {t: v.copy() for t, v in self.counts.items()}
        write_typed_counts(Path(path), {t: v for t, v in counts.items() if v.any()})
