"""CPU K-hop uniform neighbour sampler compiled with numba (nogil: worker threads run
in parallel).

Per hop, each frontier node u with degree d keeps all neighbours when d <= l and
otherwise draws l distinct positions with Floyd's algorithm (every l-subset equally
likely). Nodes reached for the first time join the next frontier (PyG's convention), so
node_ids are unique and ordered by hop. A per-instance global->local map (one int64 per
node, reset after each call by walking only the touched entries) avoids hashing.
"""

from __future__ import annotations

import numba
import numpy as np

from hybridgnn.graph.store import GraphStore
from hybridgnn.types import SampledSubgraph

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=True, inline="always")
def _next_u64(state):
    """splitmix64: small state, good equidistribution, cheap."""
    state[0] += _GOLDEN
    z = state[0]
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@numba.njit(nogil=True, cache=True, inline="always")
def _below(state, n):
    """Uniform integer in [0, n) by the multiply-shift method (no modulo bias worth noting)."""
    return np.int64((_next_u64(state) >> np.uint64(32)) * np.uint64(n) >> np.uint64(32))


@numba.njit(nogil=True, cache=True)
def _grow(arr, need):
    if arr.shape[0] >= need:
        return arr
    out = np.empty(max(need, 2 * arr.shape[0]), arr.dtype)
    out[: arr.shape[0]] = arr
    return out


@numba.njit(nogil=True, cache=True)
def sample_khop(indptr, indices, seeds, fanouts, local, state):
    """Returns (node_ids, src, dst, nodes_per_hop, edges_per_hop, seed_index); `local` must be
    all -1 on entry and is all -1 again on exit."""
    num_seeds = seeds.shape[0]
    num_hops = fanouts.shape[0]
    nodes = np.empty(max(16, 2 * num_seeds), np.int64)
    seed_index = np.empty(num_seeds, np.int64)
    n = 0
    for i in range(num_seeds):
        s = seeds[i]
        if local[s] < 0:
            local[s] = n
            nodes[n] = s
            n += 1
        seed_index[i] = local[s]
    nodes_per_hop = np.zeros(num_hops + 1, np.int64)
    edges_per_hop = np.zeros(num_hops, np.int64)
    nodes_per_hop[0] = n
    src = np.empty(16, np.int64)
    dst = np.empty(16, np.int64)
    e = 0
    max_fanout = 1
    for k in range(num_hops):
        max_fanout = max(max_fanout, fanouts[k])
    chosen = np.empty(max_fanout, np.int64)
    lo = 0
    hi = n
    for k in range(num_hops):
        fanout = fanouts[k]
        bound = 0
        for j in range(lo, hi):
            u = nodes[j]
            bound += min(indptr[u + 1] - indptr[u], fanout)
        src = _grow(src, e + bound)
        dst = _grow(dst, e + bound)
        nodes = _grow(nodes, n + bound)
        e_start = e
        for j in range(lo, hi):
            u = nodes[j]
            start = indptr[u]
            deg = indptr[u + 1] - start
            if deg <= fanout:
                for t in range(deg):
                    v = indices[start + t]
                    if local[v] < 0:
                        local[v] = n
                        nodes[n] = v
                        n += 1
                    src[e] = local[v]
                    dst[e] = j
                    e += 1
            else:
                m = 0
                for t in range(deg - fanout, deg):
                    r = _below(state, t + 1)
                    for q in range(m):
                        if chosen[q] == r:
                            r = t
                            break
                    chosen[m] = r
                    m += 1
                for q in range(m):
                    v = indices[start + chosen[q]]
                    if local[v] < 0:
                        local[v] = n
                        nodes[n] = v
                        n += 1
                    src[e] = local[v]
                    dst[e] = j
                    e += 1
        edges_per_hop[k] = e - e_start
        nodes_per_hop[k + 1] = n - hi
        lo = hi
        hi = n
    for j in range(n):
        local[nodes[j]] = -1
    return nodes[:n].copy(), src[:e].copy(), dst[:e].copy(), nodes_per_hop, edges_per_hop, seed_index


def _mix_seed(seed: int) -> np.ndarray:
    return np.array([(int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64], dtype=np.uint64)


class CPUSampler:
    """Sampler over a shared GraphStore; one instance per worker thread (it owns scratch
    state: the id map and the RNG). Same seed and same call sequence give the same samples."""

    def __init__(self, graph: GraphStore, fanouts, seed: int = 0):
        self.fanouts = tuple(int(f) for f in fanouts)
        self._fanouts = np.asarray(self.fanouts, dtype=np.int64)
        self._indptr = np.asarray(graph.indptr)
        self._indices = np.asarray(graph.indices)
        self._num_nodes = graph.num_nodes
        self._local = np.full(self._num_nodes, -1, dtype=np.int64)
        self._state = _mix_seed(seed)

    def reseed(self, seed: int) -> None:
        self._state = _mix_seed(seed)

    def sample(self, seeds: np.ndarray) -> SampledSubgraph:
        seeds = np.ascontiguousarray(seeds, dtype=np.int64)
        if seeds.ndim != 1:
            raise ValueError(f"seeds must be 1-D, got shape {seeds.shape}")
        if seeds.size and (seeds.min() < 0 or seeds.max() >= self._num_nodes):
            raise ValueError(f"seed ids must lie in [0, {self._num_nodes})")
        nodes, src, dst, nph, eph, seed_index = sample_khop(
            self._indptr, self._indices, seeds, self._fanouts, self._local, self._state
        )
        return SampledSubgraph(
            node_ids=nodes,
            edge_index=np.stack([src, dst]),
            num_sampled_nodes=nph,
            num_sampled_edges=eph,
            seed_index=seed_index,
        )
