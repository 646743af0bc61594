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

import numpy as np

QUERY_COPY = 1 << 40

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ODD = (np.uint64(0xD6E8FEB86659FD93), np.uint64(0xA0761D6478BD642F), np.uint64(0xE7037ED1A0B428DB))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arrays wrap, as the hash needs)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def edge_keys(seed: int, dst: np.ndarray, src: np.ndarray, copy: np.ndarray) -> np.ndarray:
    """The key of each candidate edge src -> dst (uint64)."""
    z = np.full(len(dst), np.uint64(int(seed) % 2**64)) * _GOLDEN
    for part, odd in zip((dst, src, copy), _ODD, strict=True):
        z = _mix(z ^ (np.asarray(part, dtype=np.int64).view(np.uint64) * odd))
    return z


def copy_index(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    """For each edge, how many equal (dst, src) edges come before it (0 for most)."""
    if len(dst) == 0:
        return np.empty(0, dtype=np.int64)
    order = np.lexsort((src, dst))
    d, s = dst[order], src[order]
    new = np.ones(len(d), dtype=bool)
    new[1:] = (d[1:] != d[:-1]) | (s[1:] != s[:-1])
    starts = np.flatnonzero(new)
    run_start = np.repeat(starts, np.diff(np.append(starts, len(d))))
    out = np.empty(len(d), dtype=np.int64)
    out[order] = np.arange(len(d)) - run_start
    return out


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


def request_edges_into(frontier: np.ndarray, qsrc: np.ndarray, qdst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dst, src) of the request's edges into frontier nodes (qdst sorted, as
    embeddings.newnodes.query_edges gives them)."""
    lo = np.searchsorted(qdst, frontier, side="left")
    counts = np.searchsorted(qdst, frontier, side="right") - lo
    total = int(counts.sum())
    if total == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    first = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    at = first + np.arange(total)
    return qdst[at], qsrc[at]


def candidate_edges(frontier: np.ndarray, num_nodes: int, in_rows, qsrc: np.ndarray,
                    qdst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, src, copy) of every candidate in-edge of the frontier: stored in-edges from
    in_rows(existing nodes) -> (lengths, sources), then the given request edges."""
    existing = frontier[frontier < num_nodes]
    lens, g_src = in_rows(existing)
    g_dst = np.repeat(existing, lens)
    q_dst, q_src = request_edges_into(frontier, qsrc, qdst)
    dst = np.concatenate([g_dst, q_dst]).astype(np.int64)
    src = np.concatenate([np.asarray(g_src, dtype=np.int64), q_src]).astype(np.int64)
    copy = np.concatenate([copy_index(g_dst, np.asarray(g_src, dtype=np.int64)),
                           np.full(len(q_dst), QUERY_COPY, dtype=np.int64)])
    return dst, src, copy


def keep_smallest(dst, src, copy, seed: int, fanout: int):
    """The (dst, src, copy) edges each target keeps: bottom_k by edge_keys."""
    keep = bottom_k(dst, src, copy, edge_keys(seed, dst, src, copy), fanout)
    return dst[keep], src[keep], copy[keep]


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
    ids) of the edges kept into the frontier, grouped by target in ascending id."""
    nodes = np.asarray(seeds, dtype=np.int64)
    if len(np.unique(nodes)) != len(nodes):
        raise ValueError("seeds of a keyed sample must be distinct")
    known = np.sort(nodes)
    srcs, dsts = [], []
    nodes_per_hop, edges_per_hop = [len(nodes)], []
    lo = 0
    for fanout in fanouts:
        frontier = nodes[lo:]
        dst_ids, src_ids = choose(frontier, int(fanout))
        # kept edges in frontier order (targets by position, then key)
        f_sorted = np.argsort(frontier, kind="stable")
        dst_local = f_sorted[np.searchsorted(frontier[f_sorted], dst_ids)] + lo
        order = np.argsort(dst_local, kind="stable")
        dst_local, src_ids = dst_local[order], src_ids[order]
        at = np.minimum(np.searchsorted(known, src_ids), max(len(known) - 1, 0))
        seen = known[at] == src_ids if len(known) else np.zeros(len(src_ids), dtype=bool)
        fresh, first = np.unique(src_ids[~seen], return_index=True)
        fresh = fresh[np.argsort(first, kind="stable")]  # in order of first appearance
        start = len(nodes)
        nodes = np.concatenate([nodes, fresh])
        known_order = np.argsort(nodes, kind="stable")
        known, known_pos = nodes[known_order], known_order
        src_local = known_pos[np.searchsorted(known, src_ids)]
        srcs.append(src_local)
        dsts.append(dst_local)
        nodes_per_hop.append(len(fresh))
        edges_per_hop.append(len(src_ids))
        lo = start
    empty = np.empty(0, dtype=np.int64)
    return KeyedSample(nodes, np.concatenate(srcs) if srcs else empty, np.concatenate(dsts) if dsts else empty,
                       np.array(nodes_per_hop, dtype=np.int64), np.array(edges_per_hop, dtype=np.int64))
