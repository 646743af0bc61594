"""A pipeline: N worker threads, each with its own BatchExecutor, sharing one queue.

Workers release the GIL in the compiled sampler and in torch ops, so threads overlap on
multiple cores while reading the one shared graph. An executor with run_async (the split
lane, pipelines/split.py) takes a batch off the worker once it is handed to the device:
the worker takes the next one while the device works. Every submitted batch reaches
`on_done` exactly once, with a result or the exception that stopped it (from the
worker's thread, or from the device stage's).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from hybridgnn.capabilities import name_os_thread
from hybridgnn.config import PipelineConfig
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.split import SPLIT_SLOTS
from hybridgnn.types import Batch, BatchResult, QueueLoad, RoutePlan, StageTimings

log = logging.getLogger(__name__)

DoneCallback = Callable[[Batch, RoutePlan, "BatchResult | None", "BaseException | None"], None]


class Pipeline:
    def __init__(self, cfg: PipelineConfig, make_executor: Callable[[int], BatchExecutor], on_done: DoneCallback):
        self.cfg = cfg
        self.name = cfg.name
        self._make_executor = make_executor
        self._on_done = on_done
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._executors: list = []
        self._lock = threading.Lock()
        self._depth = 0
        self._stopped = False

    def start(self) -> None:
        if self.cfg.processes:  # each loads the model and compiles its sampler: seconds with nothing else said
            log.info("%s pipeline: starting %d worker process(es)", self.cfg.name, self.cfg.workers)
        t0 = time.perf_counter()
        executors = [self._make_executor(i) for i in range(self.cfg.workers)]  # built here so errors surface at start
        if self.cfg.processes:
            log.info("%s pipeline: %d worker process(es) ready in %.1f s", self.cfg.name, self.cfg.workers,
                     time.perf_counter() - t0)
        self._executors = executors
        for i, ex in enumerate(executors):
            th = threading.Thread(target=self._work, args=(ex,), name=f"{self.name}-worker-{i}", daemon=True)
            th.start()
            self._threads.append(th)

    def attach(self, loop) -> None:
        """Serve from `loop` (the process pipeline's children answer on it); threads need
        none: their on_done hands results back to the loop."""

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def capacity(self) -> int:
        """Batches the pipeline works on at once: one per worker, or, for split workers,
        one per staging slot (a worker samples its next batch while its last is on the
        device)."""
        return self.cfg.workers * (SPLIT_SLOTS if self.cfg.split else 1)

    def load(self) -> QueueLoad:
        on_device = sum(getattr(ex, "on_device", 0) for ex in self._executors)  # split workers' handed-off batches
        return QueueLoad(depth=self._depth, workers=self.cfg.workers, on_device=on_device)

    def submit(self, batch: Batch, plan: RoutePlan) -> None:
        if self._stopped:
            raise RuntimeError(f"pipeline {self.name} is stopped")
        with self._lock:
            self._depth += 1
        batch.submitted_s = time.perf_counter()
        self._queue.put((batch, plan))

    def _work(self, executor: BatchExecutor) -> None:
        name_os_thread(threading.current_thread().name)
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, plan = item
            timings = StageTimings(queue_wait_s=time.perf_counter() - batch.submitted_s)
            start = getattr(executor, "run_async", None)
            if start is not None:  # a split lane: the worker goes on once the batch is handed off
                try:
                    future = start(batch.seeds, timings)
                except BaseException as exc:
                    self._finish(batch, plan, None, exc)
                    continue
                future.add_done_callback(lambda f, batch=batch, plan=plan: self._finish(
                    batch, plan, None if f.exception() else f.result(), f.exception()))
                continue
            result, error = None, None
            try:
                result = executor.run(batch.seeds, timings)
            except BaseException as exc:  # surfaced to the requests; the worker lives on
                error = exc
            self._finish(batch, plan, result, error)

    def _finish(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None) -> None:
        """A batch's end: out of the depth, then its callback (exactly once per batch)."""
        if error is not None:
            log.error("batch of %d seeds failed in pipeline %s", batch.num_seeds, self.name, exc_info=error)
        with self._lock:
            self._depth -= 1
        try:
            self._on_done(batch, plan, result, error)
        except Exception:
            log.exception("completion callback failed in pipeline %s", self.name)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish what is queued, then end the workers."""
        self._stopped = True
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        for ex in self._executors:  # worker processes exit with their pipeline
            close = getattr(ex, "close", None)
            if close is not None:
                close()
