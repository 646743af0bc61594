"""A batch that fails on the GPU falls back to the CPU pipeline; when that fallback
cannot take it (stopped by a drain, say), its requests are answered with the failure
at once, never left waiting."""

from __future__ import annotations

import numpy as np

from hybridgnn.errors import BatchFailed
from hybridgnn.serving.core.sampled import SampledInference
from hybridgnn.types import Batch, InferenceRequest, RoutePlan


class _Stats:
    def batch_failed(self, pipeline):
        self.failed = pipeline

    def routed(self, pipeline, reason):
        self.routed_to = (pipeline, reason)


class _Router:
    def fallback(self, plan):
        return RoutePlan("cpu", plan.batch_psgs, "fallback")


class _Pipeline:
    def __init__(self, stopped: bool):
        self.stopped, self.taken = stopped, []

    def submit(self, batch, plan):
        if self.stopped:
            raise RuntimeError("pipeline cpu is stopped")
        self.taken.append((batch, plan))


class _Lane:
    def remove(self, psgs):
        pass


class _Batcher:
    def capacity_freed(self):
        pass


class _Engine(SampledInference):
    def __init__(self, cpu: _Pipeline):
        self.stats, self._router, self._batcher, self._sampled_lane = _Stats(), _Router(), _Batcher(), _Lane()
        self._pipelines = {"cpu": cpu}
        self.released = 0

    def release(self):
        self.released += 1


def _batch(answers: list) -> Batch:
    requests = [InferenceRequest(node_ids=np.array([i], dtype=np.int64), on_done=lambda r, e: answers.append((r, e)),
                                 arrival_s=0.0, psgs=1.0) for i in range(3)]
    return Batch(requests=requests, seeds=np.arange(3, dtype=np.int64), offsets=np.arange(4, dtype=np.int64),
                 psgs=3.0, closed_s=0.0)


def test_a_failed_gpu_batch_goes_to_the_cpu_pipeline():
    cpu = _Pipeline(stopped=False)
    engine, answers = _Engine(cpu), []
    batch = _batch(answers)
    engine._complete(batch, RoutePlan("gpu", 3.0, "threshold"), None, RuntimeError("CUDA error"))
    assert [p.reason for _, p in cpu.taken] == ["fallback"] and cpu.taken[0][0] is batch
    assert answers == [] and engine.stats.routed_to == ("cpu", "fallback")


def test_when_the_fallback_is_stopped_every_request_is_answered_with_the_failure():
    engine, answers = _Engine(_Pipeline(stopped=True)), []
    engine._complete(_batch(answers), RoutePlan("gpu", 3.0, "threshold"), None, RuntimeError("CUDA error"))
    assert len(answers) == 3 and engine.released == 3
    assert all(r is None and isinstance(e, BatchFailed) and "CUDA error" in str(e) for r, e in answers)


class _Depth:
    def __init__(self, depth: int, capacity: int):
        self.depth, self.capacity = depth, capacity


def test_the_server_is_quiet_only_while_no_pipeline_holds_a_batch():
    """The batcher skips its wait only on a quiet server: with any batch queued or running,
    in any pipeline, even one with idle workers, a new batch waits to fill (a worker that
    frees under load would otherwise take a few requests at a time)."""
    engine = _Engine(_Pipeline(stopped=False))
    engine._pipelines = {"cpu": _Depth(0, 2), "gpu": _Depth(1, 2)}
    assert engine._has_capacity() and not engine._is_quiet()
    engine._pipelines["gpu"] = _Depth(0, 2)
    assert engine._is_quiet()

