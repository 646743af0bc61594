import numpy as np
import pytest
import torch
from torch_geometric.nn import SAGEConv

from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler
from tests.support.graphs import make_graph


class TorchOnCPU:
    """The GPU sampler's code on CPU tensors, returning the numpy contract."""

    def __init__(self, graph, fanouts, seed=0):
        self.inner = TorchSampler.from_graph(graph, fanouts, seed=seed)

    def sample(self, seeds):
        return self.inner.sample(seeds).to_numpy()


SAMPLERS = pytest.mark.parametrize("make_sampler", [CPUSampler, TorchOnCPU], ids=["numba", "torch"])


def neighbours(graph, u):
    return set(np.asarray(graph.indices)[graph.indptr[u]:graph.indptr[u + 1]].tolist())


@SAMPLERS
def test_structure_fanouts_and_no_repeats(make_sampler, skewed_graph):
    sampler = make_sampler(skewed_graph, (4, 3), seed=1)
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
            for t, c in zip(targets, counts, strict=True):
                u = ids[t]
                got = ids[src[sel][dst[sel] == t]]
                assert c == min(len(neighbours(skewed_graph, u)), fanout)
                assert len(set(got.tolist())) == c  # never repeats a neighbour
                assert set(got.tolist()) <= neighbours(skewed_graph, u)


@SAMPLERS
def test_uniform_inclusion_probabilities(make_sampler, tmp_path):
    graph = make_graph(tmp_path / "star", [(0, j) for j in range(1, 21)], 21)
    sampler = make_sampler(graph, (5,), seed=7)
    trials = 20000 if make_sampler is CPUSampler else 5000  # the torch one is slower per call on CPU
    counts = np.zeros(21)
    for _ in range(trials):
        sub = sampler.sample(np.array([0]))
        counts[sub.node_ids[1:]] += 1
    expected = trials * 5 / 20
    sd = np.sqrt(trials * 0.25 * 0.75)
    assert np.all(np.abs(counts[1:] - expected) < 5 * sd)
    chi2 = (((counts[1:] - expected) ** 2) / expected).sum()
    assert chi2 < 60  # 19 dof: p < 1e-5 beyond this


@SAMPLERS
def test_reproducible_with_seed(make_sampler, skewed_graph):
    a, b = make_sampler(skewed_graph, (3, 2), seed=11), make_sampler(skewed_graph, (3, 2), seed=11)
    c = make_sampler(skewed_graph, (3, 2), seed=12)
    seeds = np.arange(20)
    sa, sb, sc = a.sample(seeds), b.sample(seeds), c.sample(seeds)
    assert np.array_equal(sa.node_ids, sb.node_ids) and np.array_equal(sa.edge_index, sb.edge_index)
    assert not (np.array_equal(sa.node_ids, sc.node_ids) and np.array_equal(sa.edge_index, sc.edge_index))


@SAMPLERS
def test_isolated_seed_and_errors(make_sampler, skewed_graph):
    sampler = make_sampler(skewed_graph, (3, 2))
    sub = sampler.sample(np.array([59]))
    assert sub.node_ids.tolist() == [59] and sub.num_edges == 0
    with pytest.raises(ValueError, match="lie in"):
        sampler.sample(np.array([60]))
    with pytest.raises(ValueError, match="1-D"):
        sampler.sample(np.zeros((2, 2), dtype=np.int64))


@SAMPLERS
def test_pyg_conv_consumes_the_sample(make_sampler, skewed_graph):
    sub = make_sampler(skewed_graph, (4, 3)).sample(np.array([0, 1, 2]))
    x = torch.from_numpy(np.asarray(skewed_graph.features)[sub.node_ids])
    out = SAGEConv(x.shape[1], 8)(x, torch.from_numpy(sub.edge_index))
    assert out.shape == (sub.num_nodes, 8)


@SAMPLERS
def test_threads_sample_in_parallel_safely(make_sampler, skewed_graph):
    from concurrent.futures import ThreadPoolExecutor

    samplers = [make_sampler(skewed_graph, (4, 3), seed=i) for i in range(4)]

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


@pytest.mark.parametrize("huge", [10**10, 10**12])
def test_an_every_neighbour_fanout_samples_every_neighbour_without_allocating_the_fanout(skewed_graph, huge):
    """The compiled sampler sized its scratch by the largest fanout: a model saved with
    fanouts of 10**10 ("take every neighbour") failed every batch with a MemoryError."""
    seeds = np.arange(12)
    want = CPUSampler(skewed_graph, (1000, 1000)).sample(seeds)  # above every degree: every neighbour
    got = CPUSampler(skewed_graph, (huge, huge)).sample(seeds)
    np.testing.assert_array_equal(got.node_ids, want.node_ids)
    np.testing.assert_array_equal(got.edge_index, want.edge_index)
    overlay = (np.array([0]), np.array([0, 2]), np.array([1, 2]))
    want = CPUSampler(skewed_graph, (1000, 1000)).sample(seeds, overlay=overlay)
    got = CPUSampler(skewed_graph, (huge, huge)).sample(seeds, overlay=overlay)
    np.testing.assert_array_equal(got.node_ids, want.node_ids)


def test_a_fanout_past_int64_is_one_value_error():
    from hybridgnn.config import parse_fanouts

    with pytest.raises(ValueError, match="below 2\\*\\*63"):  # an OverflowError in the sampler
        parse_fanouts([10**30])


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


def test_torch_sampler_matches_the_compiled_sampler_in_distribution(tmp_path):
    # Node 0 reads 1..30 and every node reads a few of the rest: per-neighbour inclusion
    # frequencies at both hops must agree between the two samplers.
    rng = np.random.default_rng(5)
    edges = [(0, j) for j in range(1, 31)] + [(i, int(j)) for i in range(1, 31) for j in rng.choice(31, 6, replace=False)]
    graph = make_graph(tmp_path / "g", edges, 31)
    trials = 4000
    freq = {}
    for name, sampler in (("numba", CPUSampler(graph, (7, 3), seed=1)), ("torch", TorchOnCPU(graph, (7, 3), seed=1))):
        counts = np.zeros((2, 31))
        for _ in range(trials):
            sub = sampler.sample(np.array([0]))
            hop = np.repeat([0, 1], sub.num_sampled_edges)
            np.add.at(counts, (hop, sub.node_ids[sub.edge_index[0]]), 1)
        freq[name] = counts / trials
    assert np.abs(freq["numba"][0] - 7 / 30)[1:].max() < 0.05
    # Two independent estimates of the same probabilities: differences stay within noise.
    sd = np.sqrt(2 * np.maximum(freq["numba"], 1e-3) / trials)
    assert np.all(np.abs(freq["numba"] - freq["torch"]) < 5 * sd + 1e-9)


def test_floyd_positions_are_distinct_and_in_range():
    from hybridgnn.sampling.gpu import floyd_positions

    g = torch.Generator().manual_seed(0)
    degrees = torch.tensor([5, 6, 50, 1_000_000, 2**40])
    pos = floyd_positions(degrees, 5, g)
    assert pos.shape == (5, 5)
    assert all(len(set(row.tolist())) == 5 for row in pos)
    assert bool((pos >= 0).all()) and bool((pos < degrees.unsqueeze(1)).all())
    assert sorted(pos[0].tolist()) == [0, 1, 2, 3, 4]  # degree == fanout takes everything


def test_read_only_seeds_run_the_kernels_compiled_for_writable_ones(skewed_graph):
    """A worker process receives each batch's seeds as np.frombuffer (read-only), and numba
    compiled the sampler again for that array type on the first batch: 1 s on the demo,
    after the worker had warmed up on a writable array."""
    from hybridgnn.sampling.cpu import sample_khop, sample_khop_overlay

    sampler = CPUSampler(skewed_graph, (3, 2))
    sampler.sample(np.zeros(1, np.int64))
    overlay = (np.array([0]), np.array([0, 1]), np.array([1]))
    sampler.sample(np.zeros(1, np.int64), overlay=overlay)
    compiled = len(sample_khop.signatures), len(sample_khop_overlay.signatures)
    read_only = np.frombuffer(np.arange(3, dtype=np.int64).tobytes(), dtype=np.int64)
    assert sampler.sample(read_only).seed_index.size == 3
    sampler.sample(read_only, overlay=overlay)
    assert (len(sample_khop.signatures), len(sample_khop_overlay.signatures)) == compiled
