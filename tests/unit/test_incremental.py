"""Incrementally maintained embeddings equal a full re-precompute on the updated graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_geometric.nn.models import GAT, GCN, GIN, GraphSAGE

from hybridgnn.embeddings.incremental import (
    IncrementalConfig,
    IncrementalEmbeddings,
    layer_kind,
)
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute
from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch, UpdateError
from hybridgnn.graph.store import GraphStore, write_dataset
from hybridgnn.models.gnn import GNN, ModelSpec
from tests.support.graphs import make_graph, skewed_edges

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

F_DIM = 6
MODELS = {
    "sage-mean": lambda: GraphSAGE(F_DIM, 8, 2, out_channels=5, aggr="mean"),
    "sage-sum": lambda: GraphSAGE(F_DIM, 8, 2, out_channels=5, aggr="sum"),
    "gin-sum": lambda: GIN(F_DIM, 8, 2, out_channels=5),
    "sage-max": lambda: GraphSAGE(F_DIM, 8, 2, out_channels=5, aggr="max"),
    "gcn": lambda: GCN(F_DIM, 8, 3, out_channels=5),
    "gat": lambda: GAT(F_DIM, 8, 2, out_channels=5, heads=2),
    "own-sage": lambda: GNN(ModelSpec("sage", F_DIM, 8, 5, num_layers=2)),
    "own-gcn": lambda: GNN(ModelSpec("gcn", F_DIM, 8, 5, num_layers=2)),
    "sage-jk-cat": lambda: GraphSAGE(F_DIM, 8, 3, out_channels=5, jk="cat"),
}
EXPECTED_KINDS = {"sage-mean": "mean", "sage-sum": "sum", "gin-sum": "gin", "sage-max": "recompute",
                  "gcn": "gcn", "gat": "recompute", "own-sage": "mean", "own-gcn": "gcn",
                  "sage-jk-cat": "mean"}


def _model(name: str):
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _full(graph_arrays, model, tmp_path, tag: str) -> list[np.ndarray]:
    indptr, indices, feats = graph_arrays
    ds = write_dataset(tmp_path / f"ds-{tag}", indptr=indptr, indices=indices.astype(np.int32), features=feats)
    store = precompute(GraphStore.open(ds), model, tmp_path / f"m-{tag}", PrecomputeConfig(batch_size=7),
                       progress=False)
    return [np.asarray(a) for a in store.layers]


def _current(dyn: DynamicGraph):
    indptr, indices = dyn.to_csr()
    return indptr, indices, dyn.features(np.arange(dyn.num_nodes))


def _setup(name, tmp_path, mode="auto", max_block_edges=2_000_000):
    base = make_graph(tmp_path / "base", skewed_edges(40, seed=3), 40, feature_dim=F_DIM, seed=2)
    model = _model(name)
    layers = _full((np.asarray(base.indptr), np.asarray(base.indices), np.asarray(base.features)), model,
                   tmp_path, "init")
    dyn = DynamicGraph(base)
    return dyn, model, IncrementalEmbeddings(dyn, model, layers,
                                             IncrementalConfig(mode=mode, max_block_edges=max_block_edges))


@st.composite
def batches(draw, dyn: DynamicGraph):
    """A valid batch against the graph as it is now."""
    n = dyn.num_nodes
    alive = np.flatnonzero(dyn.alive[:n])
    indptr, indices = dyn.to_csr()
    dst_all = np.repeat(np.arange(n), np.diff(indptr))
    present = set(zip(indices.tolist(), dst_all.tolist(), strict=True))
    rm_nodes = draw(st.lists(st.sampled_from(alive.tolist()), max_size=1, unique=True)) if len(alive) > 5 else []
    live = [v for v in alive.tolist() if v not in rm_nodes]
    existing = sorted(p for p in present if p[0] not in rm_nodes and p[1] not in rm_nodes)
    rm_edges = draw(st.lists(st.sampled_from(existing), max_size=4, unique=True)) if existing else []
    a = draw(st.integers(0, 2))
    ends = live + list(range(n, n + a))
    pair = st.tuples(st.sampled_from(ends), st.sampled_from(ends)).filter(lambda p: p not in present)
    add_edges = draw(st.lists(pair, max_size=5, unique=True))
    add_edges = [p for p in add_edges if p not in rm_edges]
    upd = draw(st.lists(st.sampled_from(live), max_size=3, unique=True))
    values = st.floats(-2, 2, allow_nan=False, width=32)
    feats = np.array(draw(st.lists(st.lists(values, min_size=F_DIM, max_size=F_DIM), min_size=len(upd),
                                   max_size=len(upd))), dtype=np.float32).reshape(len(upd), F_DIM)
    new = np.array(draw(st.lists(st.lists(values, min_size=F_DIM, max_size=F_DIM), min_size=a, max_size=a)),
                   dtype=np.float32).reshape(a, F_DIM)
    return UpdateBatch(add_edges=np.array(add_edges, dtype=np.int64).reshape(-1, 2),
                       remove_edges=np.array(rm_edges, dtype=np.int64).reshape(-1, 2),
                       add_node_features=new if a else None, remove_nodes=np.array(rm_nodes, dtype=np.int64),
                       update_ids=np.array(upd, dtype=np.int64), update_features=feats if len(upd) else None)


def _assert_matches_full(dyn, model, inc, tmp_path, tag):
    ref = _full(_current(dyn), model, tmp_path, tag)
    alive = dyn.alive[: dyn.num_nodes]
    for layer, (got, want) in enumerate(zip(inc.layers, ref, strict=True)):
        got, want = got[: dyn.num_nodes][alive], want[alive]
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
        assert err <= 1e-4, f"layer {layer + 1}: relative error {err:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_layer_kinds(name):
    assert layer_kind(_model(name).convs[0]) == EXPECTED_KINDS[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_random_update_sequences_match_full_recompute(name, tmp_path_factory):
    @hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(data=st.data())
    def run(data):
        tmp = tmp_path_factory.mktemp(name)
        dyn, model, inc = _setup(name, tmp)
        for step in range(data.draw(st.integers(1, 4))):
            report = inc.apply(data.draw(batches(dyn)))
            assert report.version == dyn.version
            touched.append(report.affected_nodes)
            if step == 1:
                assert dyn.compact() is True  # compaction between batches changes nothing served
        _assert_matches_full(dyn, model, inc, tmp, "final")

    touched: list[int] = []
    run()
    assert sum(touched) > 0, "the generated batches never changed anything"


@pytest.mark.parametrize("name", ["sage-mean", "gcn", "gat"])
def test_recompute_mode_matches_too(name, tmp_path):
    # Tiny chunks: the chunked recompute must equal the one-block one.
    dyn, model, inc = _setup(name, tmp_path, mode="recompute", max_block_edges=5)
    rng = np.random.default_rng(0)
    inc.apply(UpdateBatch(add_edges=np.array(_absent_edges(dyn, 2)), remove_edges=np.array(_some_edge(dyn)),
                          update_ids=np.array([5]), update_features=rng.normal(size=(1, F_DIM)).astype(np.float32)))
    _assert_matches_full(dyn, model, inc, tmp_path, "r")


def _absent_edges(dyn, k):
    present = dyn.has_edges(np.arange(40), np.roll(np.arange(40), 7))
    pairs = np.stack([np.arange(40), np.roll(np.arange(40), 7)], 1)[~present]
    return pairs[:k].tolist()


def _some_edge(dyn):
    indptr, indices = dyn.to_csr()
    v = int(np.flatnonzero(np.diff(indptr) > 1)[0])
    return [[int(indices[indptr[v]]), v]]


def test_pruning_stops_at_unchanged_rows(tmp_path):
    dyn, model, inc = _setup("sage-max", tmp_path)
    v = 7
    # Lowering a feature that is nobody's maximum changes v's own layer 1 only if v reads
    # itself; with max aggregation most readers' outputs are unchanged and propagation stops.
    feats = dyn.features(np.array([v])) - 50.0
    rep = inc.apply(UpdateBatch(update_ids=np.array([v]), update_features=feats))
    assert rep.changed_per_layer[0] <= rep.affected_per_layer[0]
    assert rep.affected_per_layer[1] <= rep.changed_per_layer[0] + len(dyn.out_neighbours(
        np.flatnonzero(inc.layers[0].any(axis=1)))[1])
    _assert_matches_full(dyn, model, inc, tmp_path, "p")


def _snapshot(dyn, inc):
    """Everything a reader or the next batch can see, as bytes."""
    n = dyn.num_nodes
    indptr, indices = dyn.to_csr()
    rev_indptr, rev_indices = dyn.rev.to_csr()
    return [n, dyn.version, dyn.updates_applied, indptr.tobytes(), indices.tobytes(), rev_indptr.tobytes(),
            rev_indices.tobytes(), dyn.features(np.arange(n)).tobytes(), dyn.alive[:n].tobytes(),
            dyn.self_loop[:n].tobytes(), dyn.in_degree(np.arange(n)).tobytes()] + \
        [a.tobytes() for a in inc.layers] + [a.tobytes() for a in inc.aggregates if a is not None] + \
        [inc.output.tobytes() if inc.output is not None else b""]


@pytest.mark.parametrize("bad, match", [
    (UpdateBatch(add_edges=np.array([[0, 10_000]])), "unknown node"),
    (UpdateBatch(add_edges=np.array([[0, 1], [0, 1]])), "twice"),
    (UpdateBatch(remove_edges=np.array([[39, 38], [38, 39], [39, 39]])), "not in the graph"),
    (UpdateBatch(update_ids=np.array([1]), update_features=np.zeros((1, F_DIM + 1), np.float32)), r"\[1, 6\]"),
    (UpdateBatch(add_node_features=np.zeros((2, 3), np.float32)), "new node features"),
    (UpdateBatch(remove_nodes=np.array([2]), add_edges=np.array([[2, 3]])), "removes"),
])
def test_rejected_batches_leave_everything_byte_identical(bad, match, tmp_path):
    dyn, _, inc = _setup("sage-mean", tmp_path)
    inc.apply(UpdateBatch(update_ids=np.array([4]), update_features=np.ones((1, F_DIM), np.float32)))
    before = _snapshot(dyn, inc)
    with pytest.raises(UpdateError, match=match):
        inc.apply(bad)
    assert _snapshot(dyn, inc) == before


@pytest.mark.parametrize("name", ["sage-sum"])  # (values that large are refused as requests: 1e9)
def test_features_that_overflow_a_layer_are_rejected_and_leave_everything_byte_identical(name, tmp_path):
    """Kept, the overflow stayed in the running sums for good (NaN after inf - inf), on
    every replica and across restarts."""
    dyn, _, inc = _setup(name, tmp_path)
    before = _snapshot(dyn, inc)
    huge = np.full((1, F_DIM), 3e38, np.float32)
    with pytest.raises(UpdateError, match="overflow to NaN or infinity; nothing of it was applied"):
        inc.apply(UpdateBatch(update_ids=np.array([4]), update_features=huge))
    assert _snapshot(dyn, inc) == before


def test_duplicate_of_existing_edge_is_rejected(tmp_path):
    dyn, _, inc = _setup("gcn", tmp_path)
    before = _snapshot(dyn, inc)
    with pytest.raises(UpdateError, match="already in the graph"):
        inc.apply(UpdateBatch(add_edges=np.array(_some_edge(dyn))))
    assert _snapshot(dyn, inc) == before


@pytest.mark.parametrize("name", ["sage-mean", "gcn", "gat"])
def test_updating_the_features_of_a_node_the_batch_adds(name, tmp_path):
    # Update features come last in a batch: a node added and updated in one batch ends up
    # with the update (this used to read the new node's "old" row from the base: IndexError).
    dyn, model, inc = _setup(name, tmp_path)
    n = dyn.num_nodes
    rng = np.random.default_rng(1)
    added = rng.normal(size=(2, F_DIM)).astype(np.float32)
    update = rng.normal(size=(2, F_DIM)).astype(np.float32)
    inc.apply(UpdateBatch(add_node_features=added, add_edges=np.array([[n, 3], [3, n], [n + 1, n], [5, n + 1]]),
                          update_ids=np.array([n + 1, 4]), update_features=update))
    np.testing.assert_array_equal(dyn.features(np.array([n, n + 1, 4])), np.stack([added[0], update[0], update[1]]))
    _assert_matches_full(dyn, model, inc, tmp_path, "u")


def test_batches_that_add_nodes_do_not_copy_every_layer_each_time(tmp_path):
    # Growth is amortised: a copy of every layer and aggregate per batch that adds a node
    # cost O(nodes x width) per batch (272 ms against 2 ms for an edge, at 300k nodes).
    dyn, model, inc = _setup("sage-mean", tmp_path)
    rng = np.random.default_rng(0)

    def add_node():
        n = dyn.num_nodes
        inc.apply(UpdateBatch(add_node_features=rng.normal(size=(1, F_DIM)).astype(np.float32),
                              add_edges=np.array([[n, 3], [5, n]])))

    def arrays():
        return [*inc.layers, *(a for a in inc.aggregates if a is not None)]

    add_node()
    grown = arrays()
    for _ in range(4):
        add_node()
    assert all(a is b for a, b in zip(arrays(), grown, strict=True))
    _assert_matches_full(dyn, model, inc, tmp_path, "g")


class InjectedFault(RuntimeError):
    pass


def _fault_batch(dyn):
    """New nodes referenced in edges and feature updates, removed edges and a removed node."""
    n = dyn.num_nodes
    rng = np.random.default_rng(7)
    edge = _some_edge(dyn)[0]
    return UpdateBatch(add_node_features=rng.normal(size=(2, F_DIM)).astype(np.float32),
                       add_edges=np.array([[n, 3], [3, n], [n + 1, n], [5, n + 1], [n, n]]),
                       remove_edges=np.array([edge]), remove_nodes=np.array([30]),
                       update_ids=np.array([n + 1, 4]), update_features=rng.normal(size=(2, F_DIM)).astype(np.float32))


@pytest.mark.parametrize("name", ["sage-mean", "gcn", "gat", "gin-sum", "sage-jk-cat"])
def test_a_failure_at_any_step_of_apply_rolls_everything_back(name, tmp_path, monkeypatch):
    from hybridgnn.graph import journal

    steps: list[str] = []
    monkeypatch.setattr(journal, "FAULT", steps.append)
    dyn, _, inc = _setup(name, tmp_path / "steps")
    inc.apply(_fault_batch(dyn))
    want = _snapshot(dyn, inc)  # the batch applied without a failure
    monkeypatch.setattr(journal, "FAULT", None)
    assert len(steps) >= 6, steps
    for k, step in enumerate(list(steps)):
        dyn, model, inc = _setup(name, tmp_path / f"k{k}")
        inc.apply(UpdateBatch(update_ids=np.array([6]), update_features=np.ones((1, F_DIM), np.float32)))
        inc.apply(UpdateBatch(remove_edges=np.array(_some_edge(dyn))))
        before = _snapshot(dyn, inc)
        calls = iter(range(len(steps) + 1))

        def fail(at, k=k, calls=calls):
            if next(calls) == k:
                raise InjectedFault(at)

        monkeypatch.setattr(journal, "FAULT", fail)
        with pytest.raises(InjectedFault):
            inc.apply(_fault_batch(dyn))
        assert _snapshot(dyn, inc) == before, f"state changed by a failure at {step!r}"
        monkeypatch.setattr(journal, "FAULT", None)
        inc.apply(_fault_batch(dyn))  # the same batch then applies as if nothing had happened
        _assert_matches_full(dyn, model, inc, tmp_path / f"k{k}", "after")
    dyn, _, inc = _setup(name, tmp_path / "clean")
    inc.apply(_fault_batch(dyn))
    assert _snapshot(dyn, inc) == want


def test_without_pruning_every_affected_row_counts_as_changed(tmp_path):
    dyn, _, inc = _setup("sage-max", tmp_path)
    inc.cfg = IncrementalConfig(prune=False)
    feats = dyn.features(np.array([7])) - 50.0  # the update pruning stops early on
    rep = inc.apply(UpdateBatch(update_ids=np.array([7]), update_features=feats))
    assert rep.changed_per_layer == rep.affected_per_layer


@pytest.mark.parametrize("kw, match", [({"max_block_edges": 0}, "max_block_edges must be >= 1"),
                                       ({"mode": "lazy"}, "mode must be one of"),
                                       ({"aggregate_dtype": "float16"}, "aggregate_dtype must be")])
def test_an_incremental_config_out_of_range_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        IncrementalConfig(**kw)
