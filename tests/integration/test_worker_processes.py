"""CPU workers in processes of their own: same outputs as in-process workers, errors
and exits surface as failed batches, the engine serves through them and stops them."""

import asyncio
import os
import signal

import numpy as np
import pytest

from hybridgnn.config import PipelineConfig, SamplingConfig, ServeConfig, UpdateConfig
from hybridgnn.pipelines.process import ProcessExecutor, WorkerProcessError
from hybridgnn.runtime.resources import build_worker_executor
from hybridgnn.serving.engine import Engine

EVERYTHING = (1 << 30, 1 << 30)  # fanouts that take every neighbour: sampling is deterministic


def config(tiny_dataset, tiny_model, fanouts=EVERYTHING, **pipe) -> ServeConfig:
    return ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig(fanouts),
                       cpu_pipeline=PipelineConfig(name="cpu", workers=1, **pipe))


def test_process_worker_matches_the_in_process_one_and_survives_its_child(tiny_dataset, tiny_model):
    cfg = config(tiny_dataset, tiny_model)
    seeds = np.array([3, 17, 17, 400, 2999])
    local = Engine(cfg).make_executor("cpu", 0).run(seeds)
    ex = ProcessExecutor(cfg, 0, build_worker_executor)
    try:
        remote = ex.run(seeds)
        np.testing.assert_array_equal(remote.logits, local.logits)
        np.testing.assert_array_equal(remote.embeddings, local.embeddings)
        np.testing.assert_array_equal(remote.predictions, local.predictions)
        assert remote.sampled_edges == local.sampled_edges and remote.gathered_rows == local.gathered_rows
        assert remote.timings.sample_s > 0 and remote.timings.compute_s > 0
        with pytest.raises(WorkerProcessError, match="seed ids must lie in"):
            ex.run(np.array([10**9]))  # the child reports the failure and lives on
        assert ex.run(seeds).predictions.tolist() == local.predictions.tolist()
        os.kill(ex._proc.pid, signal.SIGKILL)  # a child killed between batches is started again
        ex._proc.join()
        np.testing.assert_array_equal(ex.run(seeds).logits, local.logits)
    finally:
        ex.close()
    assert ex._proc is None


def test_engine_serves_through_worker_processes_and_stops_them(tiny_dataset, tiny_model):
    cfg = config(tiny_dataset, tiny_model, fanouts=(5, 3), processes=True)

    async def scenario():
        engine = Engine(cfg)
        await engine.start()
        children = [ex._proc for ex in engine.pipelines["cpu"]._executors]
        try:
            assert all(p.is_alive() for p in children)
            results = await asyncio.gather(*(engine.submit(np.array([i, i + 1])) for i in range(40)))
            assert all(r.logits.shape[0] == 2 for r in results)
        finally:
            await engine.stop()
        return children

    children = asyncio.run(scenario())
    assert all(not p.is_alive() for p in children)


def test_worker_processes_refuse_graph_updates_and_the_gpu_pipeline(tiny_dataset, tiny_model):
    with pytest.raises(ValueError, match="static graph"):
        ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, updates=UpdateConfig(token="t" * 16),
                    cpu_pipeline=PipelineConfig(processes=True))
    with pytest.raises(ValueError, match="CPU pipeline"):
        ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model,
                    gpu_pipeline=PipelineConfig(name="gpu", device="cpu", processes=True))
