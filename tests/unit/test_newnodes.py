import numpy as np
import pytest
import torch

from hybridgnn.embeddings.newnodes import NewNodeEvaluator, layer_sets, select_recompute
from hybridgnn.embeddings.precompute import precompute
from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.store import GraphStore, write_dataset
from hybridgnn.models.gnn import GNN, ModelSpec
from tests.support.graphs import four_in_edges_graph_and_sage, make_graph, skewed_edges
from tests.support.reference import full_graph_forward

N, Q = 60, 4


def query(seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((Q, 4), dtype=np.float32)
    edges = [(N + i, int(j)) for i in range(Q) for j in rng.choice(N - 3, size=3, replace=False)]
    edges += [(N, N + 1), (N + 2, N + 3)]
    return feats, np.array(edges, dtype=np.int64).T


def augmented(tmp_path, base: GraphStore, feats, ei):
    """The graph with the query nodes and edges (both directions) added for real."""
    indptr, indices = np.asarray(base.indptr), np.asarray(base.indices)
    rows = np.repeat(np.arange(base.num_nodes), np.diff(indptr))
    r = np.concatenate([rows, ei[1], ei[0]])
    c = np.concatenate([indices, ei[0], ei[1]])
    ip, ix = coo_to_csr([r], [c], base.num_nodes + len(feats), dedup=True)
    write_dataset(tmp_path / "aug", indptr=ip, indices=ix,
                  features=np.concatenate([np.asarray(base.features), feats]))
    return GraphStore.open(tmp_path / "aug")


@pytest.fixture
def setup(tmp_path):
    def make(kind, layers):
        torch.manual_seed(0)
        graph = make_graph(tmp_path / "g", skewed_edges(N, seed=3), N)
        model = GNN(ModelSpec(kind, 4, 8, 3, num_layers=layers, heads=2)).eval()
        store = precompute(graph, model, tmp_path / f"m-{kind}-{layers}", progress=False)
        feats, ei = query()
        exact = full_graph_forward(augmented(tmp_path, graph, feats, ei), model)[N:]
        return NewNodeEvaluator(graph, model, store), feats, ei, exact

    return make


@pytest.mark.parametrize("kind", ["sage", "gat", "gcn"])
@pytest.mark.parametrize("layers", [2, 3, 4, 5])
def test_full_mode_equals_adding_the_query_nodes_to_the_graph(setup, kind, layers):
    # make_graph's edges are directed (skewed_edges draws each row independently): the
    # nodes a change reaches are the readers of what changed, not the nodes it reads,
    # which deeper models expose.
    ev, feats, ei, exact = setup(kind, layers)
    got = ev.infer(feats, ei, mode="full").logits
    assert np.abs(got - exact).max() / np.abs(exact).max() <= 1e-5


@pytest.mark.parametrize("kind", ["sage", "gat"])
@pytest.mark.parametrize("layers", [2, 3])
def test_srpe_with_gamma_one_equals_full(setup, kind, layers):
    ev, feats, ei, exact = setup(kind, layers)
    res = ev.infer(feats, ei, mode="srpe", gamma=1.0)
    assert np.abs(res.logits - exact).max() / np.abs(exact).max() <= 1e-4
    pe = ev.infer(feats, ei, mode="pe")
    assert pe.recomputed == 0 and res.recomputed > 0
    assert not np.allclose(pe.logits, exact, rtol=1e-3)  # stale PEs miss the query edges


@pytest.mark.parametrize("kind", ["sage", "gat", "gcn"])
def test_srpe_with_gamma_zero_is_the_precomputed_embeddings(setup, kind):
    """γ = 0 recomputes no neighbour: the answer is mode pe's (historical embeddings)."""
    ev, feats, ei, _ = setup(kind, 3)
    none, pe = ev.infer(feats, ei, mode="srpe", gamma=0.0), ev.infer(feats, ei, mode="pe")
    assert none.recomputed == pe.recomputed == 0
    np.testing.assert_array_equal(none.logits, pe.logits)


def test_srpe_recomputes_its_neighbours_at_layers_one_to_l_minus_one():
    """R_l = Q ∪ S for l < L and R_L = Q: the last layer reads the recomputed neighbours'
    layer-(L-1) embeddings and computes only the query nodes."""
    n, q = 4, 1
    qsrc, qdst = np.array([0, 4, 4]), np.array([4, 0, 2])  # sorted by target; query node 4
    sets = layer_sets("srpe", 3, n, q, qsrc, qdst, gcn=False, gamma=1.0, policy="ratio", seed=0,
                      in_degree=lambda v: np.ones(len(v)), in_rows=None, out_rows=None)
    assert [s.tolist() for s in sets] == [[4, 0, 2], [4, 0, 2], [4]]
    pe = layer_sets("pe", 3, n, q, qsrc, qdst, gcn=False, gamma=1.0, policy="ratio", seed=0,
                    in_degree=lambda v: np.ones(len(v)), in_rows=None, out_rows=None)
    assert [s.tolist() for s in pe] == [[4], [4], [4]]


def test_gcn_srpe_residual_is_small_but_not_zero(setup):
    # GCN: query edges also change the degrees of the neighbours' own neighbours; SRPE at
    # γ=1 recomputes the neighbours but reads their neighbours' stale PEs.
    ev, feats, ei, exact = setup("gcn", 3)
    got = ev.infer(feats, ei, mode="srpe", gamma=1.0).logits
    residual = np.abs(got - exact).max() / np.abs(exact).max()
    assert residual < 0.5


def test_ratio_policy_picks_neighbours_with_most_query_edges(tmp_path):
    # Node 0 has 1 old neighbour and gets 2 query edges (ratio 2/3); node 1 has 4 old
    # neighbours and gets 1 (1/5); node 2 has 2 and gets 1 (1/3).
    edges = [(0, 5), (1, 2), (1, 3), (1, 4), (1, 5), (2, 3), (2, 4)]
    edges += [(b, a) for a, b in edges]
    graph = make_graph(tmp_path / "g", edges, 6, feature_dim=4)
    model = GNN(ModelSpec("sage", 4, 8, 3)).eval()
    ev = NewNodeEvaluator(graph, model, precompute(graph, model, tmp_path / "m", progress=False))
    ei = np.array([[6, 7, 6, 6], [0, 0, 1, 2]])
    direct = np.array([0, 1, 2])
    qsrc, qdst = np.concatenate([ei[0], ei[1]]), np.concatenate([ei[1], ei[0]])
    order = np.argsort(qdst, kind="stable")
    pick = lambda g, p="ratio": select_recompute(direct, qsrc[order], qdst[order], 6, g, p, 0,  # noqa: E731
                                                 ev.view.in_degree).tolist()
    assert pick(0.34) == [0, 2]  # ceil(0.34·3) = 2: ratios 2/3 and 1/3 beat 1/5
    assert pick(0.3) == [0]
    assert pick(0.3, "degree") == [1]
    assert pick(0.0) == [] and pick(1.0) == [0, 1, 2]
    with pytest.raises(ValueError, match="gamma"):
        pick(1.5)


@pytest.mark.parametrize("gamma, size, k", [(0.07, 100, 7), (0.14, 50, 7), (0.29, 100, 29), (0.1, 3, 1),
                                             (1e-9, 5, 1), (0.5, 0, 0)])
def test_srpe_recomputes_the_ceiling_of_gamma_times_the_direct_neighbours(gamma, size, k):
    # γ·|D| in floats can land just above a whole number (0.07 · 100 = 7.000000000000001):
    # its ceiling picked one neighbour more than ⌈γ·|D|⌉.
    direct = np.arange(size, dtype=np.int64)
    none = np.empty(0, np.int64)
    got = select_recompute(direct, none, none, size, gamma, "degree", 0, lambda v: np.ones(len(v)))
    assert len(got) == k


@pytest.mark.parametrize("kind", ["sage", "gat"])
def test_sampled_mode_with_unbounded_fanouts_equals_expanding_the_augmented_graph(setup, tmp_path, kind):
    # GCN too: the sample is weighted by the augmented graph's whole degrees.
    ev, feats, ei, exact = setup(kind, 2)
    everything = (1 << 30, 1 << 30)
    got = ev.infer(feats, ei, mode="sampled", fanouts=everything).logits
    assert np.abs(got - exact).max() / np.abs(exact).max() <= 1e-5
    small = ev.infer(feats, ei, mode="sampled", fanouts=(2, 2)).logits
    assert small.shape == got.shape and np.isfinite(small).all()
    assert not np.allclose(small, got, rtol=1e-3)  # a real draw: fewer neighbours
    again = ev.infer(feats, ei, mode="sampled", fanouts=(2, 2)).logits
    np.testing.assert_array_equal(again, small)  # keyed: the same request draws the same sample
    other = ev.infer(feats, ei, mode="sampled", fanouts=(2, 2), seed=1).logits
    assert not np.allclose(other, small, rtol=1e-3)


@pytest.mark.parametrize("kind", ["sage", "gat", "gcn"])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("edges", ["none", "self-loop only", "one isolated of two"])
def test_edgeless_query_nodes_equal_isolated_nodes_of_the_graph(setup, tmp_path, kind, layers, edges):
    # A query node without edges is an isolated node: its embedding comes from its own
    # features only, and every mode (no neighbour to read a PE of) computes it exactly.
    ev, _, _, _ = setup(kind, layers)
    feats = np.random.default_rng(7).standard_normal((2, 4), dtype=np.float32)
    ei = {"none": np.empty((2, 0), np.int64), "self-loop only": np.array([[N], [N]]),
          "one isolated of two": np.array([[N], [5]])}[edges]
    real = ei[:, ei[0] != ei[1]]  # write_dataset's graph: a self-loop is the one the layers add
    exact = full_graph_forward(augmented(tmp_path / "iso", ev.graph, feats, real), ev.model)[N:]
    for mode in ("full", "pe", "srpe"):
        got = ev.infer(feats, ei, mode=mode, gamma=0.5).logits
        assert got.shape == (2, 3) and np.isfinite(got).all()
        # the isolated query (the last) is exact in every mode; all are when none has edges
        rows = slice(1, None) if edges == "one isolated of two" else slice(None)
        np.testing.assert_allclose(got[rows], exact[rows], rtol=1e-4, atol=1e-5, err_msg=mode)
    got = ev.infer(feats, ei, mode="sampled", fanouts=(1 << 30,) * layers).logits
    np.testing.assert_allclose(got[1:], exact[1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
@pytest.mark.parametrize("layers", [2, 3])
def test_after_graph_updates_new_nodes_read_the_current_graph_and_embeddings(setup, tmp_path, kind, layers):
    from hybridgnn.embeddings.incremental import IncrementalEmbeddings
    from hybridgnn.embeddings.newnodes import DynamicGraphView
    from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch

    ev, feats, ei, _ = setup(kind, layers)
    dyn = DynamicGraph(ev.graph)
    inc = IncrementalEmbeddings(dyn, ev.model, ev.store.layers)
    rng = np.random.default_rng(3)
    indptr, indices = dyn.to_csr()
    v = int(np.flatnonzero(np.diff(indptr) > 1)[0])
    inc.apply(UpdateBatch(add_node_features=rng.standard_normal((2, 4)).astype(np.float32),
                          add_edges=np.array([[N, 10], [10, N], [N + 1, 20], [33, 11]]),
                          remove_edges=np.array([[int(indices[indptr[v]]), v]]),
                          update_ids=np.array([12]), update_features=np.ones((1, 4), np.float32)))
    n = dyn.num_nodes  # N + 2: the query nodes are n, n + 1, ...
    q_ei = np.where(ei >= N, ei + 2, ei)
    current = tmp_path / "current"
    ip, ix = dyn.to_csr()
    write_dataset(current, indptr=ip, indices=ix.astype(np.int32), features=dyn.features(np.arange(n)))
    exact = full_graph_forward(augmented(tmp_path / "cur", GraphStore.open(current), feats, q_ei), ev.model)[n:]
    live = NewNodeEvaluator(ev.graph, ev.model, ev.store, view=DynamicGraphView(dyn, inc))
    with dyn.lock.read():
        got = live.infer(feats, q_ei, mode="full").logits
        srpe = live.infer(feats, q_ei, mode="srpe", gamma=1.0).logits
        sampled = live.infer(feats, q_ei, mode="sampled", fanouts=(1 << 30,) * layers).logits
    assert np.abs(got - exact).max() / np.abs(exact).max() <= 1e-4
    assert np.abs(sampled - exact).max() / np.abs(exact).max() <= 1e-4  # keyed draws read the current graph
    if kind != "gcn":
        assert np.abs(srpe - exact).max() / np.abs(exact).max() <= 1e-4
    stale = ev.infer(feats, ei, mode="full").logits  # the stored graph: misses the updates
    assert not np.allclose(stale, exact, rtol=1e-3)


def test_a_float16_store_is_read_mapped_not_widened_whole(tmp_path):
    # The evaluator (made once when a server starts) kept a float32 copy of every layer of a
    # float16 store in memory: twice the stored layers, however large the graph.
    import tracemalloc

    from hybridgnn.embeddings.precompute import PrecomputeConfig

    n, hidden = 20000, 128
    graph, model = four_in_edges_graph_and_sage(tmp_path / "g", n, hidden)
    rng = np.random.default_rng(1)
    store = precompute(graph, model, tmp_path / "m", PrecomputeConfig(dtype="float16"), progress=False)
    tracemalloc.start()  # numpy's allocations (the widened copies were)
    try:
        ev = NewNodeEvaluator(graph, model, store)
        feats, ei = rng.standard_normal((2, 4)).astype(np.float32), np.array([[n, n, n + 1], [3, 7, 3]])
        got = {mode: ev.infer(feats, ei, mode=mode, gamma=1.0).logits for mode in ("pe", "srpe", "full")}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n * hidden * 4 / 4, peak
    widened = [np.asarray(a, np.float32) for a in store.layers]  # what it read before: the same values
    store.layers[:] = widened
    for mode, logits in got.items():
        np.testing.assert_array_equal(NewNodeEvaluator(graph, model, store).infer(feats, ei, mode=mode,
                                                                                gamma=1.0).logits, logits)


@pytest.mark.parametrize("mode", ["full", "pe", "srpe", "sampled"])
def test_an_edge_given_twice_or_both_ways_is_added_once(setup, mode):
    # docs/api.md: what a mean or sum over neighbours reads does not depend on repeats
    ev, feats, ei, exact = setup("sage", 2)
    repeated = np.concatenate([ei, ei, ei[::-1]], axis=1)
    got = ev.infer(feats, repeated, mode=mode, gamma=1.0, fanouts=(1 << 30,) * 2).logits
    np.testing.assert_array_equal(got, ev.infer(feats, ei, mode=mode, gamma=1.0, fanouts=(1 << 30,) * 2).logits)
    if mode != "pe":
        assert np.abs(got - exact).max() / np.abs(exact).max() <= 1e-5


def test_the_ratio_counts_only_edges_from_query_nodes():
    """|N_Q(u)| counts a request's edges from its query nodes (ids >= n): an edge it gives
    between two existing nodes is no query edge."""
    n = 10
    direct = np.array([0, 1, 2])
    in_degree = lambda v: np.array([1, 4, 2])[np.searchsorted(direct, v)]  # noqa: E731
    # query 10 -> 0 twice over (10, 11), -> 1 and -> 2 once; existing 3, 4 -> 1
    qsrc = np.array([10, 11, 3, 4, 10, 10])
    qdst = np.array([0, 0, 1, 1, 1, 2])
    assert select_recompute(direct, qsrc, qdst, n, 0.34, "ratio", 0, in_degree).tolist() == [0, 2]


def test_gamma_below_zero_is_refused_and_random_picks_follow_the_seed():
    direct = np.arange(50, dtype=np.int64)
    none = np.empty(0, np.int64)
    ones = lambda v: np.ones(len(v))  # noqa: E731
    with pytest.raises(ValueError, match=r"gamma must be within \[0, 1\], got -0.5"):
        select_recompute(direct, none, none, 50, -0.5, "ratio", 0, ones)
    picks = {tuple(select_recompute(direct, none, none, 50, 0.1, "random", seed, ones)) for seed in range(4)}
    assert len(picks) > 1 and all(len(p) == 5 for p in picks)
    assert (select_recompute(direct, none, none, 50, 0.1, "random", 3, ones).tolist()
            == select_recompute(direct, none, none, 50, 0.1, "random", 3, ones).tolist())


def test_query_edges_of_a_directed_request_go_one_way():
    from hybridgnn.embeddings.newnodes import query_edges

    ei = np.array([[10, 10, 3], [0, 10, 10]])  # 10 -> 0, a self-edge, 3 -> 10
    src, dst = query_edges(ei, 10, 1, undirected=False)
    assert list(zip(src.tolist(), dst.tolist(), strict=True)) == [(10, 0), (3, 10)]
    src, dst = query_edges(ei, 10, 1, undirected=True)
    assert sorted(zip(src.tolist(), dst.tolist(), strict=True)) == [(0, 10), (3, 10), (10, 0), (10, 3)]


def test_sampled_mode_takes_one_fanout_per_layer():
    from hybridgnn.embeddings.newnodes import sampled_fanouts

    assert sampled_fanouts((5, 4, 3), 2) == (5, 4)
    with pytest.raises(ValueError, match="needs a fanout per layer: the model has 3 layers"):
        sampled_fanouts((5, 4), 3)
