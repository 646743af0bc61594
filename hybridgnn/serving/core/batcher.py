"""Asyncio micro-batcher, driven by callbacks rather than a task.

A batch closes when it holds max_batch_seeds seeds, max_batch_requests requests or
max_batch_psgs summed PSGS (a request that would pass a limit closes the batch before
it), or max_wait_s after its first request arrived. It is then held back until a
pipeline has an idle worker, so under load batches grow (better throughput) instead of
queueing (worse latency). Requests are taken in arrival order; a request is never split.

No wait on a quiet server (given `quiet`, the default; `--wait-when-idle` gives none):
while no batch is queued or running anywhere, what is pending is dispatched at once, since
waiting for more requests would leave every worker idle for nothing but the wait. A lone
request then costs its service time, not max_wait_s more (a one-seed sampled request on
the demo: about 2.3 of 5.7 ms was that wait). Once any batch is under way, batches close
by their limits and max_wait_s as before. Why not whenever some worker is idle: under
load a worker that frees would then take a few requests at a time, and small batches
cost more per seed; one run at one seed per request served 0.87x the rate within its p99
that way. The queueing simulator models the wait: cautious at light load, the same where
an SLO's p99 is decided (workers busy).

Why callbacks: a batch is dispatched in the call that makes it due (the request that
fills it, the completion that frees a worker, the max_wait timer), not by a task woken
for it. A task needs one or two more turns of the event loop per batch, and under a
flood of small requests a turn of the loop is long (it reads every ready connection):
the hops, not the pipelines, then set the batching delay and cap the throughput.
Runs on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from typing import Callable

import numpy as np

from hybridgnn.config import BatcherConfig
from hybridgnn.errors import Draining
from hybridgnn.types import Batch, InferenceRequest


class MicroBatcher:
    def __init__(self, cfg: BatcherConfig, dispatch: Callable[[Batch], None], has_capacity: Callable[[], bool],
                 quiet: Callable[[], bool] | None = None):
        """has_capacity: a batch may be dispatched now; quiet: no batch is under way, so one
        dispatched now starts at once (None: batches always wait for max_wait_s or a limit)."""
        self.cfg = cfg
        self._dispatch = dispatch
        self._has_capacity = has_capacity
        self._quiet = quiet
        self._pending: deque[InferenceRequest] = deque()
        self._pending_seeds = 0
        self._pending_psgs = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # when the armed timer fires (perf_counter seconds)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the batcher runs on (first timer)
        self._closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: InferenceRequest) -> None:
        """Queue a request; dispatches at once whatever batch that makes due."""
        if self._closed:
            request.on_done(None, Draining("server is shutting down; this request was not run"))
            return
        if self._pending and self._overflows(request):
            self._pump(close_head=True)  # the batch ahead of it is as full as it gets
        self._pending.append(request)
        self._pending_seeds += int(request.node_ids.shape[0])
        self._pending_psgs += request.psgs
        self._pump()

    def limit_psgs(self, max_batch_psgs: float) -> None:
        """Bound the summed PSGS of a batch (a policy's choice) from the next batch on."""
        self.cfg = dataclasses.replace(self.cfg, max_batch_psgs=max_batch_psgs)

    def capacity_freed(self) -> None:
        """A pipeline finished a batch: dispatch what is due now."""
        self._pump()

    def close(self) -> None:
        """Stop batching; requests still waiting are answered 503 (a drain that timed out),
        never left without an answer."""
        self._closed = True
        self._disarm()
        while self._pending:
            self._pending.popleft().on_done(None, Draining("server is shutting down; this request was not run"))
        self._pending_seeds, self._pending_psgs = 0, 0.0

    def _full(self) -> bool:
        return (self._pending_seeds >= self.cfg.max_batch_seeds or len(self._pending) >= self.cfg.max_batch_requests
                or self._pending_psgs >= self.cfg.max_batch_psgs)

    def _overflows(self, request: InferenceRequest) -> bool:
        """Whether `request` would push the pending requests past a batch limit."""
        return (self._pending_seeds + request.node_ids.shape[0] > self.cfg.max_batch_seeds
                or self._pending_psgs + request.psgs > self.cfg.max_batch_psgs)

    def _pump(self, close_head: bool = False) -> None:
        """Dispatch due batches while a pipeline has capacity; else arm the timer for the
        first waiting request's deadline. close_head: the first batch is due now."""
        while self._pending and not self._closed:
            deadline = self._pending[0].arrival_s + self.cfg.max_wait_s
            if not (close_head or self._full() or time.perf_counter() >= deadline
                    or (self._quiet is not None and self._quiet())):
                self._arm(deadline)
                return
            if not self._has_capacity():
                return  # capacity_freed pumps again
            close_head = False
            self._dispatch(self._take())
        if not self._pending:
            self._disarm()

    def _arm(self, at: float) -> None:
        if self._timer is not None and self._timer_at <= at:
            return  # an earlier (or the same) wake-up is armed; it re-arms for this one
        self._disarm()
        self._timer_at = at
        if self._loop is None:  # kept: get_running_loop() costs a system call (getpid) each time
            self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(max(0.0, at - time.perf_counter()), self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._pump()

    def _take(self) -> Batch:
        requests = [self._pending.popleft()]
        seeds = int(requests[0].node_ids.shape[0])
        psgs = requests[0].psgs
        while self._pending and len(requests) < self.cfg.max_batch_requests:
            nxt = self._pending[0]
            if seeds + nxt.node_ids.shape[0] > self.cfg.max_batch_seeds or psgs + nxt.psgs > self.cfg.max_batch_psgs:
                break
            requests.append(self._pending.popleft())
            seeds += int(nxt.node_ids.shape[0])
            psgs += nxt.psgs
        self._pending_seeds -= seeds
        self._pending_psgs = max(0.0, self._pending_psgs - psgs) if self._pending else 0.0
        sizes = np.fromiter((r.node_ids.shape[0] for r in requests), dtype=np.int64, count=len(requests))
        offsets = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        all_seeds = requests[0].node_ids if len(requests) == 1 else np.concatenate([r.node_ids for r in requests])
        return Batch(requests=requests, seeds=all_seeds, offsets=offsets, psgs=0.0, closed_s=time.perf_counter())
