"""The event loop's share of answers per turn (serving/http/turns.py)."""

import asyncio

import pytest

from hybridgnn.serving.http.turns import Turns


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
