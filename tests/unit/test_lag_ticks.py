"""The engine's loop-lag timer (serving/core/admitting.py): fast ticks while requests come,
slow ones once nothing was admitted for a while, fast again at the next admission."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridgnn.scheduler.admission import Admission, Lane, LoopLag
from hybridgnn.serving.core import admitting
from hybridgnn.serving.core.admitting import Admitting


class _Engine(Admitting):
    def __init__(self):
        self._admission = Admission(0.1, [Lane("lookup", servers=1)])
        self._pending = 0
        self._idle = asyncio.Event()
        self._started = True
        self.draining = False
        self._refused_in_flight_cap = 0
        self._admitted_seed_psgs = 1.0

        class _Cfg:
            class batcher:
                max_pending_requests = 100

        self.cfg = _Cfg()


class _CountedLag(LoopLag):
    """A LoopLag that counts the ticks it is fed."""

    __slots__ = ("ticks",)

    def __init__(self):
        super().__init__()
        self.ticks = 0

    def observe(self, late_s: float) -> None:
        self.ticks += 1
        super().observe(late_s)


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


@pytest.fixture
def fast_ticks(monkeypatch):
    """1 ms ticks, idle after 5 quiet ones, and an idle period no test outlasts."""
    monkeypatch.setattr(admitting, "LAG_TICK_S", 0.001)
    monkeypatch.setattr(admitting, "LAG_IDLE_AFTER_TICKS", 5)
    monkeypatch.setattr(admitting, "LAG_IDLE_TICK_S", 3600.0)


def test_lag_ticks_slow_down_when_idle_and_speed_up_at_the_next_admission(fast_ticks):

    async def main():
        engine = _Engine()
        engine.start_lag_ticks()
        try:
            await _until(lambda: engine._lag_idle)
            slow_due = engine._lag_handle.when()
            assert slow_due - asyncio.get_running_loop().time() > 60  # the idle period, not the fast one
            engine.admit("lookup", 1.0)  # a request: fast ticks at once, and none idle while it is in flight
            assert not engine._lag_idle and engine._lag_handle.when() < slow_due
            counted = _CountedLag()
            engine._admission.loop_lag = counted
            await _until(lambda: counted.ticks >= 30)  # far past 5 quiet ticks, with a request in flight
            assert not engine._lag_idle
            engine._admission.lanes["lookup"].remove(1.0)
            engine.release()
            await _until(lambda: engine._lag_idle)
            engine.shed(0.0)  # a refusal checked before decoding counts as activity too
            assert not engine._lag_idle
        finally:
            engine.stop_lag_ticks()

    asyncio.run(main())


def test_lag_ticks_stopped_while_idle_are_not_woken_and_standing_refusals_wake_them(fast_ticks):

    async def main():
        engine = _Engine()
        engine.start_lag_ticks()
        await _until(lambda: engine._lag_idle)
        assert engine.shed_standing()  # a refusal for a standing queue is activity too
        assert not engine._lag_idle
        await _until(lambda: engine._lag_idle)
        stopped = engine._lag_handle
        engine.stop_lag_ticks()
        engine.admit("lookup", 1.0)  # after stop: no tick is scheduled again
        assert engine._lag_handle is stopped and stopped.cancelled()

    asyncio.run(main())


def test_a_wake_after_the_loop_closed_does_nothing(monkeypatch):
    monkeypatch.setattr(admitting, "LAG_IDLE_AFTER_TICKS", 0)
    monkeypatch.setattr(admitting, "LAG_IDLE_TICK_S", 3600.0)
    engine = _Engine()

    async def main():
        engine.start_lag_ticks()
        assert engine._lag_idle  # no quiet ticks needed: idle from the first

    asyncio.run(main())  # the loop closes with the engine never stopped
    engine.admit("lookup", 1.0)
    assert not engine._lag_idle
