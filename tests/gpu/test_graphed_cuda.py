"""CUDA graphs for small batches (pipelines/graphed.py) on a real GPU (marker gpu): the
GPU lane and the split CPU lane answer as without graphs, buckets are captured and
replayed while other workers run, and a model graphs are not tried on (GAT) is answered
eagerly."""

import threading

import numpy as np
import pytest
import torch

from hybridgnn.features.store import CachedFeatureStore
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.pipelines.graphed import GraphedForward, bucket_seeds
from hybridgnn.pipelines.split import SplitExecutor
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler

pytestmark = pytest.mark.gpu
FANOUTS = (5, 4, 3)
SIZES = [1, 1, 2, 3, 5, 8, 16, 4, 1, 7, 2, 16, 32]  # 32: past the largest bucket (16 here: eager)


def batches(num_nodes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.choice(num_nodes, n, replace=False) for n in SIZES * 2]


def setup(tiny_dataset, kind):
    graph = GraphStore.open(tiny_dataset)
    dg = DeviceGraph(graph, "cuda", "uva")
    store = CachedFeatureStore(graph.features, "cuda", 1 << 16, host_table=dg.host_visible(np.asarray(graph.features)))
    torch.manual_seed(0)
    model = GNN(ModelSpec(kind, graph.feature_dim, 32, 4, num_layers=3)).eval().to("cuda")
    return graph, dg, store, model


@pytest.mark.parametrize("kind", ["sage", "gat"])
def test_the_gpu_lane_with_graphs_answers_as_without(tiny_dataset, monkeypatch, kind):
    graph, dg, store, model = setup(tiny_dataset, kind)
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPH_SEEDS", "16")
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "0")
    plain = DeviceExecutor(TorchSampler(dg.indptr, dg.indices, FANOUTS, seed=3), store, model)
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "1")
    graphed = DeviceExecutor(TorchSampler(dg.indptr, dg.indices, FANOUTS, seed=3), store, model)
    assert isinstance(graphed.forward, GraphedForward)
    for seeds in batches(graph.num_nodes):
        want, got = plain.run(seeds), graphed.run(seeds)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-4, atol=1e-4)
    if kind == "sage":
        assert graphed.forward.captured == [1, 2, 4, 8, 16] and graphed.forward.replays > 0
    else:  # GAT's self-loop removal waits on the device: never captured
        assert not graphed.forward.usable and graphed.forward.eager == len(SIZES) * 2
    dg.close()


def test_workers_capture_and_replay_while_others_run(tiny_dataset, monkeypatch):
    graph, dg, store, model = setup(tiny_dataset, "sage")
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "1")
    executors = [DeviceExecutor(TorchSampler(dg.indptr, dg.indices, FANOUTS, seed=i), store, model) for i in range(3)]
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "0")
    references = [DeviceExecutor(TorchSampler(dg.indptr, dg.indices, FANOUTS, seed=i), store, model) for i in range(3)]
    got, errors = [None] * 3, []

    def work(i):
        try:
            got[i] = [executors[i].run(s).logits for s in batches(graph.num_nodes, seed=i)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for i in range(3):
        want = [references[i].run(s).logits for s in batches(graph.num_nodes, seed=i)]
        for g, w in zip(got[i], want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        assert executors[i].forward.replays > 0
    dg.close()


def test_the_split_lane_replays_graphs_too(tiny_dataset, monkeypatch):
    graph, dg, store, model = setup(tiny_dataset, "sage")
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "1")
    graphed = SplitExecutor(CPUSampler(graph, FANOUTS, seed=9), store, model, "cuda")
    monkeypatch.setenv("HYBRIDGNN_CUDA_GRAPHS", "0")
    plain = SplitExecutor(CPUSampler(graph, FANOUTS, seed=9), store, model, "cuda")
    try:
        for seeds in batches(graph.num_nodes):
            np.testing.assert_allclose(graphed.run(seeds).logits, plain.run(seeds).logits, rtol=1e-4, atol=1e-4)
        assert graphed.forward.replays > 0
    finally:
        graphed.close()
        plain.close()
        dg.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_one_launch_lay_out_writes_what_the_torch_ops_write(tiny_dataset, monkeypatch, dtype):
    """pipelines/cuda_lay_out.py against GraphedForward's torch ops on the device, for
    real samples of every bucket, edge rows apart in memory (a staging slot's view)."""
    pytest.importorskip("cupy")
    graph = GraphStore.open(tiny_dataset)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 4, num_layers=3)).eval().to("cuda")
    monkeypatch.setenv("HYBRIDGNN_CUDA_LAYOUT", "1")
    kernel = GraphedForward(model, FANOUTS, "cuda", max_seeds=16, capture=lambda fn: fn)
    monkeypatch.setenv("HYBRIDGNN_CUDA_LAYOUT", "0")
    ops = GraphedForward(model, FANOUTS, "cuda", max_seeds=16, capture=lambda fn: fn)
    assert kernel._layout_kernel and not ops._layout_kernel
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 5, 8, 16):
        sub = CPUSampler(graph, FANOUTS, seed=size).sample(rng.choice(graph.num_nodes, size, replace=False))
        x = torch.randn((sub.num_nodes, graph.feature_dim), device="cuda").to(dtype)
        staging = torch.full((2, sub.num_edges + 5), -1, dtype=torch.int64, device="cuda")
        staging[:, :sub.num_edges] = torch.from_numpy(sub.edge_index).cuda()
        edge_index = staging[:, :sub.num_edges]
        nodes, edges = list(sub.num_sampled_nodes), list(sub.num_sampled_edges)
        a, b = kernel._bucket(bucket_seeds(size, 16), x), ops._bucket(bucket_seeds(size, 16), x)
        a.x.zero_()
        b.x.zero_()
        kernel._lay_out(a, x, edge_index, nodes, edges)
        ops._lay_out(b, x, edge_index, nodes, edges)
        torch.cuda.synchronize()
        assert torch.equal(a.x, b.x) and torch.equal(a.edge_index, b.edge_index), size
