"""The heterogeneous engine's batch completion: an executor that answers a different
number of queries than the batch holds fails every job of it, none is left unanswered."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hybridgnn.errors import BatchFailed
from hybridgnn.serving.core.hetero import HeteroEngine, _Job
from hybridgnn.types import RoutePlan


def test_a_result_count_that_does_not_match_the_batch_fails_every_job():
    async def scenario():
        loop = asyncio.get_running_loop()
        engine = HeteroEngine.__new__(HeteroEngine)  # only what _complete touches
        released = []
        engine._in_flight = set()
        engine._workers = {"cpu": SimpleNamespace(depth=1)}
        engine.stats = SimpleNamespace(batch_failed=lambda pipeline: None)
        engine._router = SimpleNamespace(fallback=lambda plan: (_ for _ in ()).throw(LookupError("none")))
        engine._sampled_lane = SimpleNamespace(remove=lambda psgs: None)
        engine.release = lambda: released.append(1)
        engine._pump = lambda: None
        jobs = [_Job(query=None, psgs=1.0, future=loop.create_future(), predicted_wait_s=0.0, num_seeds=1)
                for _ in range(3)]
        done = loop.create_future()
        done.set_result(["only one result"])
        engine._complete(done, jobs, RoutePlan("cpu", 3.0, "only"), 0.0)
        return [j.future.exception() for j in jobs], released

    errors, released = asyncio.run(scenario())
    assert len(released) == 3
    assert all(isinstance(e, BatchFailed) and "answered 1 of 3 queries" in str(e) for e in errors)


def test_a_completed_batch_counts_its_handoff_as_the_homogeneous_engine_does():
    """hybridgnn_stage_seconds{stage="handoff"} exists for the heterogeneous engine's
    pipelines too (declared at zero) but only the homogeneous engine observed it: a
    heterogeneous server's was always empty. It is the batch's time since it started,
    less its sample, gather and compute."""
    import time

    from hybridgnn.types import StageTimings

    async def scenario():
        loop = asyncio.get_running_loop()
        engine = HeteroEngine.__new__(HeteroEngine)
        stages = []
        engine._in_flight = set()
        engine._workers = {"cpu": SimpleNamespace(depth=1)}
        engine.stats = SimpleNamespace(batch_done=lambda *a: None,
                                       stage=lambda stage, pipeline, s: stages.append((stage, pipeline, s)))
        engine.model_stats = SimpleNamespace(executed=lambda: None)
        engine._sampled_lane = SimpleNamespace(observe=lambda *a: None, calibrate=lambda *a: None,
                                               completed=lambda *a: None, remove=lambda psgs: None)
        engine._admission = SimpleNamespace(bound_s=0.1)
        engine.release = lambda: None
        engine._pump = lambda: None
        jobs = [_Job(query=None, psgs=1.0, future=loop.create_future(), predicted_wait_s=0.0, num_seeds=1)]
        done = loop.create_future()
        done.set_result([SimpleNamespace(timings=StageTimings(sample_s=0.1, gather_s=0.2, compute_s=0.3))])
        began = time.perf_counter() - 1.0  # the batch started a second ago
        engine._complete(done, jobs, RoutePlan("cpu", 3.0, "only"), began)
        return stages

    handoff = [s for stage, pipeline, s in asyncio.run(scenario()) if stage == "handoff"]
    assert len(handoff) == 1 and 0.4 <= handoff[0] < 0.9, handoff


def test_a_lookup_lane_learns_its_cost_from_lookups_that_never_found_it_empty():
    """It learnt only from calls that found the lane empty: a client sending only bursts
    kept it unmeasured, and every heavy top-k of every burst was admitted."""
    import concurrent.futures
    import time

    from hybridgnn.scheduler.admission import MIN_BATCHES, Admission, Lane
    from hybridgnn.types import StageTimings, TypedResult

    def run(query, with_embeddings):
        time.sleep(0.002)
        return TypedResult("precomputed", StageTimings(gather_s=0.001, compute_s=0.003))

    async def scenario():
        engine = HeteroEngine.__new__(HeteroEngine)
        engine._lookup_pool = concurrent.futures.ThreadPoolExecutor(2)
        engine._precomputed = SimpleNamespace(run=run)
        engine.stats = SimpleNamespace(stage=lambda *a: None)
        engine._admission = Admission(0.1, [Lane("lookup", 2)])
        lane = engine.lane("lookup")
        for _ in range(MIN_BATCHES):  # every call of a burst: queued behind others
            lane.add(50.0)
        await asyncio.gather(*(engine._lookup(None, False, 50.0) for _ in range(MIN_BATCHES)))
        engine._lookup_pool.shutdown()
        return lane

    lane = asyncio.run(scenario())
    assert lane.measured and abs(lane.model_delay_s() - 8 * 50.0 * 0.004 / 50.0 / 2) < 1e-6
