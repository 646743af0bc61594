"""Keyed neighbour sampling: a K-hop sample that any split of the graph draws alike.

Every candidate edge u -> v gets a pseudo-random 64-bit key from (seed, v, u, copy), and
v keeps the `fanout` candidates with the smallest keys (all of them when it has no more).
With independent uniform keys that is a uniform fanout-subset, as Floyd's draw in the
CPU sampler is, but it is a function of the edges alone, not of the order they are read
in or of who reads them. Ranks that each hold part of v's in-edges therefore pick
exactly one process's edges: each keeps its own smallest `fanout`, and the smallest
`fanout` of those are the global ones.

`copy` tells parallel edges apart: the j-th copy of a stored edge u -> v has copy j,
a request's (deduplicated) edge copy QUERY_COPY, so a request edge that repeats a
stored one is a second candidate, as in the CPU sampler's overlay.

Nodes join the sample in PyG's order: the seeds, then per hop the nodes reached for the
first time, in the order of the kept edges (by target position, then key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np

QUERY_COPY = 1 << 40

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ODD_DST = np.uint64(0xD6E8FEB86659FD93)
_ODD_SRC = np.uint64(0xA0761D6478BD642F)
_ODD_COPY = np.uint64(0xE7037ED1A0B428DB)


@numba.njit(cache=True, inline="always")
def _mix(z):
    """splitmix64's finaliser."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True, inline="always")
def _key(seeded, dst, src, copy):
    z = _mix(seeded ^ (np.uint64(dst) * _ODD_DST))
    z = _mix(z ^ (np.uint64(src) * _ODD_SRC))
    return _mix(z ^ (np.uint64(copy) * _ODD_COPY))


def _seeded(seed: int) -> np.uint64:
    return np.uint64((int(seed) * 0x9E3779B97F4A7C15) % 2**64)


@numba.njit(cache=True)
def _keys(seeded, dst, src, copy):
    out = np.empty(dst.shape[0], np.uint64)
    for e in range(dst.shape[0]):
        out[e] = _key(seeded, dst[e], src[e], copy[e])
    return out


def edge_keys(seed: int, dst: np.ndarray, src: np.ndarray, copy: np.ndarray) -> np.ndarray:
    """The key of each candidate edge src -> dst (uint64)."""
    as64 = [np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, copy)]
    return _keys(_seeded(seed), *as64)


def bottom_k(dst: np.ndarray, src: np.ndarray, copy: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """Indices of the edges each target keeps: its k smallest by (key, src, copy), grouped
    by target (ascending) and ordered by key within a target."""
    if len(dst) == 0:
        return np.empty(0, dtype=np.int64)
    order = np.lexsort((copy, src, keys, dst))
    d = dst[order]
    new = np.ones(len(d), dtype=bool)
    new[1:] = d[1:] != d[:-1]
    starts = np.flatnonzero(new)
    rank = np.arange(len(d)) - np.repeat(starts, np.diff(np.append(starts, len(d))))
    return order[rank < k]


def keep_smallest(dst, src, copy, seed: int, fanout: int):
    """Of candidate edges (dst, src, copy) in any order, those each target keeps (bottom_k
    by edge_keys): how the parts' draws are merged."""
    keep = bottom_k(dst, src, copy, edge_keys(seed, dst, src, copy), fanout)
    return dst[keep], src[keep], copy[keep]


@numba.njit(cache=True)
def _draw(frontier, lens, g_src, q_start, q_len, qsrc, seeded, k):
    """Per frontier node: its stored candidates (the next lens[i] of g_src) and request
    candidates (qsrc[q_start[i]:][:q_len[i]], sorted), keyed; the k smallest kept, by
    (key, src, copy), in that order."""
    bound = 0
    longest = 0
    for i in range(frontier.shape[0]):
        d = lens[i] + q_len[i]
        bound += min(d, k)
        longest = max(longest, d)
    out_dst = np.empty(bound, np.int64)
    out_src = np.empty(bound, np.int64)
    out_copy = np.empty(bound, np.int64)
    cand_src = np.empty(longest, np.int64)
    cand_copy = np.empty(longest, np.int64)
    cand_key = np.empty(longest, np.uint64)
    off = 0
    e = 0
    for i in range(frontier.shape[0]):
        v = frontier[i]
        stored = np.sort(g_src[off:off + lens[i]])
        off += lens[i]
        # merge stored (by src, copies counted) and request candidates (by src): (src, copy) order
        a = 0
        b = 0
        m = 0
        qs = q_start[i]
        while a < stored.shape[0] or b < q_len[i]:
            if b >= q_len[i] or (a < stored.shape[0] and stored[a] <= qsrc[qs + b]):
                u = stored[a]
                c = 0 if a == 0 or stored[a - 1] != u else cand_copy[m - 1] + 1
                a += 1
            else:
                u = qsrc[qs + b]
                c = QUERY_COPY
                b += 1
            cand_src[m] = u
            cand_copy[m] = c
            cand_key[m] = _key(seeded, v, u, c)
            m += 1
        order = np.argsort(cand_key[:m], kind="mergesort")  # stable: ties stay in (src, copy) order
        for t in range(min(m, k)):
            j = order[t]
            out_dst[e] = v
            out_src[e] = cand_src[j]
            out_copy[e] = cand_copy[j]
            e += 1
    return out_dst, out_src, out_copy


def draw(frontier: np.ndarray, num_nodes: int, in_rows, qsrc: np.ndarray, qdst: np.ndarray, seed: int,
         fanout: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (dst, src, copy) edges each frontier node keeps of its candidates: stored
    in-edges from in_rows(existing nodes) -> (lengths, sources), and the given request
    edges (sorted by target, then source, as embeddings.newnodes.query_edges gives them).
    Grouped by frontier node in frontier order, by key within one."""
    frontier = np.ascontiguousarray(frontier, dtype=np.int64)
    existing = frontier < num_nodes
    lens = np.zeros(len(frontier), dtype=np.int64)
    row_lens, g_src = in_rows(frontier[existing])
    lens[existing] = row_lens
    q_start = np.searchsorted(qdst, frontier, side="left")
    q_len = np.searchsorted(qdst, frontier, side="right") - q_start
    return _draw(frontier, lens, np.ascontiguousarray(g_src, dtype=np.int64), q_start.astype(np.int64), q_len,
                 np.ascontiguousarray(qsrc, dtype=np.int64), _seeded(seed), int(fanout))


@dataclass
class KeyedSample:
    nodes: np.ndarray            # global ids: the seeds, then each hop's newly reached nodes
    src: np.ndarray              # edge sources, as positions in nodes
    dst: np.ndarray              # edge targets, as positions in nodes (edges in hop order)
    nodes_per_hop: np.ndarray    # [hops + 1]
    edges_per_hop: np.ndarray    # [hops]

    @property
    def edge_index(self) -> np.ndarray:
        return np.stack([self.src, self.dst])

    def within(self, hops: int) -> int:
        """How many nodes lie within `hops` hops of the seeds (a prefix of nodes)."""
        return int(self.nodes_per_hop[: hops + 1].sum())

    def edges_within(self, hops: int) -> int:
        """How many edges the first `hops` hops drew (a prefix of the edges)."""
        return int(self.edges_per_hop[:hops].sum())


def sample_keyed(seeds: np.ndarray, fanouts, choose: Callable[[np.ndarray, int], tuple]) -> KeyedSample:
    """K-hop sample around distinct seeds; choose(frontier ids, fanout) -> (dst ids, src
    ids) of the edges kept into the frontier, grouped by target, by key within one."""
    nodes = np.asarray(seeds, dtype=np.int64)
    known_pos = np.argsort(nodes, kind="stable")
    known = nodes[known_pos]  # every node so far, sorted, with its position
    if len(known) > 1 and not (known[1:] != known[:-1]).all():
        raise ValueError("seeds of a keyed sample must be distinct")
    srcs, dsts = [], []
    nodes_per_hop, edges_per_hop = [len(nodes)], []
    lo = 0
    for fanout in fanouts:
        frontier = nodes[lo:]
        dst_ids, src_ids = choose(frontier, int(fanout))
        by_id = np.argsort(frontier, kind="stable")
        dst_local = by_id[np.searchsorted(frontier[by_id], dst_ids)] + lo
        if len(dst_local) > 1 and (dst_local[1:] < dst_local[:-1]).any():  # to frontier order, keys kept in order
            order = np.argsort(dst_local, kind="stable")
            dst_local, src_ids = dst_local[order], src_ids[order]
        uniq, first, inverse = np.unique(src_ids, return_index=True, return_inverse=True)
        at = np.minimum(np.searchsorted(known, uniq), len(known) - 1)
        seen = known[at] == uniq
        pos = np.empty(len(uniq), dtype=np.int64)
        pos[seen] = known_pos[at[seen]]
        fresh = np.flatnonzero(~seen)
        fresh = fresh[np.argsort(first[fresh], kind="stable")]  # in order of first appearance
        pos[fresh] = len(nodes) + np.arange(len(fresh))
        lo = len(nodes)
        nodes = np.concatenate([nodes, uniq[fresh]])
        new_sorted = np.flatnonzero(~seen)  # uniq is sorted, so these are too
        slot = np.searchsorted(known, uniq[new_sorted])
        known, known_pos = np.insert(known, slot, uniq[new_sorted]), np.insert(known_pos, slot, pos[new_sorted])
        srcs.append(pos[inverse.reshape(-1)])
        dsts.append(dst_local)
        nodes_per_hop.append(len(fresh))
        edges_per_hop.append(len(src_ids))
    empty = np.empty(0, dtype=np.int64)
    return KeyedSample(nodes, np.concatenate(srcs) if srcs else empty, np.concatenate(dsts) if dsts else empty,
                       np.array(nodes_per_hop, dtype=np.int64), np.array(edges_per_hop, dtype=np.int64))
