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


@numba.njit(nogil=True, cache=True, inline="always")
def _choose(deg, fanout, state, chosen):
    """Positions of the neighbours to take into chosen[:m]; returns m = min(deg, fanout).
    All of them when deg <= fanout, else a uniform fanout-subset by Floyd's algorithm."""
    m = 0
    if deg <= fanout:
        for t in range(deg):
            chosen[m] = t
            m += 1
        return m
    for t in range(deg - fanout, deg):
        r = _below(state, t + 1)
        for q in range(m):
            if chosen[q] == r:
                r = t
                break
        chosen[m] = r
        m += 1
    return m


@numba.njit(nogil=True, cache=True)
def _grow(arr, need):
    if arr.shape[0] >= need:
        return arr
    out = np.empty(max(need, 2 * arr.shape[0]), arr.dtype)
    out[: arr.shape[0]] = arr
    return out


@numba.njit(nogil=True, cache=True)
def _patched_row(indptr, indices, slot, row_start, row_len, pool, u):
    """(array, start, length) of u's row when graph updates may have rewritten it: the
    patch pool's row if so, else the base CSR's; ids past the base have none unpatched."""
    sl = slot[u]
    if sl >= 0:
        return pool, row_start[sl], row_len[sl]
    if u + 1 < indptr.shape[0]:
        return indices, indptr[u], indptr[u + 1] - indptr[u]
    return indices, np.int64(0), np.int64(0)


@numba.njit(nogil=True, cache=True)
def expand_row(row, start, deg, fanout, j, nodes, n, src, dst, e, local, state, chosen):
    """One frontier node j's draw from its row (row[start:start+deg]): the chosen
    neighbours join nodes (numbered through local) and edges (src, dst) from n and e.
    Returns (n, e). The homogeneous kernel uses it for rows read through the patch table
    (the rare path, kept out of line so the base path's loop stays tight); the typed
    sampler for every row."""
    m = _choose(deg, fanout, state, chosen)
    for q in range(m):
        v = np.int64(row[start + chosen[q]])
        if local[v] < 0:
            local[v] = n
            nodes[n] = v
            n += 1
        src[e] = local[v]
        dst[e] = j
        e += 1
    return n, e


@numba.njit(nogil=True, cache=True)
def sample_khop(indptr, indices, seeds, fanouts, local, state, slot, row_start, row_len, pool):
    """Returns (node_ids, src, dst, nodes_per_hop, edges_per_hop, seed_index); `local` must be
    all -1 on entry and is all -1 again on exit. slot/row_start/row_len/pool describe rows
    rewritten by graph updates (empty slot: the base CSR alone)."""
    patched = slot.shape[0] > 0
    num_base = indptr.shape[0] - 1
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
    # positions drawn in one row: grown to the widest min(degree, fanout) of each hop, not
    # sized by the fanout ("every neighbour" fanouts such as 10**10 allocated that many)
    chosen = np.empty(16, np.int64)
    lo = 0
    hi = n
    for k in range(num_hops):
        fanout = fanouts[k]
        bound = 0
        widest = 0
        for j in range(lo, hi):
            u = nodes[j]
            if patched:
                _, _, deg = _patched_row(indptr, indices, slot, row_start, row_len, pool, u)
            else:
                deg = indptr[u + 1] - indptr[u]
            bound += min(deg, fanout)
            widest = max(widest, min(deg, fanout))
        chosen = _grow(chosen, widest)
        src = _grow(src, e + bound)
        dst = _grow(dst, e + bound)
        nodes = _grow(nodes, n + bound)
        e_start = e
        for j in range(lo, hi):
            u = nodes[j]
            if patched and (u >= num_base or slot[u] >= 0):
                row, start, deg = _patched_row(indptr, indices, slot, row_start, row_len, pool, u)
                n, e = expand_row(row, start, deg, fanout, j, nodes, n, src, dst, e, local, state, chosen)
                continue
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
                m = _choose(deg, fanout, state, chosen)
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


@numba.njit(nogil=True, cache=True, inline="always")
def _neighbour(indptr, indices, ov_indptr, ov_indices, u, base_deg, ov_slot, t):
    """The t-th candidate of u: its stored row first, then its overlay row."""
    if t < base_deg:
        return np.int64(indices[indptr[u] + t])
    return np.int64(ov_indices[ov_indptr[ov_slot] + t - base_deg])


@numba.njit(nogil=True, cache=True)
def sample_khop_overlay(indptr, indices, seeds, fanouts, local, state, ov_nodes, ov_indptr, ov_indices):
    """sample_khop over the stored graph plus an overlay. A separate kernel because the
    overlay's per-node lookups cost the plain kernel about a quarter of its speed, and
    factoring the shared steps into inlined helpers cost it ~40% (measured with
    bench/sampler.py), so the two kernels repeat each other on purpose.

    The overlay (ov_nodes sorted; row s of ov_indptr/ov_indices) adds candidates to nodes,
    including nodes with ids >= the stored graph's size (new nodes of a request); empty
    overlay arrays sample the stored graph alone."""
    num_base = indptr.shape[0] - 1
    num_ov = ov_nodes.shape[0]
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
    # positions drawn in one row: grown to the widest min(degree, fanout) of each hop, not
    # sized by the fanout ("every neighbour" fanouts such as 10**10 allocated that many)
    chosen = np.empty(16, np.int64)
    lo = 0
    hi = n
    for k in range(num_hops):
        fanout = fanouts[k]
        # per frontier node: stored degree, overlay slot (-1: none) and total degree
        base_deg = np.zeros(hi - lo, np.int64)
        slot = np.full(hi - lo, -1, np.int64)
        bound = 0
        widest = 0
        for j in range(lo, hi):
            u = nodes[j]
            d = indptr[u + 1] - indptr[u] if u < num_base else 0
            base_deg[j - lo] = d
            if num_ov > 0:
                p = np.searchsorted(ov_nodes, u)
                if p < num_ov and ov_nodes[p] == u:
                    slot[j - lo] = p
                    d += ov_indptr[p + 1] - ov_indptr[p]
            bound += min(d, fanout)
            widest = max(widest, min(d, fanout))
        chosen = _grow(chosen, widest)
        src = _grow(src, e + bound)
        dst = _grow(dst, e + bound)
        nodes = _grow(nodes, n + bound)
        e_start = e
        for j in range(lo, hi):
            u = nodes[j]
            bd = base_deg[j - lo]
            sl = slot[j - lo]
            deg = bd + (ov_indptr[sl + 1] - ov_indptr[sl] if sl >= 0 else 0)
            if sl < 0 and deg <= fanout:  # the common case, kept tight: every stored neighbour
                start = indptr[u]
                for t in range(deg):
                    v = np.int64(indices[start + t])
                    if local[v] < 0:
                        local[v] = n
                        nodes[n] = v
                        n += 1
                    src[e] = local[v]
                    dst[e] = j
                    e += 1
                continue
            m = _choose(deg, fanout, state, chosen)
            for q in range(m):
                v = _neighbour(indptr, indices, ov_indptr, ov_indices, u, bd, sl, chosen[q])
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


_NO_PATCH = np.empty(0, dtype=np.int64)


class CPUSampler:
    """Sampler over a shared graph; one instance per worker thread (it owns scratch state:
    the id map and the RNG). Same seed and same call sequence give the same samples.

    `graph` is a GraphStore or a hybridgnn.graph.dynamic.DynamicGraph; over a dynamic graph
    it samples the graph as it is at the call, and the caller holds `graph.lock.read()`
    around the call (and whatever else must see the same version, e.g. the gather)."""

    def __init__(self, graph, fanouts, seed: int = 0):
        self.fanouts = tuple(int(f) for f in fanouts)
        self._fanouts = np.asarray(self.fanouts, dtype=np.int64)
        self._dynamic = hasattr(graph, "fwd")
        self._graph = graph
        if not self._dynamic:
            self._indptr = np.asarray(graph.indptr)
            self._indices = np.asarray(graph.indices)
        self._local = np.full(graph.num_nodes, -1, dtype=np.int64)
        self._state = _mix_seed(seed)

    @property
    def _num_nodes(self) -> int:
        return self._graph.num_nodes

    def _arrays(self):
        if not self._dynamic:
            return self._indptr, self._indices, _NO_PATCH, _NO_PATCH, _NO_PATCH, self._indices[:0]
        fwd = self._graph.fwd
        if fwd.num_slots == 0 and fwd.num_nodes == fwd.num_base:
            return fwd.base_indptr, fwd.base_indices, _NO_PATCH, _NO_PATCH, _NO_PATCH, fwd.base_indices[:0]
        return fwd.base_indptr, fwd.base_indices, fwd.slot, fwd.row_start, fwd.row_len, fwd.pool

    def sample(self, seeds: np.ndarray, overlay: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               num_extra_nodes: int = 0) -> SampledSubgraph:
        """Sample around seeds. `overlay` = (nodes sorted, indptr, indices) adds candidate
        neighbours, and with num_extra_nodes > 0 ids up to num_nodes + num_extra_nodes - 1
        exist (a request's new nodes, known only through the overlay)."""
        # writable: numba compiles again for a read-only array (a worker process's np.frombuffer
        # seeds), taking a second on a batch when the kernels were warmed up on writable ones
        seeds = np.require(seeds, dtype=np.int64, requirements=["C", "W"])
        if seeds.ndim != 1:
            raise ValueError(f"seeds must be 1-D, got shape {seeds.shape}")
        limit = self._num_nodes + num_extra_nodes
        if seeds.size and (seeds.min() < 0 or seeds.max() >= limit):
            raise ValueError(f"seed ids must lie in [0, {limit})")
        if limit > self._local.shape[0]:
            self._local = np.concatenate([self._local, np.full(limit - self._local.shape[0], -1, np.int64)])
        if overlay is None:
            nodes, src, dst, nph, eph, seed_index = sample_khop(
                *self._arrays()[:2], seeds, self._fanouts, self._local, self._state, *self._arrays()[2:])
        else:
            if self._dynamic:
                raise ValueError("query-edge overlays sample the stored graph only; compact the dynamic graph first")
            ov = tuple(np.require(a, dtype=np.int64, requirements=["C", "W"]) for a in overlay)
            nodes, src, dst, nph, eph, seed_index = sample_khop_overlay(
                self._indptr, self._indices, seeds, self._fanouts, self._local, self._state, *ov)
        return SampledSubgraph(
            node_ids=nodes,
            edge_index=np.stack([src, dst]),
            num_sampled_nodes=nph,
            num_sampled_edges=eph,
            seed_index=seed_index,
        )
