"""The GPU pipeline (its code on CPU tensors, --device emulate) behind a real engine and its HTTP
server on 127.0.0.1: routing, spills, placement refresh while requests flow."""

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
)
from hybridgnn.pipelines.gpu import DeviceExecutor
from tests.support.engine_client import body, counter, with_client


def emulated(tiny_dataset, tiny_model, threshold, **kw):
    return ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((5, 3)),
                       gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=2),
                       gpu_memory=DeviceMemoryConfig(cache_bytes=16 * 1024), router=RouterConfig(threshold), **kw)


def test_batches_route_by_psgs_threshold(tiny_dataset, tiny_model):
    async def scenario(engine, client):
        psgs = engine._tables.psgs
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
        assert engine._router.threshold == pytest.approx(64 * float(np.mean(engine._tables.psgs)), rel=1e-6)

    asyncio.run(with_client(emulated(tiny_dataset, tiny_model, None), scenario))


def test_placement_refresh_swaps_the_device_cache_while_requests_flow(tiny_dataset, tiny_model):
    async def scenario(engine, client):
        fap = engine._tables.fap
        cold = np.argsort(fap)[:20].tolist()  # the least likely rows under uniform seeds
        assert not any(engine._resources.gpu_features.current.slot[c] >= 0 for c in cold)
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
        assert all(int(engine._resources.gpu_features.current.slot[c]) >= 0 for c in cold)  # now cached
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


def test_the_split_cpu_lane_serves_through_the_device_stage(tiny_dataset, tiny_model):
    """--cpu-lane split: the CPU pipeline's workers sample; gathers go through the GPU
    pipeline's device cache, and the answers are the GPU pipeline's."""
    from hybridgnn.pipelines.split import SplitExecutor

    everything = (1 << 30, 1 << 30)
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig(everything),
                      cpu_pipeline=PipelineConfig(split=True, workers=2),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=1),
                      gpu_memory=DeviceMemoryConfig(cache_bytes=16 * 1024), router=RouterConfig(float("inf")))

    async def scenario(engine, client):
        ids = [[i, (7 * i) % 3000, 2999 - i] for i in range(40)]
        answers = await asyncio.gather(*(client.post("/v2/models/hybridgnn/infer", json=body(b)) for b in ids))
        assert [r.status for r in answers] == [200] * len(ids)
        got = [np.asarray((await r.json())["outputs"][0]["data"]).reshape(3, -1) for r in answers]
        device = engine._resources.make_executor("gpu", 0)
        for b, rows in zip(ids, got, strict=True):
            np.testing.assert_allclose(rows, device.run(np.asarray(b)).logits, rtol=1e-5, atol=1e-5)
        metrics = await (await client.get("/metrics")).text()
        assert counter(metrics, "hybridgnn_routing_decisions_total", pipeline="gpu", reason="threshold") == 0
        assert counter(metrics, "hybridgnn_gathered_rows_total", pipeline="cpu", tier="gpu") > 0  # the device cache
        workers = engine._pipelines["cpu"]._executors
        assert all(isinstance(w, SplitExecutor) for w in workers) and sum(w.handed_off for w in workers) >= 1
        assert engine.metadata()["cpu_lane"] == "split"
        assert engine.pending == 0

    asyncio.run(with_client(cfg, scenario))
