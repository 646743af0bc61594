"""The event loop's share of answers per turn (serving/http/turns.py)."""

import asyncio
import time

import pytest

from hybridgnn.serving.http.turns import Turns, standing_queue_limits


class FakeConnection:
    def __init__(self, name, log, closed=False):
        self.name, self.log, self.closed = name, log, closed

    def take_turn(self):
        self.log.append(self.name)


def test_a_turn_answers_its_share_and_the_rest_wait_in_arrival_order():
    async def run():
        turns = Turns(2)
        log = []
        assert turns.take() and turns.take()
        assert not turns.take()  # this turn's share is spent
        for name in "abcde":
            turns.wait(FakeConnection(name, log))
        assert turns.oldest_wait_s() >= 0.0
        await asyncio.sleep(0)  # one turn of the loop
        assert log == ["a", "b"]
        await asyncio.sleep(0)
        assert log == ["a", "b", "c", "d"]
        await asyncio.sleep(0)
        assert log == list("abcde") and not turns.waiting and turns.oldest_wait_s() == 0.0
        await asyncio.sleep(0)
        assert not turns.armed  # nothing waits: no turn is scheduled

    asyncio.run(run())


def test_closed_connections_are_skipped_and_cost_no_share():
    async def run():
        turns = Turns(1)
        log = []
        assert turns.take() and not turns.take()
        turns.wait(FakeConnection("gone", log, closed=True))
        turns.wait(FakeConnection("b", log))
        await asyncio.sleep(0)
        assert log == ["b"]

    asyncio.run(run())


def test_the_share_must_be_positive():
    with pytest.raises(ValueError):
        Turns(0)


def _queue(turns, names, log, age_s):
    """Connections that have waited age_s, oldest first."""
    now = time.monotonic()
    for name in names:
        turns.wait(FakeConnection(name, log), since=now - age_s)


def test_a_queue_stands_once_its_oldest_wait_stays_over_the_target_for_an_interval():
    """CoDel's rule: a burst that drains within the interval is absorbed; a queue whose
    oldest wait stays over the target is cut: past the target a request is refused."""
    turns = Turns(4, target_s=0.01, interval_s=0.1)
    assert not turns.over_target(1.0)  # no queue stands yet
    turns._watch(0.02, now=5.0)  # over the target: the interval starts
    turns._watch(0.03, now=5.05)
    assert not turns.standing
    turns._watch(0.02, now=5.11)  # a whole interval over it
    assert turns.standing and turns.stood == 1
    assert turns.over_target(0.011) and not turns.over_target(0.009)
    turns._watch(0.01, now=5.2)  # back at the target: it stands no more
    assert not turns.standing and not turns.over_target(1.0)
    turns._watch(0.05, now=6.0)
    turns._watch(0.005, now=6.05)  # a break under the target restarts the interval
    turns._watch(0.05, now=6.12)
    assert not turns.standing


def test_turns_watch_the_oldest_wait():
    async def run():
        turns = Turns(1, target_s=0.01, interval_s=1e-6)
        log = []
        assert turns.take()
        _queue(turns, "abcd", log, age_s=0.5)
        await asyncio.sleep(0)
        assert log == ["a"] and not turns.standing  # first sight over the target
        await asyncio.sleep(0)
        assert log == ["a", "b"] and turns.standing  # still over it an interval later
        turns.waiting.clear()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not turns.standing  # nothing waits: the queue is gone

    asyncio.run(run())


def test_a_queue_served_to_the_end_stands_no_more_and_a_light_load_schedules_nothing():
    async def run():
        turns = Turns(1, target_s=0.01, interval_s=1e-6)
        log = []
        assert turns.take() and not turns.armed  # a share not spent asks the loop for nothing
        _queue(turns, "abc", log, age_s=0.5)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert turns.standing
        await asyncio.sleep(0)
        assert log == ["a", "b", "c"] and not turns.standing and not turns.armed
        assert not turns.over_target(1.0)

    asyncio.run(run())


@pytest.mark.parametrize("bound, target, interval", [(0.1, 0.025, 0.1), (0.01, 0.005, 0.01), (0.002, 0.002, 0.002)])
def test_standing_queue_limits_follow_the_admission_bound(bound, target, interval):
    assert standing_queue_limits(bound) == pytest.approx((target, interval))


def test_target_and_interval_must_be_positive():
    with pytest.raises(ValueError):
        Turns(4, target_s=0.0)
