"""A bench stopped by SIGINT or SIGTERM: the signal becomes a future (stop_signals), the
load ends at it (run_until_stopped), and the command exits 128 + the signal's number."""

from __future__ import annotations

import asyncio
import signal

import pytest

from hybridgnn.bench.stopping import exit_code, run_until_stopped, stop_signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_becomes_the_futures_result_and_the_handlers_are_put_back(sig):
    before = signal.getsignal(sig)

    async def scenario():
        async with stop_signals() as stop:
            signal.raise_signal(sig)
            signal.raise_signal(sig)  # a second one changes nothing
            return await asyncio.wait_for(stop, 5)

    assert asyncio.run(scenario()) == sig.name
    assert signal.getsignal(sig) == before


def test_work_runs_to_its_end_unless_stopped_first():
    async def scenario():
        stop = asyncio.get_running_loop().create_future()
        done = await run_until_stopped(asyncio.sleep(0), stop)
        reached = []

        async def endless():
            reached.append("started")
            await asyncio.sleep(3600)
            reached.append("never")

        asyncio.get_running_loop().call_soon(stop.set_result, "SIGINT")
        stopped = await run_until_stopped(endless(), stop)
        return done, stopped, reached, await run_until_stopped(asyncio.sleep(0), None)

    assert asyncio.run(scenario()) == (None, "SIGINT", ["started"], None)


def test_the_works_own_failure_is_raised_not_taken_for_a_stop():
    async def failing():
        raise RuntimeError("the server went away")

    async def scenario():
        return await run_until_stopped(failing(), asyncio.get_running_loop().create_future())

    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(scenario())


def test_the_exit_status_is_128_plus_the_signals_number():
    assert (exit_code("SIGINT"), exit_code("SIGTERM"), exit_code(None)) == (130, 143, 0)
