"""Stopping a load early on SIGINT or SIGTERM with what it measured so far.

A user who stops a long bench (Ctrl-C, or a supervisor's SIGTERM) wants the report of
the requests already answered, not nothing. `stop_signals` turns either signal into a
future whose result is the signal's name; the load generator runs its sending and
draining under `run_until_stopped`, which ends them when that future is done first, and
reports the requests sent until then as an interrupted (partial) result. The command
then exits 128 + the signal's number (130, 143), as a shell reports a signal's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.asynccontextmanager
async def stop_signals():
    """A future, done with the signal's name ("SIGINT", "SIGTERM") once one of
    STOP_SIGNALS arrives; the signals' own handlers are back afterwards."""
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def stopped(sig: signal.Signals) -> None:
        if not stop.done():
            stop.set_result(sig.name)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stopped, sig)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def run_until_stopped(work, stop: asyncio.Future | None) -> str | None:
    """Await the coroutine `work`, unless `stop` is done first: then `work` is cancelled
    (it stops sending; what it started stays as it is) and stop's result is returned.
    None when `work` ran to its end (its exception, if any, raised)."""
    if stop is None:
        await work
        return None
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # stopped, or this coroutine itself cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not task.cancelled():
        task.result()  # ran to its end, perhaps as stop came: the whole run, or its exception
        return None
    return stop.result()


def exit_code(name: str | None) -> int:
    """The exit status of a command a signal named `name` stopped (128 + its number), 0
    for None."""
    return 128 + int(signal.Signals[name]) if name else 0
