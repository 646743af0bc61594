import numpy as np
import pytest
import torch
from torch_geometric.nn import SAGEConv

from hybridgnn.sampling.cpu import CPUSampler
from tests.conftest import make_graph


def neighbours(graph, u):
    return set(np.asarray(graph.indices)[graph.indptr[u]:graph.indptr[u + 1]].tolist())


def test_structure_fanouts_and_no_repeats(skewed_graph):
    sampler = CPUSampler(skewed_graph, (4, 3), seed=1)
    seeds = np.array([0, 5, 5, 59, 12])
    for _ in range(50):
        sub = sampler.sample(seeds)
        ids, (src, dst) = sub.node_ids, sub.edge_index
        assert len(set(ids.tolist())) == len(ids)  # unique
        assert sub.num_sampled_nodes.sum() == len(ids) and sub.num_sampled_edges.sum() == src.size
        assert ids[sub.seed_index].tolist() == seeds.tolist()
        assert sub.num_sampled_nodes[0] == 4  # duplicated seed counted once
        hop_of_edge = np.repeat(np.arange(2), sub.num_sampled_edges)
        for hop, fanout in enumerate((4, 3)):
            sel = hop_of_edge == hop
            targets, counts = np.unique(dst[sel], return_counts=True)
            lo = sub.num_sampled_nodes[:hop].sum()
            assert np.all((targets >= lo) & (targets < lo + sub.num_sampled_nodes[hop]))
            for t, c in zip(targets, counts):
                u = ids[t]
                got = ids[src[sel][dst[sel] == t]]
                assert c == min(len(neighbours(skewed_graph, u)), fanout)
                assert len(set(got.tolist())) == c  # never repeats a neighbour
                assert set(got.tolist()) <= neighbours(skewed_graph, u)


def test_uniform_inclusion_probabilities(tmp_path):
    graph = make_graph(tmp_path / "star", [(0, j) for j in range(1, 21)], 21)
    sampler = CPUSampler(graph, (5,), seed=7)
    trials = 20000
    counts = np.zeros(21)
    for _ in range(trials):
        sub = sampler.sample(np.array([0]))
        counts[sub.node_ids[1:]] += 1
    expected = trials * 5 / 20
    sd = np.sqrt(trials * 0.25 * 0.75)
    assert np.all(np.abs(counts[1:] - expected) < 5 * sd)
    chi2 = (((counts[1:] - expected) ** 2) / expected).sum()
    assert chi2 < 60  # 19 dof: p < 1e-5 beyond this


def test_reproducible_with_seed(skewed_graph):
    a, b = CPUSampler(skewed_graph, (3, 2), seed=11), CPUSampler(skewed_graph, (3, 2), seed=11)
    c = CPUSampler(skewed_graph, (3, 2), seed=12)
    seeds = np.arange(20)
    sa, sb, sc = a.sample(seeds), b.sample(seeds), c.sample(seeds)
    assert np.array_equal(sa.node_ids, sb.node_ids) and np.array_equal(sa.edge_index, sb.edge_index)
    assert not (np.array_equal(sa.node_ids, sc.node_ids) and np.array_equal(sa.edge_index, sc.edge_index))


def test_isolated_seed_and_errors(skewed_graph):
    sampler = CPUSampler(skewed_graph, (3, 2))
    sub = sampler.sample(np.array([59]))
    assert sub.node_ids.tolist() == [59] and sub.num_edges == 0
    with pytest.raises(ValueError, match="lie in"):
        sampler.sample(np.array([60]))
    with pytest.raises(ValueError, match="1-D"):
        sampler.sample(np.zeros((2, 2), dtype=np.int64))


def test_pyg_conv_consumes_the_sample(skewed_graph):
    sub = CPUSampler(skewed_graph, (4, 3)).sample(np.array([0, 1, 2]))
    x = torch.from_numpy(np.asarray(skewed_graph.features)[sub.node_ids])
    out = SAGEConv(x.shape[1], 8)(x, torch.from_numpy(sub.edge_index))
    assert out.shape == (sub.num_nodes, 8)


def test_threads_sample_in_parallel_safely(skewed_graph):
    from concurrent.futures import ThreadPoolExecutor

    samplers = [CPUSampler(skewed_graph, (4, 3), seed=i) for i in range(4)]

    def work(s):
        return [s.sample(np.arange(30)).num_nodes for _ in range(200)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, samplers))
    assert all(len(r) == 200 for r in results)


def test_overlay_candidates_are_drawn_uniformly_with_stored_ones(tmp_path):
    # Node 0 has stored neighbours 1..10; the overlay gives it new nodes 11..20 (ids past the
    # stored graph) and gives new node 11 one neighbour, 3.
    graph = make_graph(tmp_path / "star", [(0, j) for j in range(1, 11)], 11)
    overlay = (np.array([0, 11]), np.array([0, 10, 11]), np.concatenate([np.arange(11, 21), [3]]))
    sampler = CPUSampler(graph, (5, 1), seed=3)
    counts = np.zeros(21)
    trials = 8000
    for _ in range(trials):
        sub = sampler.sample(np.array([0]), overlay=overlay, num_extra_nodes=10)
        first_hop = sub.node_ids[1:1 + sub.num_sampled_nodes[1]]
        counts[first_hop] += 1
        assert len(set(first_hop.tolist())) == 5
    sd = np.sqrt(trials * 0.25 * 0.75)
    assert np.all(np.abs(counts[1:] - trials * 0.25) < 5 * sd)
    sub = sampler.sample(np.array([11]), overlay=overlay, num_extra_nodes=10)
    assert sub.node_ids.tolist() == [11, 3]
    with pytest.raises(ValueError, match="lie in"):
        sampler.sample(np.array([21]), overlay=overlay, num_extra_nodes=10)


def test_dynamic_graph_is_sampled_as_it_is_now(tmp_path):
    from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch

    graph = make_graph(tmp_path / "star", [(0, j) for j in range(1, 21)] + [(1, 2)], 25)
    dyn = DynamicGraph(graph)
    sampler = CPUSampler(dyn, (5, 3), seed=3)
    # Node 0 (reads 1..20) loses 1..10 and gains 21..24 and a new node 25, which reads 2.
    with dyn.lock.write():
        dyn.apply(UpdateBatch(remove_edges=np.array([[j, 0] for j in range(1, 11)]),
                              add_edges=np.array([[j, 0] for j in range(21, 25)] + [[25, 0], [2, 25]]),
                              add_node_features=np.zeros((1, graph.feature_dim), np.float32)))
    now = set(range(11, 26))
    counts = np.zeros(26)
    trials = 6000
    for _ in range(trials):
        with dyn.lock.read():
            sub = sampler.sample(np.array([0]))
        hop1 = sub.node_ids[1:1 + sub.num_sampled_nodes[1]]
        assert len(hop1) == 5 and set(hop1.tolist()) <= now
        counts[hop1] += 1
        if 25 in hop1:  # the new node's own (patched) row is sampled at hop 2
            hop2 = sub.node_ids[sub.num_sampled_nodes[:2].sum():]
            assert 2 in hop2.tolist() or 2 in hop1.tolist()
    expected = trials * 5 / 15
    chi2 = (((counts[sorted(now)] - expected) ** 2) / expected).sum()
    assert chi2 < 50  # 14 dof: uniform over the current neighbours
    with dyn.lock.read():
        assert sampler.sample(np.array([25])).node_ids.tolist()[:2] == [25, 2]
