"""The event loop's share of answers per turn, and the connections waiting for a later one.

Why: libuv reads every ready connection in one poll phase (up to 48 × 1024 events) before
it runs any timer or completion. Under a flood of small requests on thousands of
connections, answers to admitted requests and the batcher's timers waited seconds behind
the parsing and refusing of new ones. With a share per turn, completions and timers run
every few milliseconds whatever the load.

Why a queue that stands is cut short (CoDel's rule: a queue whose shortest wait stays
over a target for an interval is not absorbing a burst, it is standing). At one seed per
request a refusal costs the loop a third to a half of what an answer does: both are a
read and a write on a socket (measured: 22–31 µs of server CPU per refusal, about 70 µs
per answer, 13 µs of either in Python). So refusing the requests that wait
past the admission bound does not drain a queue that formed in a burst when requests
arrive about as fast as the loop handles them: it stood at the bound, every request waited
close to it and about half were refused (measured at 12,000 req/s on one core: 5,400
answered per second, against 11,800 in runs where no queue formed). Once the oldest
waiting request has waited over `target_s` for `interval_s` without a break, the queue
stands: until it is back under the target, a request that waited over the target is
refused at its turn (`over_target`), which drains it in a fraction of a second. Event loop
thread only.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol


def standing_queue_limits(bound_s: float) -> tuple[float, float]:
    """(target_s, interval_s) for an admission bound: a quarter of the bound, at least 5 ms
    (a turn takes a few ms under load) but not over the bound; the interval is the bound."""
    return min(bound_s, max(bound_s / 4, 0.005)), bound_s


class TakesTurns(Protocol):
    """A connection as Turns sees it: closed, or answers what it has queued when its turn comes."""

    closed: bool

    def take_turn(self) -> None: ...


class Turns:
    """How many requests the event loop answers per turn, and the connections waiting for
    a later one (FIFO). The share is counted until a connection has to wait; then the loop
    is asked for a callback, which runs after the poll phase that read the requests: it
    starts a new turn (the share counts from zero) and answers the waiting in order, turn
    after turn until none waits. Each such turn also looks at the oldest wait, which says
    whether the queue stands. (At a light load no callback is scheduled at all: one per
    request cost the loop a callback and a system call each, for a share never spent.)"""

    def __init__(self, per_turn: int, target_s: float = float("inf"), interval_s: float = float("inf")):
        if per_turn < 1:
            raise ValueError(f"answers per turn must be >= 1, got {per_turn}")
        if not (target_s > 0 and interval_s > 0):
            raise ValueError(f"the target and interval of a standing queue must be > 0, got {target_s}, {interval_s}")
        self.per_turn = per_turn
        self.target_s = target_s
        self.interval_s = interval_s
        self.standing = False  # the queue stands: requests past the target are refused
        self.stood = 0  # times a queue was found standing (diagnostics)
        self._above_since: float | None = None  # the oldest wait has been over the target since
        self.used = 0
        self.armed = False  # a new turn is scheduled
        self.waiting: collections.deque[tuple["TakesTurns", float]] = collections.deque()

    def take(self) -> bool:
        """Spend one answer of this turn's share; False once it is spent (then wait())."""
        if self.used >= self.per_turn:
            return False
        self.used += 1
        return True

    def wait(self, conn: "TakesTurns", since: float | None = None) -> None:
        """Queue conn for a later turn (waiting since `since`, monotonic; default now)."""
        self.waiting.append((conn, time.monotonic() if since is None else since))
        self._arm()

    def _arm(self) -> None:
        if not self.armed:
            self.armed = True
            asyncio.get_running_loop().call_soon(self._new_turn)

    def oldest_wait_s(self) -> float:
        return time.monotonic() - self.waiting[0][1] if self.waiting else 0.0

    def over_target(self, waited_s: float) -> bool:
        """Whether a request that waited this long for its turn is to be refused: the
        queue stands and it waited over the target."""
        return self.standing and waited_s > self.target_s

    def _watch(self, oldest_wait_s: float, now: float) -> None:
        if oldest_wait_s <= self.target_s:
            self._above_since = None
            self.standing = False
        elif self._above_since is None:
            self._above_since = now
        elif not self.standing and now - self._above_since >= self.interval_s:
            self.standing = True
            self.stood += 1

    def _new_turn(self) -> None:
        self.armed = False
        self.used = 0
        waiting = self.waiting
        now = time.monotonic()
        self._watch(now - waiting[0][1] if waiting else 0.0, now)
        while waiting and self.used < self.per_turn:
            conn, _ = waiting.popleft()
            if not conn.closed:
                self.take()
                conn.take_turn()
        if waiting:
            self._arm()
        else:  # drained: no queue stands (no turn is scheduled to see that later)
            self._watch(0.0, now)
