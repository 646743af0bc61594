"""Keyed neighbour sampling: a uniform draw that any split of the candidates reproduces."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.sampling.keyed import (
    QUERY_COPY,
    draw,
    edge_keys,
    keep_smallest,
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


def _rows_of(dst, src, n):
    """in_rows over the edges (dst, src) among n nodes, each row in a scrambled order."""
    order = np.lexsort((-src, dst))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))])
    return _csr_rows(indptr, src[order])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), max_size=120),
       st.lists(st.tuples(st.integers(0, 6), st.integers(31, 34)), max_size=12, unique=True),
       st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**63))
def test_each_part_keeping_its_smallest_then_the_smallest_of_those_is_the_global_draw(edges, request, parts, k, seed):
    # Parts hold edges by source (as partition ranks do), so every copy of an edge is in one part.
    n = 31  # ids 31.. are a request's new nodes: their edges come as request edges
    dst = np.array([d for d, _ in edges], dtype=np.int64)
    src = np.array([s for _, s in edges], dtype=np.int64)
    req = sorted(request)
    qdst = np.array([d for d, _ in req], dtype=np.int64)
    qsrc = np.array([s for _, s in req], dtype=np.int64)
    frontier = np.array([4, 0, 6, 2, 1, 5, 3])
    whole = draw(frontier, n, _rows_of(dst, src, n), qsrc, qdst, seed, k)
    want = np.minimum(np.bincount(dst, minlength=7) + np.bincount(qdst, minlength=7), k)
    assert (np.bincount(whole[0], minlength=7) == want).all()  # k each, all when fewer
    position = np.empty(7, np.int64)
    position[frontier] = np.arange(7)
    assert (np.diff(position[whole[0]]) >= 0).all()  # grouped in frontier order
    kept = []
    for p in range(parts):
        mine, qmine = src % parts == p, qsrc % parts == p
        kept.append(np.stack(draw(frontier, n, _rows_of(dst[mine], src[mine], n), qsrc[qmine], qdst[qmine], seed, k)))
    merged = np.concatenate(kept, axis=1)
    again = keep_smallest(merged[0], merged[1], merged[2], seed, k)
    assert _as_set(*again) == _as_set(*whole)
    for v in range(7):  # within a target, by key: the same order both ways
        np.testing.assert_array_equal(whole[1][whole[0] == v], again[1][again[0] == v])


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


def test_request_edges_are_separate_candidates_and_parallel_edges_are_one_edge():
    # node 0 reads 1 twice (a multigraph) and a request edge from new node 3 (n = 3)
    indptr, indices = np.array([0, 2, 2, 2]), np.array([1, 1])
    qsrc, qdst = np.array([3, 0]), np.array([0, 3])
    got = draw(np.array([0, 3]), 3, _csr_rows(indptr, indices), qsrc, qdst, 0, 5)
    assert sorted(zip(*(a.tolist() for a in got), strict=True)) == [(0, 1, 0), (0, 1, 0), (0, 3, QUERY_COPY),
                                                                    (3, 0, QUERY_COPY)]
    one = draw(np.array([0]), 3, _csr_rows(indptr, indices), qsrc, qdst, 0, 1)
    keys = edge_keys(0, np.zeros(2, np.int64), np.array([1, 3]), np.array([0, QUERY_COPY]))
    assert one[1][0] == [1, 3][int(np.argmin(keys))]  # the smallest key wins


def test_a_huge_fanout_keeps_everything_without_a_huge_buffer():
    indptr, indices = np.array([0, 3, 3]), np.array([1, 0, 1])
    got = draw(np.array([0, 1]), 2, _csr_rows(indptr, indices), np.empty(0, np.int64), np.empty(0, np.int64), 0,
               1 << 40)
    assert sorted(got[1].tolist()) == [0, 1, 1]


def _choose_all(indptr, indices, seed=0):
    rows = _csr_rows(indptr, indices)
    empty = np.empty(0, np.int64)

    def choose(frontier, fanout):
        return draw(frontier, len(indptr) - 1, rows, empty, empty, seed, fanout)[:2]
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
