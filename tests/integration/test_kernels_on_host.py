"""Every CUDA kernel of the GPU lane, launched by its own Python on CPU tensors, with the
kernels compiled by g++ (tests/support/cuda_on_host.py): the batch sampling kernels and
the one-launch sampler against the reference sampler (and against each other, as the
sampler's first-batch check does), the bucket lay-out and the cached gather against
their torch ops, and the whole GPU lane with every kernel against the lane without.
What stays for a GPU: speed, the CUDA runtime and memory beyond one block's barrier.
Skipped without g++."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from hybridgnn.features.store import CachedFeatureStore
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.pipelines.graphed import GraphedForward, bucket_seeds
from hybridgnn.sampling import cuda_hop
from hybridgnn.sampling.cpu import CPUSampler, _mix_seed
from hybridgnn.sampling.gpu import TorchSampler
from tests.support.cuda_on_host import kernels_on_host
from tests.support.graphs import make_graph
from tests.support.reference import kernel_batch_sample

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("host-kernels")  # built libraries shared by this module's tests


def _csr(num_nodes: int, max_degree: int, seed: int, index_dtype=torch.int64):
    rng = np.random.default_rng(seed)
    degrees = rng.integers(0, max_degree + 1, num_nodes)
    indptr = np.concatenate([[0], np.cumsum(degrees)]).astype(np.int64)
    indices = rng.integers(0, num_nodes, int(indptr[-1]))
    return torch.from_numpy(indptr), torch.from_numpy(indices).to(index_dtype)


def _hop_seeds(seed: int, hops: int, drawn: int) -> list[int]:
    base = int(_mix_seed(seed)[0]) & 0x7FFF_FFFF_FFFF_FFFF
    return [int(_mix_seed(base + drawn + i + 1)[0]) for i in range(hops)]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_the_sampling_kernels_sample_what_the_reference_samples(monkeypatch, workdir, index_dtype):
    built = kernels_on_host(monkeypatch, workdir)
    indptr, indices = _csr(20_000, 30, 1, index_dtype)
    fanouts = (15, 10, 5)
    sampler = TorchSampler(indptr, indices, fanouts, seed=7, kernel=True)
    assert sampler._small is not None
    rng = np.random.default_rng(0)
    drawn = 0
    for size in (1, 3, 36, 37, 200, 1, 12):  # one block up to 35 distinct seeds, the batch kernels past it
        seeds = rng.choice(2000, size, replace=False)
        seeds[-1] = seeds[0]  # a repeated seed: size - 1 distinct ones
        sub = sampler.sample(seeds)
        unique, inverse = np.unique(seeds, return_inverse=True)
        nodes, edges, per_hop_nodes, per_hop_edges = kernel_batch_sample(
            indptr.numpy(), indices.numpy(), unique.tolist(), fanouts, _hop_seeds(7, 3, drawn))
        drawn += 3
        assert np.array_equal(sub.node_ids.numpy(), nodes), size
        assert np.array_equal(sub.edge_index.numpy(), edges), size
        assert sub.num_sampled_nodes == per_hop_nodes and sub.num_sampled_edges == per_hop_edges
        assert np.array_equal(sub.seed_index.numpy(), inverse) and np.array_equal(sub.host_seed_index, inverse)
    # the first small batch was checked against the batch kernels and passed
    assert sampler._small is not None and sampler._small_checked
    assert bool((sampler._local == -1).all()) and bool((sampler._bid == cuda_hop.INT64_MAX).all())
    launches = {name: k.launches for module in built.values() for name, k in module.kernels.items()}
    assert launches["sample_small"] == 5  # 1, 3, 36 (35 distinct), 1, 12 seeds
    assert launches["sample_frontier"] == 3 * (2 + 1)  # 37 and 200 seeds, and the check of the first small


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_lay_out_kernel_writes_what_the_torch_ops_write(tiny_dataset, monkeypatch, workdir, dtype):
    from hybridgnn.graph.store import GraphStore

    kernels_on_host(monkeypatch, workdir)
    graph = GraphStore.open(tiny_dataset)
    fanouts = (5, 4, 3)
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 4, num_layers=3)).eval()
    kernel = GraphedForward(model, fanouts, "cpu", max_seeds=16, capture=lambda fn: fn)
    ops = GraphedForward(model, fanouts, "cpu", max_seeds=16, capture=lambda fn: fn)
    ops._layout_kernel = False
    assert kernel._layout_kernel
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 5, 8, 16):
        sub = CPUSampler(graph, fanouts, seed=size).sample(rng.choice(graph.num_nodes, size, replace=False))
        x = torch.randn((sub.num_nodes, graph.feature_dim)).to(dtype)
        ei = torch.from_numpy(sub.edge_index)
        layouts = {"staging view": torch.cat([ei, torch.full((2, 5), -1)], 1)[:, :ei.shape[1]],
                   "int32": ei.to(torch.int32), "columns apart": ei.t().contiguous().t()}
        for what, edge_index in layouts.items():
            a, b = kernel._bucket(bucket_seeds(size, 16), x), ops._bucket(bucket_seeds(size, 16), x)
            a.x.zero_()
            b.x.zero_()
            kernel._lay_out(a, x, edge_index, list(sub.num_sampled_nodes), list(sub.num_sampled_edges))
            ops._lay_out(b, x, edge_index, list(sub.num_sampled_nodes), list(sub.num_sampled_edges))
            assert torch.equal(a.x, b.x) and torch.equal(a.edge_index, b.edge_index), (size, what)


@pytest.mark.parametrize("dim,dtype", [(3, torch.float32), (16, torch.float32), (100, torch.float32),
                                       (7, torch.float16)])
def test_the_gather_kernel_gathers_what_the_torch_ops_gather(monkeypatch, workdir, dim, dtype):
    kernels_on_host(monkeypatch, workdir)
    rng = np.random.default_rng(dim)
    features = rng.standard_normal((500, dim)).astype(np.float16 if dtype == torch.float16 else np.float32)
    kernel = CachedFeatureStore(features, "cpu", cache_bytes=120 * dim * features.itemsize)
    ops = CachedFeatureStore(features, "cpu", cache_bytes=120 * dim * features.itemsize)
    ops._one_kernel = False
    assert kernel._one_kernel
    for n in (1, 7, 300):
        ids = rng.integers(0, 500, n)
        (got, got_tiers), (want, want_tiers) = kernel.gather_counted(ids), ops.gather_counted(ids)
        assert torch.equal(got, want) and got_tiers == want_tiers, n


def test_the_gpu_lane_with_every_kernel_answers_as_without(tmp_path, monkeypatch, workdir):
    """Fanouts at least every degree make the sample fixed, so the lane with the kernels
    (one-launch and batch sampling, cached gather, bucket lay-out, CUDA-graph padding)
    must answer every request as the torch ops do: seeds unsorted and repeated."""
    rng = np.random.default_rng(3)
    edges = [(i, int(j)) for i in range(300) for j in rng.choice(300, int(rng.integers(0, 5)), replace=False)]
    graph = make_graph(tmp_path / "g", edges, 300, feature_dim=12)
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", 12, 16, 3, num_layers=3)).eval()
    fanouts = (4, 4, 4)
    features = np.asarray(graph.features)
    plain = DeviceExecutor(TorchSampler.from_graph(graph, fanouts, seed=1),
                           CachedFeatureStore(features, "cpu", 40 * 12 * 4), model)
    assert not plain.sampler.kernel
    kernels_on_host(monkeypatch, workdir)
    fast = DeviceExecutor(TorchSampler.from_graph(graph, fanouts, seed=1),
                          CachedFeatureStore(features, "cpu", 40 * 12 * 4), model)
    fast.forward = GraphedForward(model, fanouts, "cpu", max_seeds=8, capture=lambda fn: fn)
    assert fast.sampler.kernel and fast.sampler._small is not None and fast.features._one_kernel
    for seeds in ([299, 3, 17, 3, 100], [5], [0, 0], [], list(range(40, 0, -3)), [7, 6, 5, 4]):
        seeds = np.array(seeds, dtype=np.int64)
        want, got = plain.run(seeds), fast.run(seeds)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5)
        assert np.array_equal(got.predictions, want.predictions) and got.logits.shape[0] == len(seeds)
        assert got.sampled_edges == want.sampled_edges and got.gathered_rows == want.gathered_rows
    assert fast.forward.replays > 0 and fast.sampler._small is not None
