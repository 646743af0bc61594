"""What every engine kind admits by (serving/core/admitting.py): the in-flight cap, start
and drain, shedding before decoding, and what a lane's cost model learns from."""

from __future__ import annotations

import asyncio

import pytest

from hybridgnn.errors import Draining, Overloaded
from hybridgnn.scheduler.admission import MIN_BATCHES, Admission, Lane
from hybridgnn.serving.core.admitting import Admitting


class _Engine(Admitting):
    def __init__(self, lane: Lane, max_pending: int = 100, started: bool = True):
        self._admission = Admission(0.1, [lane])
        self._pending = 0
        self._idle = asyncio.Event()
        self._started = started
        self.draining = False
        self.ready = started
        self._refused_in_flight_cap = 0
        self._admitted_seed_psgs = 1.0

        class _Cfg:
            class batcher:
                max_pending_requests = max_pending

        self.cfg = _Cfg()


def _measured(name: str, seconds_per_unit: float) -> Lane:
    lane = Lane(name, 1)
    for _ in range(MIN_BATCHES):
        lane.observe(1, seconds_per_unit)
    return lane


def test_the_in_flight_cap_refuses_the_request_past_it():
    engine = _Engine(Lane("lookup", 1), max_pending=2)
    engine.admit("lookup", 1)
    engine.admit("lookup", 1)
    with pytest.raises(Overloaded, match=r"2 requests in flight \(limit 2\)"):
        engine.admit("lookup", 1)
    assert engine.pending == 2 and engine._refused_in_flight_cap == 1
    engine.release()
    engine.admit("lookup", 1)


def test_a_starting_engine_refuses_with_503_and_counts_no_standing_refusal():
    engine = _Engine(Lane("lookup", 1), started=False)
    with pytest.raises(Draining, match="server is starting") as info:
        engine.admit("lookup", 1)
    assert info.value.status == 503 and engine.pending == 0
    assert engine.shed_standing() is False and engine._admission.refused == 0
    engine._started = True
    assert engine.shed_standing() is True and engine._admission.refused_standing == 1


def test_shedding_judges_the_sampled_lane_by_the_work_a_requests_seeds_bring():
    engine = _Engine(_measured("sampled", 1.0))  # a second a unit of PSGS
    engine._admitted_seed_psgs = 5.0
    engine.lane("sampled").add(0.01)
    engine.shed(0.0, "sampled", seeds=0)
    with pytest.raises(Overloaded):
        engine.shed(0.0, "sampled", seeds=1)  # 5 s of work behind what is queued


def test_a_lane_learns_only_from_calls_that_found_it_empty():
    async def call():
        return "ok"

    async def run():
        lane = Lane("lookup", 1)
        engine = _Engine(lane)
        assert await engine.run_in_lane("lookup", 1.0, call) == "ok"
        assert lane._n == 1
        lane.add(5.0)  # work ahead of the next call: its time is partly waiting
        await engine.run_in_lane("lookup", 1.0, call)
        assert lane._n == 1 and lane.queued == 5.0 and engine.pending == 0

    asyncio.run(run())
