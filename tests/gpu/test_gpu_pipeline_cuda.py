"""CUDA-only checks of the GPU pipeline (marker gpu; skipped without CUDA): pinning and
UVA views, both graph placements, the device sampler's distribution, the device feature
cache, per-worker streams, and the hybrid engine on a real GPU."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from hybridgnn.features.store import CachedFeatureStore, HostFeatureStore
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.checkpoint import load_checkpoint
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler
from tests.support.graphs import make_graph

pytestmark = pytest.mark.gpu
EVERYTHING = (1 << 30, 1 << 30)


def test_uva_view_reads_host_memory_without_a_copy(skewed_graph):
    dg = DeviceGraph(skewed_graph, "cuda", "uva")
    host = np.arange(1000, dtype=np.int64)
    view = dg.host_visible(host)
    assert view.is_cuda and torch.equal(view.cpu(), torch.from_numpy(host))
    host[7] = -5  # the device reads the same physical memory
    assert int(view[7]) == -5
    assert dg.indices.is_cuda and torch.equal(dg.indices.cpu(), torch.from_numpy(np.asarray(skewed_graph.indices)))
    assert len(dg.registration.pointers) >= 1
    dg.close()
    assert dg.registration.pointers == []


def test_uva_and_device_placements_sample_identically(skewed_graph):
    uva, gpu = DeviceGraph(skewed_graph, "cuda", "uva"), DeviceGraph(skewed_graph, "cuda", "gpu")
    assert not gpu.indices.data_ptr() == uva.indices.data_ptr()
    a = TorchSampler(uva.indptr, uva.indices, (4, 3), seed=5).sample(np.arange(30))
    b = TorchSampler(gpu.indptr, gpu.indices, (4, 3), seed=5).sample(np.arange(30))
    assert torch.equal(a.node_ids, b.node_ids) and torch.equal(a.edge_index, b.edge_index)
    uva.close()


@pytest.mark.parametrize("kernel,whole_batch", [(False, "0"), (True, "0"), (True, "1")],
                         ids=["torch-ops", "cuda-per-hop", "cuda-whole-batch"])
def test_cuda_sampler_draws_neighbours_uniformly(tmp_path, monkeypatch, kernel, whole_batch):
    monkeypatch.setenv("HYBRIDGNN_CUDA_BATCH", whole_batch)
    if kernel:
        pytest.importorskip("cupy")
    graph = make_graph(tmp_path / "star", [(0, j) for j in range(1, 41)], 41)
    dg = DeviceGraph(graph, "cuda", "uva")
    sampler = TorchSampler(dg.indptr, dg.indices, (10,), seed=1, kernel=kernel)
    trials = 4000
    counts = np.zeros(41)
    for _ in range(trials):
        sub = sampler.sample(np.array([0]))
        ids = sub.node_ids.cpu().numpy()
        assert len(set(ids.tolist())) == 11
        counts[ids[1:]] += 1
    expected = trials * 10 / 40
    assert (((counts[1:] - expected) ** 2) / expected).sum() < 90  # 39 dof
    dg.close()


@pytest.mark.parametrize("whole_batch", ["0", "1"], ids=["per-hop", "whole-batch"])
@pytest.mark.parametrize("placement", ["uva", "gpu"])
def test_cuda_kernel_hop_keeps_the_subgraph_contract(skewed_graph, monkeypatch, placement, whole_batch):
    """The one-launch hop against the torch-op reference: same nodes per hop count rule,
    every edge a real in-edge, no neighbour twice per target, deterministic per seed."""
    pytest.importorskip("cupy")
    monkeypatch.setenv("HYBRIDGNN_CUDA_BATCH", whole_batch)
    dg = DeviceGraph(skewed_graph, "cuda", placement)
    indptr, indices = np.asarray(skewed_graph.indptr), np.asarray(skewed_graph.indices)
    seeds = np.random.default_rng(0).choice(skewed_graph.num_nodes, 40, replace=False)
    fast = TorchSampler(dg.indptr, dg.indices, (5, 3), seed=7, kernel=True)
    ref = TorchSampler(dg.indptr, dg.indices, (5, 3), seed=7, kernel=False)
    a, b = fast.sample(seeds), ref.sample(seeds)
    assert a.num_sampled_edges[0] == b.num_sampled_edges[0]  # min(deg, fanout) per seed either way
    assert a.num_sampled_nodes[0] == b.num_sampled_nodes[0] == 40
    nodes, (src, dst) = a.node_ids.cpu().numpy(), a.edge_index.cpu().numpy()
    pairs = set()
    for s_, d_ in zip(nodes[src], nodes[dst], strict=True):
        assert s_ in indices[indptr[d_]:indptr[d_ + 1]]
        pairs.add((s_, d_))
    assert len(pairs) == len(src)
    again = TorchSampler(dg.indptr, dg.indices, (5, 3), seed=7, kernel=True).sample(seeds)
    assert torch.equal(again.node_ids, a.node_ids) and torch.equal(again.edge_index, a.edge_index)
    dg.close()


@pytest.mark.parametrize("cache_fraction", [0.0, 0.2, 1.0])
def test_device_cache_gathers_exact_rows(skewed_graph, cache_fraction):
    feats = np.asarray(skewed_graph.features)
    dg = DeviceGraph(skewed_graph, "cuda", "uva")
    store = CachedFeatureStore(feats, "cuda", int(cache_fraction * feats.nbytes), order=np.arange(60)[::-1].copy(),
                               host_table=dg.host_visible(feats))
    ids = np.random.default_rng(0).integers(0, 60, 500)
    rows, tiers = store.gather_counted(ids)
    assert rows.is_cuda and torch.equal(rows.cpu(), torch.from_numpy(feats[ids]))
    assert tiers["gpu"] + tiers["host"] == 500
    dg.close()


def test_device_executor_matches_cpu_and_workers_use_their_own_streams(tiny_dataset, tiny_model):
    graph = GraphStore.open(tiny_dataset)
    model, _ = load_checkpoint(tiny_model)
    seeds = np.array([3, 17, 17, 400, 2999])
    want = BatchExecutor(CPUSampler(graph, EVERYTHING), HostFeatureStore(graph.features), model).run(seeds)
    dg = DeviceGraph(graph, "cuda", "uva")
    store = CachedFeatureStore(graph.features, "cuda", 1 << 16, host_table=dg.host_visible(np.asarray(graph.features)))
    gpu_model = load_checkpoint(tiny_model)[0].to("cuda")
    executors = [DeviceExecutor(TorchSampler(dg.indptr, dg.indices, EVERYTHING, seed=i), store, gpu_model)
                 for i in range(3)]
    assert len({ex.stream.cuda_stream for ex in executors}) == 3
    results = [None] * 3

    def work(i):
        results[i] = [executors[i].run(seeds) for _ in range(20)][-1]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for res in results:
        np.testing.assert_allclose(res.logits, want.logits, rtol=1e-4, atol=1e-4)
    dg.close()


def test_hybrid_engine_on_cuda(tiny_dataset, tiny_model):
    from hybridgnn.config import (
        PipelineConfig,
        RouterConfig,
        SamplingConfig,
        ServeConfig,
    )
    from tests.support.engine_client import body, counter, with_client

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cuda"), router=RouterConfig(0.0))

    async def scenario(engine, client):
        assert (await client.post("/v2/models/hybridgnn/infer", json=body([1, 2, 3]))).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert counter(metrics, "hybridgnn_routing_decisions_total", pipeline="gpu", reason="threshold") == 1

    asyncio.run(with_client(cfg, scenario))


def test_tiered_store_on_cuda_reads_every_tier_exactly(tmp_path):
    from hybridgnn.features.gather import TieredFeatureStore
    from hybridgnn.features.placement import fap_plan
    from hybridgnn.features.topology import Topology

    gpus = torch.cuda.device_count()
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((2000, 16)).astype(np.float32)
    topo = Topology(gpus_per_server=gpus, nvlink_cliques=1, gpu_memory_bytes=200 * 64, host_memory_bytes=800 * 64)
    plan = fap_plan(rng.pareto(1.2, 2000), topo, 64)
    dg_views = []

    def host_view(array):
        from hybridgnn.graph.uva import HostRegistration, uva_view

        reg = HostRegistration()
        assert reg.register(array)
        dg_views.append(reg)
        return uva_view(array, torch.device("cuda", 0))

    store = TieredFeatureStore(feats, plan, device="cuda:0", gpu=0, plan_dir=tmp_path, host_view=host_view)
    ids = rng.integers(0, 2000, 5000)
    rows, tiers = store.gather_counted(ids)
    assert rows.is_cuda and torch.equal(rows.cpu(), torch.from_numpy(feats[ids]))
    assert tiers["gpu"] > 0 and tiers["host"] > 0 and tiers["disk"] > 0
    for reg in dg_views:
        reg.release()


def _bounded_degree_graph(path, num_nodes=400, max_degree=6, seed=3):
    rng = np.random.default_rng(seed)
    edges = [(i, int(j)) for i in range(num_nodes)
             for j in rng.choice(num_nodes, size=int(rng.integers(0, max_degree + 1)), replace=False)]
    return make_graph(path, edges, num_nodes)


@pytest.mark.parametrize("placement", ["uva", "gpu"])
def test_device_batch_path_reaches_what_the_reference_reaches(tmp_path, monkeypatch, placement):
    """With fanouts >= every degree the sample is fixed, so the all-kernel batch path
    (new nodes numbered on the device) must reach the same nodes per hop and the same
    edges as the torch-op reference, and leave its scratch maps clean."""
    pytest.importorskip("cupy")
    from hybridgnn.sampling import cuda_hop

    monkeypatch.setenv("HYBRIDGNN_CUDA_BATCH", "1")
    graph = _bounded_degree_graph(tmp_path / "g")
    dg = DeviceGraph(graph, "cuda", placement)
    fast = TorchSampler(dg.indptr, dg.indices, (6, 6, 6), seed=1, kernel=True)
    ref = TorchSampler(dg.indptr, dg.indices, (6, 6, 6), seed=1, kernel=False)
    for seeds in (np.array([5]), np.array([3, 3, 9, 399, 0]), np.arange(0, 400, 7), np.array([], dtype=np.int64)):
        a, b = fast.sample(seeds), ref.sample(seeds)
        assert a.num_sampled_nodes == b.num_sampled_nodes and a.num_sampled_edges == b.num_sampled_edges
        na, nb = a.node_ids.cpu().numpy(), b.node_ids.cpu().numpy()
        bounds = np.cumsum([0] + a.num_sampled_nodes)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            assert set(na[lo:hi]) == set(nb[lo:hi])
        ea, eb = a.edge_index.cpu().numpy(), b.edge_index.cpu().numpy()
        assert sorted(zip(na[ea[0]], na[ea[1]], strict=True)) == sorted(zip(nb[eb[0]], nb[eb[1]], strict=True))
        # each hop's new nodes are numbered in the order their first edge appears
        ends = np.cumsum([0] + a.num_sampled_edges)
        for hop in range(len(a.num_sampled_edges)):
            firsts = [v for v in dict.fromkeys(ea[0][ends[hop]:ends[hop + 1]].tolist()) if v >= bounds[hop + 1]]
            assert firsts == list(range(bounds[hop + 1], bounds[hop + 2]))
        assert np.array_equal(na[a.seed_index.cpu().numpy()], seeds)
        # edges are ordered by hop: each hop's targets come from that hop's frontier
        ends = np.cumsum([0] + a.num_sampled_edges)
        for hop, (lo, hi) in enumerate(zip(ends[:-1], ends[1:], strict=True)):
            assert ((ea[1][lo:hi] >= bounds[hop]) & (ea[1][lo:hi] < bounds[hop + 1])).all()
    assert bool((fast._local == -1).all()) and bool((fast._bid == cuda_hop.INT64_MAX).all())
    dg.close()


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 100), (torch.float32, 3), (torch.float16, 7), (torch.float32, 64)])
def test_one_kernel_gather_equals_the_torch_op_gather(tmp_path, monkeypatch, dtype, dim):
    pytest.importorskip("cupy")
    from hybridgnn.graph.uva import HostRegistration, uva_view

    rng = np.random.default_rng(0)
    feats = rng.standard_normal((3000, dim)).astype(np.float16 if dtype == torch.float16 else np.float32)
    reg = HostRegistration()
    assert reg.register(feats)
    host = uva_view(feats, torch.device("cuda", 0))
    order = rng.permutation(3000)
    monkeypatch.setenv("HYBRIDGNN_CUDA_GATHER", "1")
    fast = CachedFeatureStore(feats, "cuda", 700 * feats.itemsize * dim, order=order, host_table=host)
    monkeypatch.setenv("HYBRIDGNN_CUDA_GATHER", "0")
    slow = CachedFeatureStore(feats, "cuda", 700 * feats.itemsize * dim, order=order, host_table=host)
    assert fast._one_kernel and not slow._one_kernel
    for ids in (rng.integers(0, 3000, 5000), order[:700], np.array([], dtype=np.int64), np.array([order[-1]])):
        (a, ta), (b, tb) = fast.gather_counted(ids), slow.gather_counted(ids)
        assert torch.equal(a.cpu(), torch.from_numpy(feats[ids])) and torch.equal(a, b) and ta == tb
    reg.release()


@pytest.mark.parametrize("placement", ["uva", "gpu"])
def test_one_launch_small_batches_equal_the_batch_kernels(tmp_path, monkeypatch, placement):
    """cuda_small's one-block kernel samples what sample_batch samples, bit for bit, with
    the same per-hop random seeds, over many batches (rows above and below the fanouts,
    repeated seeds, batches past one block's width), and leaves the scratch maps clean."""
    pytest.importorskip("cupy")
    from hybridgnn.sampling import cuda_hop, cuda_small

    monkeypatch.setenv("HYBRIDGNN_CUDA_BATCH", "1")
    graph = _bounded_degree_graph(tmp_path / "g", num_nodes=3000, max_degree=40)
    dg = DeviceGraph(graph, "cuda", placement)
    local = torch.full((3000,), -1, dtype=torch.int64, device="cuda")
    bid = torch.full((3000,), cuda_hop.INT64_MAX, dtype=torch.int64, device="cuda")
    rng = np.random.default_rng(0)
    for fanouts in ((15, 10, 5), (25, 10), (3,), (40, 40)):
        small = cuda_small.SmallBatches(dg.indptr, dg.indices, fanouts, limit=10**6)
        for count in (1, 1, 2, 7, 35, 300):
            seeds = torch.from_numpy(rng.choice(3000, count, replace=False).astype(np.int64))
            hop_seeds = [int(x) for x in rng.integers(0, 1 << 64, len(fanouts), dtype=np.uint64)]  # top bit too
            staged, at = small.stage(seeds, torch.arange(count), hop_seeds)
            got = small.sample(staged, count, local, bid)
            want = cuda_hop.sample_batch(dg.indptr, dg.indices, seeds.cuda(), fanouts, hop_seeds, local, bid)
            assert got[2:] == want[2:], (fanouts, count)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (fanouts, count)
            assert torch.equal(staged[at:].cpu(), torch.arange(count))
    assert bool((local == -1).all()) and bool((bid == cuda_hop.INT64_MAX).all())
    # through the sampler: small batches take the one launch, keep it after the first check
    sampler = TorchSampler(dg.indptr, dg.indices, (15, 10, 5), seed=3, kernel=True)
    assert sampler._small is not None
    for _ in range(20):
        sub = sampler.sample(rng.integers(0, 3000, int(rng.integers(1, 20))))
        assert sub.edge_index.is_contiguous()
        assert sub.edge_index.numel() == 0 or int(sub.edge_index.max()) < sub.node_ids.shape[0]
    assert sampler._small is not None and sampler._small_checked
    dg.close()
