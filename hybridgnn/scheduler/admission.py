"""Admission by predicted queueing delay (a decision; the engine executes it).

Each kind of work waits in a lane: sampled inference (the pipelines' batches, work in
PSGS), precomputed lookups off the event loop, new-node compute and graph updates (work
in requests or updates). A lane knows the work queued in it and a cost model fitted to
the batches it completed, cost(b) = a + slope·b seconds for a batch of work b, so the
wait that new work would see is the time its servers need for what is ahead of it:

    delay(Q) = (a · ceil(Q / B) + slope · Q) / servers

where B is the work of a full batch (the batcher's limits under backlog). A request is
admitted while delay(queued + its own work) stays within the bound, else refused with
Retry-After ≈ the excess. Before a lane has measured anything it admits (the pending
count still caps memory). Every request kind passes through here.
"""

from __future__ import annotations

import math

from hybridgnn.config import DEFAULT_QUEUE_DELAY_S
from hybridgnn.errors import Overloaded

_DECAY = 0.05  # weight of the newest batch in the cost fit (about the last 20 batches)


class Lane:
    """Queued work and a cost model for one kind of server pool."""

    __slots__ = ("name", "servers", "queued", "full_batch", "_n", "_x", "_y", "_xx", "_xy", "_a", "_slope")

    def __init__(self, name: str, servers: int, full_batch: float = 1.0):
        self.name = name
        self.servers = max(1, servers)
        self.queued = 0.0
        self.full_batch = max(full_batch, 1e-9)
        self._n = 0
        self._x = self._y = self._xx = self._xy = 0.0  # exponentially weighted moments of (work, seconds)
        self._a = 0.0
        self._slope: float | None = None  # None: nothing measured yet

    @property
    def measured(self) -> bool:
        return self._slope is not None

    def cost_s(self, work: float) -> float:
        """Predicted seconds of one batch of this much work (0 before any measurement)."""
        return 0.0 if self._slope is None else self._a + self._slope * work

    def delay_s(self, extra: float = 0.0) -> float:
        """Seconds until work `extra` added now would be done, queued work first."""
        if self._slope is None:
            return 0.0
        q = self.queued + extra
        batches = math.ceil(q / self.full_batch) if q > 0 else 0
        return (self._a * batches + self._slope * q) / self.servers

    def describe(self) -> dict:
        """The lane's state and cost model, for the model metadata (diagnostics)."""
        return {"servers": self.servers, "queued": self.queued, "full_batch": self.full_batch,
                "batch_cost_s": self._a, "cost_per_work_s": self._slope, "delay_s": self.delay_s()}

    def add(self, work: float) -> None:
        self.queued += work

    def remove(self, work: float) -> None:
        self.queued = max(0.0, self.queued - work)

    def observe(self, work: float, seconds: float) -> None:
        """Fit the cost model with one completed batch (its work and service seconds)."""
        if not (work > 0 and seconds >= 0 and math.isfinite(seconds)):
            return
        d = _DECAY if self._n else 1.0
        self._n += 1
        self._x += d * (work - self._x)
        self._y += d * (seconds - self._y)
        self._xx += d * (work * work - self._xx)
        self._xy += d * (work * seconds - self._xy)
        var = self._xx - self._x * self._x
        if var > 1e-6 * self._x * self._x and self._n >= 8:
            slope = (self._xy - self._x * self._y) / var
            a = self._y - slope * self._x
            if slope > 0 and a >= 0:
                self._slope, self._a = slope, a
                return
        # Too little spread in batch sizes for a line: charge all time per unit of work
        # (pessimistic for bigger batches, so admission errs towards refusing).
        self._slope, self._a = self._y / max(self._x, 1e-12), 0.0


class Admission:
    """Lanes by name and the delay bound; `admit` raises Overloaded past the bound."""

    def __init__(self, bound_s: float, lanes: list[Lane]):
        if not bound_s > 0:
            raise ValueError(f"the queue-delay bound must be > 0 seconds, got {bound_s}")
        self.bound_s = bound_s
        self.lanes = {lane.name: lane for lane in lanes}
        self.refused = 0

    def admit(self, lane_name: str, work: float) -> None:
        """Queue `work` on the lane, or raise Overloaded (with Retry-After) if the delay it
        would see passes the bound."""
        self.check(lane_name, work)
        self.lanes[lane_name].add(work)

    def check(self, lane_name: str, work: float = 0.0) -> None:
        """Raise Overloaded if work added to the lane now would wait past the bound (work 0:
        the lane is past it already, which lets the front end refuse before decoding)."""
        lane = self.lanes[lane_name]
        delay = lane.delay_s(work)
        if delay > self.bound_s and lane.queued > 0:  # an empty lane always takes one request
            self.refused += 1
            raise Overloaded(f"predicted queueing delay {delay * 1e3:.0f} ms exceeds the "
                             f"{self.bound_s * 1e3:.0f} ms bound; retry later",
                             retry_after_s=min(60.0, max(1.0, delay - self.bound_s)))

    def describe(self) -> dict:
        return {"bound_s": self.bound_s, "refused_by_delay": self.refused,
                "lanes": {name: lane.describe() for name, lane in self.lanes.items()}}

    def delays_s(self) -> dict[str, float]:
        return {name: lane.delay_s() for name, lane in self.lanes.items()}


def delay_bound_s(configured_s: float | None, slo_s: float | None, batching_wait_s: float,
                  full_batch_service_s: float | None, default_s: float = DEFAULT_QUEUE_DELAY_S) -> float:
    """The queueing-delay bound: the configured one, else the room an SLO leaves (the SLO
    less the batching wait and a full batch's p99 service time, at least a fifth of the
    SLO), else default_s."""
    if configured_s is not None:
        return configured_s
    if slo_s is not None and full_batch_service_s is not None:
        return max(slo_s / 5, slo_s - batching_wait_s - full_batch_service_s)
    return default_s


def full_batch_work(max_batch_psgs: float, max_batch_seeds: int, max_batch_requests: int, seed_psgs: float,
                    mean_request_psgs: float) -> float:
    """PSGS of a batch the batcher closes under backlog (full by one of its limits)."""
    return max(seed_psgs, min(max_batch_psgs, max_batch_seeds * seed_psgs, max_batch_requests * mean_request_psgs))


def serving_lanes(sampled_servers: int, cpu_workers: int, full_batch: float, update_batch: int) -> list[Lane]:
    """One lane per kind of work: sampled inference (PSGS, every pipeline's workers),
    precomputed lookups and new-node compute (requests, CPU workers), graph updates."""
    return [Lane("sampled", sampled_servers, full_batch), Lane("lookup", cpu_workers),
            Lane("new_nodes", cpu_workers), Lane("updates", 1, update_batch)]
