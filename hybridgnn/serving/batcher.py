"""Asyncio micro-batcher.

A batch closes when it holds max_batch_seeds seeds, max_batch_requests requests or
max_batch_psgs summed PSGS, or max_wait_s after its first request arrived. It is then held back until a pipeline has an
idle worker, so under load batches grow (better throughput) instead of queueing (worse
latency). Requests are taken in arrival order; a request is never split.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from typing import Callable

import numpy as np

from hybridgnn.config import BatcherConfig
from hybridgnn.errors import Draining
from hybridgnn.types import Batch, InferenceRequest


class MicroBatcher:
    def __init__(self, cfg: BatcherConfig, dispatch: Callable[[Batch], None], has_capacity: Callable[[], bool]):
        self.cfg = cfg
        self._dispatch = dispatch
        self._has_capacity = has_capacity
        self._pending: deque[InferenceRequest] = deque()
        self._pending_seeds = 0
        self._pending_psgs = 0.0
        self._wake = asyncio.Event()
        self._capacity = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: InferenceRequest) -> None:
        self._pending.append(request)
        self._pending_seeds += int(request.node_ids.shape[0])
        self._pending_psgs += request.psgs
        if len(self._pending) == 1 or self._full():
            self._wake.set()

    def limit_psgs(self, max_batch_psgs: float) -> None:
        """Bound the summed PSGS of a batch (a policy's choice) from the next batch on."""
        self.cfg = dataclasses.replace(self.cfg, max_batch_psgs=max_batch_psgs)

    def capacity_freed(self) -> None:
        self._capacity.set()

    def close(self) -> None:
        """Stop batching; requests still waiting are answered 503 (a drain that timed out),
        never left without an answer."""
        self._closed = True
        self._wake.set()
        self._capacity.set()
        while self._pending:
            req = self._pending.popleft()
            if not req.future.done():
                req.future.set_exception(Draining("server is shutting down; this request was not run",
                                                  retry_after_s=1.0))
        self._pending_seeds, self._pending_psgs = 0, 0.0

    def _full(self) -> bool:
        return (self._pending_seeds >= self.cfg.max_batch_seeds or len(self._pending) >= self.cfg.max_batch_requests
                or self._pending_psgs >= self.cfg.max_batch_psgs)

    async def run(self) -> None:
        while not self._closed:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            deadline = self._pending[0].arrival_s + self.cfg.max_wait_s
            while not self._full() and not self._closed:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            while not self._has_capacity() and not self._closed:
                self._capacity.clear()
                await self._capacity.wait()
            if self._pending:
                self._dispatch(self._take())

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
