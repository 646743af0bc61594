"""Node partitions, one rank's renumbered rows, and the grouping of targets by halo chunk."""

import numpy as np
import pytest

from hybridgnn.distributed.halo import target_groups
from hybridgnn.distributed.partition import (
    Partition,
    compute_partition,
    local_part,
    metis_available,
    range_bounds,
    resolve_method,
)
from hybridgnn.errors import ConfigError


def _partitions(graph, parts):
    found = [Partition("ranges", parts, bounds=range_bounds(np.asarray(graph.indptr), parts))]
    rng = np.random.default_rng(parts)
    found.append(Partition("random", parts, owner=rng.permutation(np.arange(graph.num_nodes) % parts).astype(np.int32)))
    return found


def test_ranges_split_edges_evenly_and_cover_every_node(skewed_graph):
    for parts in (1, 2, 3, 7):
        bounds = range_bounds(np.asarray(skewed_graph.indptr), parts)
        assert bounds[0] == 0 and bounds[-1] == skewed_graph.num_nodes and np.all(np.diff(bounds) > 0)
    bounds = range_bounds(np.asarray(skewed_graph.indptr), 2)
    edges = np.diff(np.asarray(skewed_graph.indptr)[bounds])
    assert abs(int(edges[0]) - int(edges[1])) <= skewed_graph.indptr[-1] * 0.6  # the hub row is one unit


def test_ranges_refuse_more_parts_than_nodes():
    with pytest.raises(ConfigError, match="cannot split 3 nodes into 4"):
        range_bounds(np.array([0, 1, 2, 3]), 4)


def test_an_edgeless_graph_is_split_by_nodes():
    assert range_bounds(np.zeros(11, dtype=np.int64), 3).tolist() == [0, 3, 6, 10]


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_local_parts_renumber_every_in_edge_and_group_the_halo_by_owner(skewed_graph, parts):
    indptr, indices = np.asarray(skewed_graph.indptr), np.asarray(skewed_graph.indices)
    for partition in _partitions(skewed_graph, parts):
        seen = np.zeros(skewed_graph.num_nodes, dtype=int)
        cut = 0
        for rank in range(parts):
            part = local_part(skewed_graph, partition, rank)
            seen[part.nodes] += 1
            assert np.all(partition.owner_of(part.nodes) == rank) and np.all(np.diff(part.nodes) > 0)
            ids = np.concatenate([part.nodes, part.halo])  # local id -> global id
            for i, node in enumerate(part.nodes):
                row = indices[indptr[node]:indptr[node + 1]]
                got = ids[part.indices[part.indptr[i]:part.indptr[i + 1]]]
                assert got.tolist() == row.tolist()  # same neighbours, same order
                assert part.has_loop[i] == (node in row)
            owners = partition.owner_of(part.halo)
            assert np.all(owners != rank) and np.all(np.diff(owners) >= 0)
            assert part.halo_counts.tolist() == np.bincount(owners, minlength=parts).tolist()
            assert len(np.unique(part.halo)) == len(part.halo)
            cut += part.remote_edges
        assert np.all(seen == 1)  # every node has exactly one owner
        rows = np.repeat(np.arange(skewed_graph.num_nodes), np.diff(indptr))
        assert cut == int((partition.owner_of(rows) != partition.owner_of(indices.astype(np.int64))).sum())


def test_targets_are_grouped_by_the_last_halo_chunk_they_need(skewed_graph):
    partition = Partition("ranges", 3, bounds=range_bounds(np.asarray(skewed_graph.indptr), 3))
    part = local_part(skewed_graph, partition, 1)
    h, n = len(part.halo), part.num_nodes
    chunks = [(lo, min(h, lo + 3)) for lo in range(0, h, 3)]
    groups = target_groups(part, chunks)
    assert len(groups) == len(chunks) + 1
    assert sorted(np.concatenate(groups).tolist()) == list(range(n))
    for g, targets in enumerate(groups):
        for t in targets:
            cols = part.indices[part.indptr[t]:part.indptr[t + 1]]
            halo = cols[cols >= n] - n
            need = max((j for j, (a, b) in enumerate(chunks) for c in halo if a <= c < b), default=-1)
            assert need == g - 1


def test_resolve_method_says_what_auto_means_and_refuses_the_unknown():
    assert resolve_method("ranges") == "ranges"
    assert resolve_method("auto") == ("metis" if metis_available() else "ranges")
    with pytest.raises(ConfigError, match="must be one of"):
        resolve_method("spectral")


@pytest.mark.skipif(not metis_available(), reason="needs pymetis")
def test_metis_cuts_fewer_edges_than_ranges_and_is_cached(tmp_path):
    from hybridgnn.graph.generate import generate_csbm
    from hybridgnn.graph.store import GraphStore

    generate_csbm(tmp_path / "g", num_nodes=2000, num_classes=4, feature_dim=4, avg_degree=6, feature_signal=0.3,
                  seed=3)
    graph = GraphStore.open(tmp_path / "g")

    def cut(p):
        return sum(local_part(graph, p, r).remote_edges for r in range(4))

    metis = compute_partition(graph, "metis", 4, tmp_path)
    assert (tmp_path / "partition-metis-4.npy").is_file()
    again = compute_partition(graph, "metis", 4, tmp_path)
    assert np.array_equal(np.asarray(again.owner), np.asarray(metis.owner))
    assert cut(metis) < cut(compute_partition(graph, "ranges", 4, tmp_path))


@pytest.mark.parametrize("cached, said", [
    (np.full(60, 7, np.int64), r"names owners in \[7, 7\], not parts 0..3"),  # nodes no rank computed
    (np.full(60, -1, np.int64), r"names owners in \[-1, -1\]"),
    (np.zeros(60, np.float64), "holds float64 \\(60,\\), not an integer owner per node"),
    (b"", "does not load"),  # an EOFError traceback
    (b"\x93NUMPY\x01\x00", "does not load"),  # cut short
])
def test_a_damaged_partition_file_is_computed_again_or_refused_by_the_ranks_that_read_it(
        skewed_graph, tmp_path, monkeypatch, caplog, cached, said):
    from hybridgnn.distributed import partition
    from hybridgnn.distributed.partition import load_partition, partition_file

    monkeypatch.setattr(partition, "metis_parts", lambda indptr, indices, parts: np.arange(len(indptr) - 1) % parts)
    path = partition_file(tmp_path, "metis", 4)
    if isinstance(cached, bytes):
        path.write_bytes(cached)
    else:
        np.save(path, cached)
    with pytest.raises(ConfigError, match=f"partition file {path} {said}"):
        load_partition("metis", 4, tmp_path, skewed_graph)
    made = compute_partition(skewed_graph, "metis", 4, tmp_path)
    assert np.array_equal(np.asarray(made.owner), np.arange(60) % 4) and said.split(" ")[0] in caplog.text
    assert np.array_equal(np.asarray(load_partition("metis", 4, tmp_path, skewed_graph).owner), np.arange(60) % 4)
