"""A partition rank's share of a served graph: edges placed with their source, seen
from both ends; together the ranks hold every edge exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from hybridgnn.distributed import serving_part
from hybridgnn.distributed.partition import Partition, range_bounds
from hybridgnn.distributed.serving_part import open_serving_part
from tests.support.graphs import make_graph, skewed_edges


@pytest.mark.parametrize("kind", ["ranges", "owner"])
def test_ranks_hold_every_edge_once_from_both_ends(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(serving_part, "SCAN_EDGES", 17)  # many scan steps on a small graph
    edges = skewed_edges(50, seed=2) + [(4, 4), (9, 9)]
    graph = make_graph(tmp_path / "g", edges, 50)
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    if kind == "ranges":
        partition = Partition("ranges", 3, bounds=range_bounds(indptr, 3))
    else:
        partition = Partition("metis", 3, owner=np.random.default_rng(0).integers(0, 3, 50))
    parts = [open_serving_part(graph, partition, r, [np.asarray(graph.features) * 2]) for r in range(3)]
    everyone = np.arange(50)
    for v in range(50):
        expected = np.sort(indices[indptr[v]:indptr[v + 1]])
        got = np.sort(np.concatenate([p.local_in(np.array([v]))[1] for p in parts]))
        assert np.array_equal(got, expected)
    readers = {v: sorted(np.flatnonzero([v in indices[indptr[t]:indptr[t + 1]] for t in range(50)]))
               for v in range(50)}
    for p in parts:
        lens, targets = p.local_out(everyone)
        own = partition.owner_of(everyone) == p.rank
        assert np.all(lens[~own] == 0)
        starts = np.concatenate([[0], np.cumsum(lens)])
        for v in np.flatnonzero(own):
            assert sorted(targets[starts[v]:starts[v + 1]]) == readers[v]
        pos = p.position(p.nodes)
        assert np.array_equal(p.in_degree[pos], np.diff(indptr)[p.nodes])
        loops = {v for v in p.nodes.tolist() if v in indices[indptr[v]:indptr[v + 1]]}
        assert set(p.nodes[p.has_loop].tolist()) == loops
        assert np.allclose(p.rows(1, p.nodes).numpy(), 2 * np.asarray(graph.features)[p.nodes])
    assert sum(len(p.in_rows.values) for p in parts) == len(indices)
    assert sum(p.memory_bytes() for p in parts) > 0


def test_a_node_without_local_edges_has_an_empty_row(tmp_path):
    graph = make_graph(tmp_path / "g", [(0, 1), (1, 2)], 4)  # row 1 lists 2: the edge 2 -> 1
    partition = Partition("ranges", 2, bounds=np.array([0, 2, 4]))
    part = open_serving_part(graph, partition, 1, None)
    lens, sources = part.local_in(np.array([3, 0, 1]))
    assert lens.tolist() == [0, 0, 1] and sources.tolist() == [2]
    assert part.local_out(np.array([0, 2, 3]))[0].tolist() == [0, 1, 0]
