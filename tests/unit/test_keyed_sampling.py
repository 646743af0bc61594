"""Keyed neighbour sampling: a uniform draw that any split of the candidates reproduces."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.sampling.keyed import (
    QUERY_COPY,
    bottom_k,
    candidate_edges,
    copy_index,
    edge_keys,
    keep_smallest,
    request_edges_into,
    sample_keyed,
)


def _csr_rows(indptr, indices):
    def in_rows(nodes):
        lens = indptr[nodes + 1] - indptr[nodes]
        vals = np.concatenate([indices[indptr[v]:indptr[v + 1]] for v in nodes]) if len(nodes) else indices[:0]
        return lens, vals
    return in_rows


def _as_set(dst, src, copy):
    return set(zip(dst.tolist(), src.tolist(), copy.tolist(), strict=True))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), max_size=120), st.integers(1, 4),
       st.integers(1, 5), st.integers(0, 2**63))
def test_each_part_keeping_its_smallest_then_the_smallest_of_those_is_the_global_draw(edges, parts, k, seed):
    # Parts hold edges by source (as partition ranks do), so every copy of an edge is in one part.
    dst = np.array([d for d, _ in edges], dtype=np.int64)
    src = np.array([s for _, s in edges], dtype=np.int64)
    whole = keep_smallest(dst, src, copy_index(dst, src), seed, k)
    kept = []
    for p in range(parts):
        mine = src % parts == p
        kept.append(np.stack(keep_smallest(dst[mine], src[mine], copy_index(dst[mine], src[mine]), seed, k)))
    merged = np.concatenate(kept, axis=1) if kept else np.empty((3, 0), np.int64)
    again = keep_smallest(merged[0], merged[1], merged[2], seed, k)
    assert _as_set(*again) == _as_set(*whole)
    counts = np.bincount(whole[0], minlength=7)
    assert (counts == np.minimum(np.bincount(dst, minlength=7), k)).all()  # all when few, else k
    assert (np.diff(whole[0]) >= 0).all()  # grouped by target


def test_the_draw_is_a_uniform_subset():
    # 6 candidates, keep 2: each of the 15 pairs about equally often over seeds.
    dst, src = np.zeros(6, np.int64), np.arange(10, 16, dtype=np.int64)
    copy = np.zeros(6, np.int64)
    seen = {pair: 0 for pair in itertools.combinations(range(10, 16), 2)}
    for seed in range(6000):
        _, s, _ = keep_smallest(dst, src, copy, seed, 2)
        seen[tuple(sorted(s.tolist()))] += 1
    counts = np.array(list(seen.values()))
    assert counts.min() > 300 and counts.max() < 500, counts  # 400 each expected, sd ~19


def test_keys_depend_on_every_field_and_the_seed():
    base = edge_keys(0, np.array([1]), np.array([2]), np.array([0]))
    for other in (edge_keys(1, np.array([1]), np.array([2]), np.array([0])),
                  edge_keys(0, np.array([2]), np.array([1]), np.array([0])),
                  edge_keys(0, np.array([1]), np.array([2]), np.array([1]))):
        assert other[0] != base[0]
    assert edge_keys(5, np.array([7, 7]), np.array([3, 3]), np.array([0, 0]))[0] == \
        edge_keys(5, np.array([7]), np.array([3]), np.array([0]))[0]


def test_parallel_edges_and_request_edges_are_separate_candidates():
    # node 0 reads 1 twice (a multigraph) and a request edge from new node 3 (n = 3)
    indptr, indices = np.array([0, 2, 2, 2]), np.array([1, 1])
    qsrc, qdst = np.array([3, 0]), np.array([0, 3])
    dst, src, copy = candidate_edges(np.array([0, 3]), 3, _csr_rows(indptr, indices), qsrc, qdst)
    assert _as_set(dst, src, copy) == {(0, 1, 0), (0, 1, 1), (0, 3, QUERY_COPY), (3, 0, QUERY_COPY)}
    assert (bottom_k(dst, src, copy, edge_keys(0, dst, src, copy), 5) >= 0).sum() == 4


def test_request_edges_into_a_frontier_in_any_order():
    qsrc, qdst = np.array([9, 8, 7, 9]), np.array([1, 1, 4, 5])  # sorted by target
    dst, src = request_edges_into(np.array([5, 2, 1]), qsrc, qdst)
    assert sorted(zip(dst.tolist(), src.tolist(), strict=True)) == [(1, 8), (1, 9), (5, 9)]
    assert len(request_edges_into(np.array([0]), qsrc, qdst)[0]) == 0


def _choose_all(indptr, indices, seed=0):
    rows = _csr_rows(indptr, indices)
    empty = np.empty(0, np.int64)

    def choose(frontier, fanout):
        dst, src, _ = keep_smallest(*candidate_edges(frontier, len(indptr) - 1, rows, empty, empty), seed, fanout)
        return dst, src
    return choose


def test_a_sample_lists_seeds_then_each_hops_new_nodes_with_edges_in_hop_order():
    # in-rows: 0 <- 1, 2; 1 <- 3; 2 <- 3, 0; 3 <- 4; 4 <- none
    indptr, indices = np.array([0, 2, 3, 5, 6, 6]), np.array([1, 2, 3, 3, 0, 4])
    s = sample_keyed(np.array([0]), (5, 5, 5), _choose_all(indptr, indices))
    assert s.nodes[0] == 0 and sorted(s.nodes[1:3].tolist()) == [1, 2] and s.nodes[3] == 3 and s.nodes[4] == 4
    assert s.nodes_per_hop.tolist() == [1, 2, 1, 1] and s.edges_per_hop.tolist() == [2, 3, 1]
    edges = {(int(s.nodes[a]), int(s.nodes[b])) for a, b in zip(s.src, s.dst, strict=True)}
    assert edges == {(1, 0), (2, 0), (3, 1), (3, 2), (0, 2), (4, 3)}
    assert s.within(1) == 3 and s.edges_within(2) == 5
    # every edge of hop h goes into a node reached at hop h - 1
    hop_of_edge = np.repeat(np.arange(3), s.edges_per_hop)
    first = np.concatenate([[0], np.cumsum(s.nodes_per_hop)])
    assert ((s.dst >= first[hop_of_edge]) & (s.dst < first[hop_of_edge + 1])).all()


def test_fanouts_bound_each_targets_draw():
    rng = np.random.default_rng(0)
    n = 50
    dst = rng.integers(0, n, 600)
    src = rng.integers(0, n, 600)
    order = np.argsort(dst, kind="stable")
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))])
    s = sample_keyed(np.array([3, 7]), (4, 2), _choose_all(indptr, src[order]))
    hop1 = np.bincount(s.dst[: s.edges_per_hop[0]], minlength=2)
    assert (hop1 == np.minimum(np.diff(indptr)[[3, 7]], 4)).all()
    assert (np.bincount(s.dst[s.edges_per_hop[0]:]) <= 2).all()
    assert len(np.unique(s.nodes)) == len(s.nodes)


def test_seeds_must_be_distinct():
    with pytest.raises(ValueError, match="distinct"):
        sample_keyed(np.array([1, 1]), (2,), _choose_all(np.array([0, 0, 0]), np.array([], np.int64)))
