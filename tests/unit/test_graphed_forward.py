"""The bucketed, padded forward that CUDA graphs replay (pipelines/graphed.py), on CPU
tensors with an eager "capture": a padded sample answers as the unpadded one for every
seed count and model kind, buckets are captured once and reused, a capture that fails or
replays differently leaves its bucket eager (the batch still answered eagerly), and the
batches graphs cannot take (GCN degrees, too many seeds, unbounded fanouts, a depth other
than the model's) run the model's own forward."""

import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgnn.features.store import CachedFeatureStore
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.pipelines.graphed import (
    BucketShape,
    GraphedForward,
    bucket_seeds,
    model_forward,
)
from hybridgnn.pipelines.split import SplitExecutor
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler
from tests.support.graphs import make_graph, skewed_edges


def eager_capture(calls):
    def capture(fn):
        calls.append(fn)
        return fn  # "replays" run the forward on the static buffers again

    return capture


def sample_inputs(graph, fanouts, seeds, seed=0):
    sub = CPUSampler(graph, fanouts, seed=seed).sample(np.asarray(seeds, dtype=np.int64))
    x = torch.from_numpy(np.asarray(graph.features[sub.node_ids], dtype=np.float32))
    return sub, x, torch.from_numpy(sub.edge_index)


def eager(model, sub, x, ei, degrees=None):
    with torch.inference_mode():
        return model(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges, degrees, with_embeddings=True)


@pytest.mark.parametrize("kind,layers", [("sage", 1), ("sage", 2), ("sage", 3), ("gat", 2)])
def test_a_padded_sample_answers_as_the_unpadded_one(tiny_dataset, kind, layers):
    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(layers)
    model = GNN(ModelSpec(kind, graph.feature_dim, 16, 4, num_layers=layers)).eval()
    fanouts = (5, 3, 2)[:layers]
    calls = []
    forward = GraphedForward(model, fanouts, "cpu", max_seeds=8, capture=eager_capture(calls), any_model=True)
    rng = np.random.default_rng(layers)
    for size in (1, 1, 2, 3, 5, 8, 3):
        seeds = rng.choice(graph.num_nodes, size, replace=False)
        sub, x, ei = sample_inputs(graph, fanouts, seeds, seed=size)
        want = eager(model, sub, x, ei)
        with torch.inference_mode():
            got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
        for g, w in zip(got, want, strict=True):
            assert g.shape[0] >= size  # padded rows follow the seeds'
            torch.testing.assert_close(g[:size], w[:size])
    assert forward.captured == [1, 2, 4, 8] and len(calls) == 4  # each bucket captured once
    assert forward.replays == 3 and forward.eager == 4  # a bucket's first batch is answered eagerly


def test_dummy_rows_never_reach_real_targets(tiny_dataset):
    """Stale or non-finite rows in the padding change nothing for the seeds."""
    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    forward = GraphedForward(model, (4, 4), "cpu", max_seeds=4, capture=eager_capture([]))
    sub, x, ei = sample_inputs(graph, (4, 4), [7, 8, 9])
    with torch.inference_mode():
        forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)  # captures bucket 4
        forward._buckets[4].x.fill_(float("nan"))
        got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
    want = eager(model, sub, x, ei)
    torch.testing.assert_close(got[0][:3], want[0][:3])
    torch.testing.assert_close(got[1][:3], want[1][:3])


def test_a_capture_that_fails_leaves_the_model_eager_and_is_logged_once(tiny_dataset, caplog):
    graph = GraphStore.open(tiny_dataset)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    tries = []

    def failing(fn):
        tries.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    forward = GraphedForward(model, (3, 3), "cpu", max_seeds=4, capture=failing)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.pipelines.graphed"):
        with torch.inference_mode():
            for seeds in ([1], [1], [1, 2], [1, 2, 3]):  # other buckets are not tried either
                sub, x, ei = sample_inputs(graph, (3, 3), seeds)
                got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
                torch.testing.assert_close(got[0], eager(model, sub, x, ei)[0])
    assert len(tries) == 1 and forward.captured == [] and forward.eager == 4 and not forward.usable
    assert sum("without a CUDA graph" in r.message for r in caplog.records) == 1


def test_a_replay_that_differs_retires_its_bucket(tiny_dataset, caplog):
    graph = GraphStore.open(tiny_dataset)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()

    def wrong(fn):
        return lambda: tuple(t + 1 for t in fn())

    forward = GraphedForward(model, (3, 3), "cpu", max_seeds=4, capture=wrong)
    sub, x, ei = sample_inputs(graph, (3, 3), [1, 2])
    want = eager(model, sub, x, ei)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.pipelines.graphed"):
        with torch.inference_mode():
            for _ in range(2):
                got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
                torch.testing.assert_close(got[0], want[0])
    assert forward.captured == [] and forward.replays == 0
    assert any("differed" in r.message for r in caplog.records)


def test_batches_graphs_cannot_take_run_the_model_itself(tiny_dataset):
    graph = GraphStore.open(tiny_dataset)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    calls = []
    sub, x, ei = sample_inputs(graph, (3, 3), [1, 2, 3])
    cases = {
        "too many seeds": GraphedForward(model, (3, 3), "cpu", max_seeds=2, capture=eager_capture(calls)),
        "unbounded fanout": GraphedForward(model, (3, -1), "cpu", capture=eager_capture(calls)),
        "depth other than the model's": GraphedForward(model, (3, 3, 3), "cpu", capture=eager_capture(calls)),
        "too many slots": GraphedForward(model, (3, 3), "cpu", max_slots=10, capture=eager_capture(calls)),
    }
    for name, forward in cases.items():
        with torch.inference_mode():
            got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
        torch.testing.assert_close(got[0], eager(model, sub, x, ei)[0]), name
        assert forward.eager == 1 and forward.replays == 0, name
    # Degrees (GCN's whole-graph weights) always go to the model.
    forward = GraphedForward(model, (3, 3), "cpu", capture=eager_capture(calls))
    seen = []
    forward.model = lambda *a, **k: seen.append(a[4]) or model(*a[:4], None, **k)
    with torch.inference_mode():
        forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges, degrees=("d", "l"))
    assert seen == [("d", "l")] and calls == []


def test_a_sample_over_its_buckets_slots_runs_eagerly(tiny_dataset):
    """fits() guards the layout: counts past the worst case (a sampler that broke its
    fanouts) are never written past the buffers."""
    shape = BucketShape.worst_case(2, (3, 2))
    assert shape.nodes == (3, 7, 13) and shape.edges == (6, 12) and shape.slots == 23
    assert shape.fits([2, 6, 12], [6, 12])
    assert not shape.fits([3, 1, 1], [1, 1])  # no dummy slot left among the seeds
    assert not shape.fits([2, 6, 12], [7, 12]) and not shape.fits([2, 6], [6])


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert [bucket_seeds(n, 16) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert bucket_seeds(17, 16) is None and bucket_seeds(0, 16) is None


def test_graphs_are_tried_on_built_in_graphsage_only(tiny_dataset):
    graph = GraphStore.open(tiny_dataset)
    for kind, tried in (("sage", True), ("gat", False), ("gcn", False)):
        model = GNN(ModelSpec(kind, graph.feature_dim, 8, 3, num_layers=2)).eval()
        assert GraphedForward(model, (3, 3), "cpu", capture=eager_capture([])).usable is tried, kind
    stack = torch.nn.Module()  # a user's own layer stack
    stack.num_layers = 2
    assert not GraphedForward(stack, (3, 3), "cpu", capture=eager_capture([])).usable


def test_graphs_are_opt_in_and_only_on_cuda(monkeypatch, tiny_dataset):
    graph = GraphStore.open(tiny_dataset)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "1")
    forward = model_forward(model, (3, 3), "cpu")
    assert not isinstance(forward, GraphedForward)  # a CPU device: the model's own forward
    sub, x, ei = sample_inputs(graph, (3, 3), [5])
    with torch.inference_mode():
        got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
    torch.testing.assert_close(got[0], eager(model, sub, x, ei)[0])


def test_both_device_lanes_answer_alike_through_padded_replays(tiny_dataset):
    """The executors index the seeds' rows out of a padded replay as out of the model's
    own answer (GPU lane and split CPU lane, on CPU tensors)."""
    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    dg = DeviceGraph(graph, "cpu")
    store = CachedFeatureStore(graph.features, "cpu", 64 * 1024)
    makers = {"gpu lane": lambda: DeviceExecutor(TorchSampler(dg.indptr, dg.indices, (4, 3), seed=2), store, model),
              "split lane": lambda: SplitExecutor(CPUSampler(graph, (4, 3), seed=2), store, model, "cpu")}
    for name, make in makers.items():
        plain, graphed = make(), make()
        graphed.forward = GraphedForward(model, (4, 3), "cpu", max_seeds=8, capture=eager_capture([]))
        try:
            for seeds in ([5], [5, 5, 9], [1, 2, 3, 4, 4], [8], [7, 6, 5]):
                seeds = np.asarray(seeds)
                want, got = plain.run(seeds), graphed.run(seeds)
                np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-6, err_msg=name)
                np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-6, err_msg=name)
                assert np.array_equal(got.predictions, want.predictions), name
            assert graphed.forward.replays == 2, name  # buckets 1 and 4 came back
        finally:
            for ex in (plain, graphed):
                if hasattr(ex, "close"):
                    ex.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fanouts=st.lists(st.integers(1, 4), min_size=1, max_size=3), graph_seed=st.integers(0, 3),
       seeds=st.lists(st.integers(0, 59), min_size=1, max_size=9), width=st.sampled_from([3, 8]),
       sample_seed=st.integers(0, 1000))
def test_padding_never_changes_an_answer(tmp_path_factory, fanouts, graph_seed, seeds, width, sample_seed):
    """Any graph (hubs, isolated nodes, self-loops), depth, fanouts and seed set, duplicates
    included: a padded replay answers as the model does on the sample itself."""
    graph = make_graph(tmp_path_factory.mktemp("g"), skewed_edges(60, seed=graph_seed), 60, seed=graph_seed)
    torch.manual_seed(sample_seed)
    model = GNN(ModelSpec("sage", graph.feature_dim, width, 3, num_layers=len(fanouts))).eval()
    forward = GraphedForward(model, fanouts, "cpu", max_seeds=16, capture=eager_capture([]))
    sub, x, ei = sample_inputs(graph, tuple(fanouts), seeds, seed=sample_seed)
    want = eager(model, sub, x, ei)
    with torch.inference_mode():
        forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)  # captures, answers eagerly
        got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)  # a replay
    assert forward.replays == 1
    unique = int(sub.num_sampled_nodes[0])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g[:unique], w[:unique])


def test_a_capture_waits_until_no_other_thread_is_inside_device_work(tiny_dataset):
    """A capture runs alone in the process (capabilities.DEVICE_GATE): while another thread
    is inside its device work the first batch of a bucket waits, and it captures once that
    thread has left, with nobody inside."""
    import threading

    from hybridgnn.capabilities import DEVICE_GATE

    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    seen = []

    def capture(fn):
        seen.append(DEVICE_GATE.working)
        return fn

    forward = GraphedForward(model, (4, 3), "cpu", max_seeds=4, capture=capture)
    sub, x, ei = sample_inputs(graph, (4, 3), [3])
    inside, leave, answered = threading.Event(), threading.Event(), threading.Event()

    def other_worker():
        with DEVICE_GATE.work():
            inside.set()
            assert leave.wait(30)

    def first_batch():
        with DEVICE_GATE.work(), torch.inference_mode():  # as an executor calls it
            forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
        answered.set()

    other = threading.Thread(target=other_worker)
    other.start()
    assert inside.wait(30)
    batch = threading.Thread(target=first_batch)
    batch.start()
    assert not answered.wait(0.3) and seen == []  # waiting for the other thread to leave
    leave.set()
    assert answered.wait(30)
    other.join(30)
    batch.join(30)
    assert seen == [0] and forward.captured == [1] and DEVICE_GATE.working == 0


def test_a_lay_out_kernel_that_cannot_run_leaves_the_torch_ops_in_charge(tiny_dataset, monkeypatch, caplog):
    from hybridgnn.pipelines import cuda_lay_out

    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 3, num_layers=2)).eval()
    forward = GraphedForward(model, (4, 4), "cpu", max_seeds=4, capture=eager_capture([]))
    forward._layout_kernel = True

    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: error: identifier undefined")

    monkeypatch.setattr(cuda_lay_out, "lay_out", broken)
    sub, x, ei = sample_inputs(graph, (4, 4), [7, 8, 9])
    want = eager(model, sub, x, ei)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.pipelines.graphed"), torch.inference_mode():
        for _ in range(2):  # captured on the first, replayed on the second
            got = forward(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
            torch.testing.assert_close(got[0][:3], want[0][:3])
    assert not forward._layout_kernel and forward.replays == 1
    assert caplog.text.count("one-launch bucket lay-out failed (RuntimeError: nvrtc") == 1
