"""The GPU pipeline's code on CPU tensors: device feature cache, device executor, the
hybrid engine (routing by threshold, spill, fallback to the CPU pipeline), config."""

import asyncio

import numpy as np
import pytest
import torch

from hybridgnn.config import (
    DeviceMemoryConfig,
    PipelineConfig,
    RouterConfig,
    SamplingConfig,
    ServeConfig,
    parse_bytes,
)
from hybridgnn.features.store import CachedFeatureStore, HostFeatureStore, hottest_first
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.checkpoint import load_checkpoint
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler
from hybridgnn.testing.engine_client import body, counter, with_client

EVERYTHING = (1 << 30, 1 << 30)  # fanouts that take every neighbour: sampling is deterministic


@pytest.mark.parametrize("cache_rows", [0, 7, 40, 60])
def test_cached_store_returns_exactly_the_source_rows(skewed_graph, cache_rows):
    feats = np.asarray(skewed_graph.features)
    order = np.random.default_rng(0).permutation(60)
    store = CachedFeatureStore(feats, "cpu", cache_rows * feats.shape[1] * 4, order=order)
    assert store.cached_rows == cache_rows
    ids = np.random.default_rng(1).integers(0, 60, size=200)
    rows, tiers = store.gather_counted(ids)
    assert torch.equal(rows, torch.from_numpy(feats[ids]))
    hot = set(order[:cache_rows].tolist())
    assert tiers == {"gpu": sum(i in hot for i in ids.tolist()), "host": sum(i not in hot for i in ids.tolist())}
    assert store.rows_by_tier(ids) == tiers


def test_hottest_first_orders_by_fap_with_stable_ties():
    assert hottest_first(np.array([0.1, 0.5, 0.1, 0.9])).tolist() == [3, 1, 0, 2]


def test_device_executor_matches_the_cpu_executor_when_sampling_is_deterministic(tiny_dataset, tiny_model):
    graph = GraphStore.open(tiny_dataset)
    model, _ = load_checkpoint(tiny_model)
    seeds = np.array([3, 17, 17, 400, 2999])
    cpu = BatchExecutor(CPUSampler(graph, EVERYTHING), HostFeatureStore(graph.features), model).run(seeds)
    dg = DeviceGraph(graph, "cpu")
    dev = DeviceExecutor(TorchSampler(dg.indptr, dg.indices, EVERYTHING),
                         CachedFeatureStore(graph.features, "cpu", 64 * 1024), model).run(seeds)
    np.testing.assert_allclose(dev.embeddings, cpu.embeddings, rtol=1e-5, atol=1e-5)
    assert np.array_equal(dev.predictions, cpu.predictions)
    assert dev.sampled_edges == cpu.sampled_edges
    assert sum(dev.gathered_rows.values()) == sum(cpu.gathered_rows.values())


def emulated(tiny_dataset, tiny_model, threshold, **kw):
    return ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                       gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=2),
                       gpu_memory=DeviceMemoryConfig(cache_bytes=16 * 1024), router=RouterConfig(threshold), **kw)








def test_batches_route_by_psgs_threshold(tiny_dataset, tiny_model):
    async def scenario(engine, client):
        psgs = engine.tables.psgs
        small = [int(np.argmin(psgs))]
        large = np.argsort(-psgs)[:50].tolist()
        assert sum(psgs[large]) > 30 > psgs[small[0]]
        for ids in (small, large):
            r = await client.post("/v2/models/hybridgnn/infer", json=body(ids))
            assert r.status == 200
            assert (await r.json())["outputs"][0]["shape"][0] == len(ids)
        metrics = await (await client.get("/metrics")).text()
        assert counter(metrics, "hybridgnn_routing_decisions_total", pipeline="cpu", reason="threshold") == 1
        assert counter(metrics, "hybridgnn_routing_decisions_total", pipeline="gpu", reason="threshold") == 1
        assert counter(metrics, "hybridgnn_gathered_rows_total", pipeline="gpu", tier="gpu") > 0
        meta = await (await client.get("/v2/models/hybridgnn")).json()
        assert meta["parameters"]["pipelines"] == ["cpu", "gpu"] and meta["parameters"]["psgs_threshold"] == 30

    asyncio.run(with_client(emulated(tiny_dataset, tiny_model, 30.0), scenario))


def test_a_failing_gpu_batch_is_retried_on_the_cpu_pipeline(tiny_dataset, tiny_model, monkeypatch):
    def out_of_memory(self, seeds, timings=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    async def scenario(engine, client):
        monkeypatch.setattr(DeviceExecutor, "run", out_of_memory)
        r = await client.post("/v2/models/hybridgnn/infer", json=body([1, 2, 3]))
        assert r.status == 200  # answered by the CPU pipeline
        metrics = await (await client.get("/metrics")).text()
        assert counter(metrics, "hybridgnn_batch_errors_total", pipeline="gpu") == 1
        assert counter(metrics, "hybridgnn_routing_decisions_total", pipeline="cpu", reason="fallback") == 1
        assert engine.pending == 0

    asyncio.run(with_client(emulated(tiny_dataset, tiny_model, 0.0), scenario))


def test_default_threshold_with_two_pipelines(tiny_dataset, tiny_model):
    async def scenario(engine, client):
        assert engine.router.threshold == pytest.approx(64 * float(np.mean(engine.tables.psgs)), rel=1e-6)

    asyncio.run(with_client(emulated(tiny_dataset, tiny_model, None), scenario))


def test_config_checks():
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("0") == 0
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="graph_placement"):
        DeviceMemoryConfig(graph_placement="disk")
    with pytest.raises(ValueError, match="pipeline device"):
        ServeConfig(dataset_dir=".", model_dir=".", gpu_pipeline=PipelineConfig(name="gpu", device="tpu"))
    with pytest.raises(ValueError, match="named 'gpu'"):
        ServeConfig(dataset_dir=".", model_dir=".", gpu_pipeline=PipelineConfig(name="cpu", device="cuda"))
    with pytest.raises(ValueError, match="cpu, cuda"):
        ServeConfig(dataset_dir=".", model_dir=".", cpu_pipeline=PipelineConfig(device="mps"))


def test_placement_refresh_swaps_the_device_cache_while_requests_flow(tiny_dataset, tiny_model):
    async def scenario(engine, client):
        fap = engine.tables.fap
        cold = np.argsort(fap)[:20].tolist()  # the least likely rows under uniform seeds
        assert not any(engine.gpu_features.current.slot[c] >= 0 for c in cold)
        for _ in range(5):
            assert (await client.post("/v2/models/hybridgnn/infer", json=body(cold))).status == 200

        async def traffic():
            codes = []
            for i in range(30):
                r = await client.post("/v2/models/hybridgnn/infer", json=body(cold[i % 20:i % 20 + 3]))
                codes.append(r.status)
            return codes

        report, codes = await asyncio.gather(engine.refresh_placement(), traffic())
        assert set(codes) == {200}
        assert report["requests_counted"] >= 5 * 20
        assert all(int(engine.gpu_features.current.slot[c]) >= 0 for c in cold)  # now cached
        metrics = await (await client.get("/metrics")).text()
        assert counter(metrics, "hybridgnn_placement_refreshes_total") == 1

    asyncio.run(with_client(emulated(tiny_dataset, tiny_model, 0.0), scenario))


def test_refresh_without_a_gpu_cache_or_requests_is_a_clear_error(tiny_dataset, tiny_model):
    async def scenario(engine, client):
        with pytest.raises(LookupError, match="no requests counted"):
            await engine.refresh_placement()

    asyncio.run(with_client(emulated(tiny_dataset, tiny_model, 0.0), scenario))

    async def cpu_only(engine, client):
        with pytest.raises(LookupError, match="CPU pipeline only"):
            await engine.refresh_placement()

    asyncio.run(with_client(ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model,
                                        sampling=SamplingConfig((5, 3))), cpu_only))
