"""Keyed neighbour sampling: a K-hop sample that any split of the graph draws alike.

Every candidate edge u -> v gets a pseudo-random 64-bit key from (seed, v, u, copy), and
v keeps the `fanout` candidates with the smallest keys (all of them when it has no more).
With independent uniform keys that is a uniform fanout-subset, as Floyd's draw in the
CPU sampler is, but it is a function of the edges alone, not of the order they are read
in or of who reads them. Ranks that each hold part of v's in-edges therefore pick
exactly one process's edges: each keeps its own smallest `fanout`, and the smallest
`fanout` of those are the global ones.

`copy` is 0 for a stored edge and QUERY_COPY for a request's, so the two are separate
candidates with separate keys. Parallel stored edges share a key; they are the same
edge, so whichever copy is kept, the sample is the same.

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


@numba.njit(cache=True, inline="always")
def _before(key_a, src_a, copy_a, key_b, src_b, copy_b):
    """(key, src, copy) order: the key decides; ties (next to impossible) go by src, copy."""
    if key_a != key_b:
        return key_a < key_b
    if src_a != src_b:
        return src_a < src_b
    return copy_a < copy_b


@numba.njit(cache=True)
def _draw(frontier, lens, g_src, q_start, q_len, qsrc, seeded, k):
    """Per frontier node: its stored candidates (the next lens[i] of g_src) and request
    candidates (qsrc[q_start[i]:][:q_len[i]]), keyed; the k smallest kept by (key, src,
    copy), in that order (a sorted buffer of k: most candidates are one comparison)."""
    bound = 0
    longest = 0
    for i in range(frontier.shape[0]):
        d = lens[i] + q_len[i]
        bound += min(d, k)
        longest = max(longest, d)
    out_dst = np.empty(bound, np.int64)
    out_src = np.empty(bound, np.int64)
    out_copy = np.empty(bound, np.int64)
    kk = min(k, longest)
    top_key = np.empty(kk, np.uint64)
    top_src = np.empty(kk, np.int64)
    top_copy = np.empty(kk, np.int64)
    off = 0
    e = 0
    for i in range(frontier.shape[0]):
        v = frontier[i]
        m = 0
        for t in range(lens[i] + q_len[i]):
            if t < lens[i]:
                u = g_src[off + t]
                c = 0
            else:
                u = qsrc[q_start[i] + t - lens[i]]
                c = QUERY_COPY
            key = _key(seeded, v, u, c)
            if m == kk and not _before(key, u, c, top_key[m - 1], top_src[m - 1], top_copy[m - 1]):
                continue
            j = m if m < kk else kk - 1
            while j > 0 and _before(key, u, c, top_key[j - 1], top_src[j - 1], top_copy[j - 1]):
                top_key[j] = top_key[j - 1]
                top_src[j] = top_src[j - 1]
                top_copy[j] = top_copy[j - 1]
                j -= 1
            top_key[j] = key
            top_src[j] = u
            top_copy[j] = c
            if m < kk:
                m += 1
        off += lens[i]
        for t in range(m):
            out_dst[e] = v
            out_src[e] = top_src[t]
            out_copy[e] = top_copy[t]
            e += 1
    return out_dst, out_src, out_copy


@numba.njit(cache=True)
def _place(ids, table_ids, table_pos, count, fresh):
    """Positions of ids in the sample (an open-addressing table, -1 empty, size a power
    of two), adding the ones not in it at count, count + 1, ... in order of first
    appearance (also written to fresh); returns (positions, how many were added)."""
    mask = np.uint64(table_ids.shape[0] - 1)
    pos = np.empty(ids.shape[0], np.int64)
    added = 0
    for e in range(ids.shape[0]):
        u = ids[e]
        h = np.int64(_mix(np.uint64(u)) & mask)
        while True:
            if table_ids[h] == -1:
                table_ids[h] = u
                table_pos[h] = count + added
                fresh[added] = u
                added += 1
                pos[e] = table_pos[h]
                break
            if table_ids[h] == u:
                pos[e] = table_pos[h]
                break
            h = np.int64((np.uint64(h) + np.uint64(1)) & mask)
    return pos, added


class _Positions:
    """Node id -> position in a sample, growing as nodes join (kept under half full)."""

    def __init__(self, expected: int):
        self.count = 0
        self._ids = np.full(max(16, 1 << int(2 * max(expected, 1) - 1).bit_length()), -1, dtype=np.int64)
        self._pos = np.empty(len(self._ids), dtype=np.int64)

    def place(self, ids: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions of ids, the ids that joined, in order); nodes: every node so far."""
        if 2 * (self.count + len(ids)) > len(self._ids):
            size = 1 << int(4 * (self.count + len(ids))).bit_length()
            self._ids = np.full(size, -1, dtype=np.int64)
            self._pos = np.empty(size, dtype=np.int64)
            _place(nodes, self._ids, self._pos, 0, np.empty(len(nodes), dtype=np.int64))
        fresh = np.empty(len(ids), dtype=np.int64)
        pos, added = _place(np.ascontiguousarray(ids, dtype=np.int64), self._ids, self._pos, self.count, fresh)
        self.count += added
        return pos, fresh[:added]


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
    nodes = np.ascontiguousarray(seeds, dtype=np.int64)
    table = _Positions(len(nodes) * (1 + sum(int(min(f, 64)) for f in fanouts)))
    _, joined = table.place(nodes, nodes[:0])
    if len(joined) != len(nodes):
        raise ValueError("seeds of a keyed sample must be distinct")
    srcs, dsts = [], []
    nodes_per_hop, edges_per_hop = [len(nodes)], []
    lo = 0
    for fanout in fanouts:
        dst_ids, src_ids = choose(nodes[lo:], int(fanout))
        dst_local, none = table.place(dst_ids, nodes)
        assert len(none) == 0, "choose returned an edge into a node outside the frontier"
        if len(dst_local) > 1 and (dst_local[1:] < dst_local[:-1]).any():  # to frontier order, keys kept in order
            order = np.argsort(dst_local, kind="stable")
            dst_local, src_ids = dst_local[order], src_ids[order]
        src_local, fresh = table.place(src_ids, nodes)  # new nodes in order of first appearance
        lo = len(nodes)
        nodes = np.concatenate([nodes, fresh])
        srcs.append(src_local)
        dsts.append(dst_local)
        nodes_per_hop.append(len(fresh))
        edges_per_hop.append(len(src_ids))
    empty = np.empty(0, dtype=np.int64)
    return KeyedSample(nodes, np.concatenate(srcs) if srcs else empty, np.concatenate(dsts) if dsts else empty,
                       np.array(nodes_per_hop, dtype=np.int64), np.array(edges_per_hop, dtype=np.int64))
