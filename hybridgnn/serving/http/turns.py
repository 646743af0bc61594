"""The event loop's share of answers per turn, and the connections waiting for a later one.

Why: libuv reads every ready connection in one poll phase (up to 48 × 1024 events) before
it runs any timer or completion. Under a flood of small requests on thousands of
connections, answers to admitted requests and the batcher's timers waited seconds behind
the parsing and refusing of new ones. With a share per turn, completions and timers run
every few milliseconds whatever the load. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol


class TakesTurns(Protocol):
    """A connection as Turns sees it: closed, or answers what it has queued when its turn comes."""

    closed: bool

    def take_turn(self) -> None: ...


class Turns:
    """How many requests the event loop answers per turn, and the connections waiting for
    a later one (FIFO). A turn ends when the loop runs the callback scheduled by the
    first answer taken in it, which is after the poll phase that read the requests."""

    def __init__(self, per_turn: int):
        if per_turn < 1:
            raise ValueError(f"answers per turn must be >= 1, got {per_turn}")
        self.per_turn = per_turn
        self.used = 0
        self.armed = False  # a new turn is scheduled
        self.waiting: collections.deque[tuple["TakesTurns", float]] = collections.deque()

    def take(self) -> bool:
        """Spend one answer of this turn's share; False once it is spent."""
        if self.used >= self.per_turn:
            return False
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_soon(self._new_turn)
        self.used += 1
        return True

    def wait(self, conn: "TakesTurns") -> None:
        self.waiting.append((conn, time.monotonic()))

    def oldest_wait_s(self) -> float:
        return time.monotonic() - self.waiting[0][1] if self.waiting else 0.0

    def _new_turn(self) -> None:
        self.armed = False
        self.used = 0
        waiting = self.waiting
        while waiting and self.used < self.per_turn:
            conn, _ = waiting.popleft()
            if not conn.closed:
                self.take()
                conn.take_turn()
