"""A CPU pipeline whose workers are child processes driven from the event loop.

The thread pipeline (pool.py) would hand each batch to a worker thread that writes the
child's pipe, waits on it and hands the answer back to the loop: two thread wake-ups
beside the child's, about 0.4 ms of a lone request on a 2-core machine. Here the loop
writes the batch's seed ids to an idle child's pipe itself and reads the answer when the
pipe turns readable (loop.add_reader), so a batch costs the child's wake-up and the
loop's only.

A batch whose seed ids the socket's buffer may not hold is written from a thread, so a
child that stopped reading never holds the loop (the batch timeout ends it). An answer is
read as its bytes arrive, never waited for: a large one is taken in pieces between other
work, and a child stopped in the middle of one holds nothing but its batch, for STALL_S
(then it is killed and replaced, as a hung one is at the batch timeout).

What holds as in pool.py: every submitted batch reaches on_done exactly once, with a
result or the error that stopped it; batches wait in submission order for a free child.
A child that exits (killed, out of memory) is started again off the loop (seconds), while
the other children go on serving, and the batch it held is sent once more, first in line: a
kill -9 or the kernel's OOM killer must not fail the requests that happened to be on that
child (inference changes nothing, so a second run is safe). A batch whose second child exits
too fails: it is likely what kills them. A child that answers no batch within the batch
timeout, or stops in the middle of an answer, is killed and its batch fails (a second wait
as long is worse than an answer now). So is one that /proc shows stopped (SIGSTOP) for
STOPPED_LIMIT_S, or spending no CPU outside disk waits for IDLE_LIMIT_S, while it holds a
batch: it will not answer, and the batch timeout is minutes. A stopped child's batch is sent
once more, as an exited one's (the stop came from outside); a deadlocked one's fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from typing import Callable

from hybridgnn.config import PipelineConfig
from hybridgnn.pipelines.liveness import LIVENESS_CHECK_S, Liveness
from hybridgnn.pipelines.process import (
    STALL_S,
    ProcessExecutor,
    WorkerProcessError,
    WorkerProcessExited,
)
from hybridgnn.types import Batch, BatchResult, QueueLoad, RoutePlan, StageTimings

log = logging.getLogger(__name__)

# Seed ids up to this size are written on the loop: the socket's buffer (about 200 KiB on
# Linux) takes them whole, even from a child that stopped reading.
INLINE_SEND_BYTES = 64 * 1024

DoneCallback = Callable[[Batch, RoutePlan, "BatchResult | None", "BaseException | None"], None]


@dataclasses.dataclass(eq=False)
class _Child:
    """One worker process and the batch it holds (None: idle, or restarting)."""
    executor: ProcessExecutor
    batch: Batch | None = None
    plan: RoutePlan | None = None
    timings: StageTimings | None = None
    timer: asyncio.TimerHandle | None = None  # the batch timeout
    stall: asyncio.TimerHandle | None = None  # an answer begun must go on arriving within STALL_S
    look: asyncio.TimerHandle | None = None  # the next liveness look (stopped? deadlocked?)
    liveness: Liveness | None = None
    fd: int | None = None  # watched by the loop (None: not watched)
    resent: bool = False  # the batch held is on its second child


class ProcessPipeline:
    """The Pipeline interface (start, attach, submit, depth, capacity, load, stop) over
    worker processes. submit() runs on the event loop given to attach(); stop() on any
    other thread."""

    def __init__(self, cfg: PipelineConfig, make_executor: Callable[[int], ProcessExecutor], on_done: DoneCallback):
        self.cfg = cfg
        self.name = cfg.name
        self._make_executor = make_executor
        self._on_done = on_done
        self._executors: list[ProcessExecutor] = []
        self._children: list[_Child] = []
        self._idle: deque[_Child] = deque()
        self._waiting: deque[tuple[Batch, RoutePlan, bool]] = deque()  # (…, resent)
        self._restarts: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._depth = 0
        self._drained = threading.Event()
        self._drained.set()
        self._stopped = False
        self._released = False
        self._starting = threading.Lock()  # held by start() while it starts children

    # --- as the thread pipeline --------------------------------------------------------
    def start(self) -> None:
        """Start the children (seconds: each loads the model and compiles its sampler). A
        stop() meanwhile (the server's start cancelled by a Ctrl-C) ends the start after the
        child starting now, and closes every child started: RuntimeError then."""
        log.info("%s pipeline: starting %d worker process(es)", self.name, self.cfg.workers)
        t0 = time.perf_counter()
        with self._starting:
            for i in range(self.cfg.workers):
                if self._stopped:
                    raise RuntimeError(f"pipeline {self.name} was stopped while its worker processes started")
                executor = self._make_executor(i)
                # kept at once: a child started here is one stop() closes, whatever fails after
                self._executors.append(executor)
                self._children.append(_Child(executor))
        log.info("%s pipeline: %d worker process(es) ready in %.1f s", self.name, self.cfg.workers,
                 time.perf_counter() - t0)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from `loop` (called on it, after start)."""
        self._loop = loop
        for child in self._children:
            self._watch(child)
            self._idle.append(child)

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def capacity(self) -> int:
        return self.cfg.workers

    def load(self) -> QueueLoad:
        return QueueLoad(depth=self._depth, workers=self.cfg.workers, on_device=0)

    def submit(self, batch: Batch, plan: RoutePlan) -> None:
        if self._stopped:
            raise RuntimeError(f"pipeline {self.name} is stopped")
        if self._loop is None:
            raise RuntimeError(f"pipeline {self.name} is not started")
        self._depth += 1
        self._drained.clear()
        batch.submitted_s = time.perf_counter()
        if self._idle:
            self._send(self._idle.popleft(), batch, plan)
        else:
            self._waiting.append((batch, plan, False))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish what is queued (up to timeout_s), fail what is left, then end the children.
        Called off the loop (it waits for the loop to finish the batches)."""
        self._stopped = True
        # A start under way (on another thread) ends after the child it is starting, which is
        # then closed below with the others: a child left running kept its pipe open, and the
        # interpreter's exit waited on it for ever (a worker ignores the SIGTERM that
        # multiprocessing ends daemon children with).
        with self._starting:
            pass
        loop = self._loop
        if loop is not None and loop.is_running() and not _on(loop):
            self._drained.wait(timeout_s)
            try:
                asyncio.run_coroutine_threadsafe(self._detach(), loop).result(timeout_s)
            except Exception:  # a loop stopped or stuck: its children are left (daemons, they end with it)
                log.exception("%s pipeline: could not release its children from the event loop", self.name)
                return
        elif loop is not None and _on(loop):
            self._release_all()
        for th in list(self._restarts):
            th.join(timeout_s)
        for child in self._children:
            child.executor.close()

    # --- on the loop -----------------------------------------------------------------
    def _send(self, child: _Child, batch: Batch, plan: RoutePlan, resent: bool = False) -> None:
        child.batch, child.plan, child.resent = batch, plan, resent
        child.timings = StageTimings(queue_wait_s=time.perf_counter() - batch.submitted_s)
        timeout_s = child.executor.batch_timeout_s
        if timeout_s is not None:  # from before the write: a child that stops reading is hung too
            child.timer = self._loop.call_later(timeout_s, self._hung, child)
            child.liveness = Liveness()
            child.look = self._loop.call_later(LIVENESS_CHECK_S, self._look, child)
        if batch.seeds.nbytes > INLINE_SEND_BYTES:
            # a write the socket's buffer may not hold waits for the child to read it: on a
            # thread, so a child that stopped never holds the loop (its timer ends it)
            sent = self._loop.run_in_executor(None, child.executor.send, batch.seeds, child.executor.connection)
            sent.add_done_callback(lambda f: self._send_failed(child, batch, f.exception()))
            return
        try:
            child.executor.send(batch.seeds)
        except WorkerProcessError as exc:
            self._lost(child, exc, resend=True)

    def _send_failed(self, child: _Child, batch: Batch, error: BaseException | None) -> None:
        if error is not None and child.batch is batch:  # not already ended (the hung timer)
            self._lost(child, error if isinstance(error, WorkerProcessError) else WorkerProcessExited(
                f"CPU worker process {child.executor.worker}: the batch could not be sent ({error})"), resend=True)

    def _answered(self, child: _Child) -> None:
        """The child's socket is readable: (more of) its answer, or its exit."""
        batch, plan = child.batch, child.plan
        result, error = None, None
        try:
            result = child.executor.poll_answer(child.timings)
            if result is None:  # the rest of the answer is on its way, and must keep coming
                if child.executor.answer_started:
                    if child.stall is not None:
                        child.stall.cancel()
                    child.stall = self._loop.call_later(STALL_S, self._stalled, child)
                return
        except WorkerProcessExited as exc:
            self._lost(child, exc, resend=True)
            return
        except WorkerProcessError as exc:  # the batch failed in the child, which lives on
            error = exc
        except Exception as exc:  # an answer that cannot be read leaves the pipe out of step: a new child
            self._lost(child, WorkerProcessExited(f"CPU worker process {child.executor.worker} sent an answer "
                                                  f"that could not be read ({type(exc).__name__}: {exc})"))
            return
        if batch is None:  # nothing was asked: a child that talks out of turn is not trusted
            self._lost(child, WorkerProcessExited(f"CPU worker process {child.executor.worker} answered no batch"))
            return
        self._next(child)  # the child takes its next batch before this one's answers go out
        self._finish(batch, plan, result, error)

    def _hung(self, child: _Child) -> None:
        child.timer = None
        self._kill(child, child.executor.hung())

    def _look(self, child: _Child) -> None:
        """A child holding a batch, looked at: killed as hung if stopped or deadlocked."""
        child.look = None
        # an answer under way is the stall limit's to judge (a child blocked writing it idles)
        answering = child.executor.answer_started
        hung = None if answering else child.liveness.observe(child.executor.activity(), LIVENESS_CHECK_S)
        if hung is not None:  # a stopped child's batch goes to another (once), as an exited one's
            self._kill(child, child.executor.stuck(hung.reason), resend=hung.resend)
        else:
            child.look = self._loop.call_later(LIVENESS_CHECK_S, self._look, child)

    def _stalled(self, child: _Child) -> None:
        child.stall = None
        self._kill(child, WorkerProcessExited(
            f"CPU worker process {child.executor.worker} stopped in the middle of an answer for {STALL_S:g} s "
            "and was killed; it restarts for the next one"))

    def _kill(self, child: _Child, error: WorkerProcessError, resend: bool = False) -> None:
        self._unwatch(child)
        child.executor.signal_kill()  # reaped by the restart's close, on its thread: never on the loop
        self._lost(child, error, resend)

    def _lost(self, child: _Child, error: WorkerProcessError, resend: bool = False) -> None:
        """The child is gone: a new child is started off the loop, and its batch is sent
        once more (resend: the child exited, and the batch is on its first) or fails."""
        batch, plan, resent = child.batch, child.plan, child.resent
        self._unwatch(child)
        self._clear(child)
        try:  # an idle child that exited: no batch may be sent to it until it is back
            self._idle.remove(child)
        except ValueError:
            pass
        again = batch is not None and resend and not resent and not self._released
        if again:
            log.warning("%s; its batch of %d seeds is sent again", error, batch.num_seeds)
            if self._idle:
                self._send(self._idle.popleft(), batch, plan, resent=True)
            else:
                self._waiting.appendleft((batch, plan, True))
        # During stop()'s drain a lost child is replaced only while batches wait for one: a
        # restart takes seconds, and held the stop that long after the children took the
        # signal that stops the server (a process group's SIGTERM) with nothing left to do.
        if not self._released and (self._waiting or not self._stopped):
            th = threading.Thread(target=self._restart, args=(child,), name=f"{self.name}-restart", daemon=True)
            self._restarts.append(th)
            th.start()
        if batch is not None and not again:
            self._finish(batch, plan, None, error)

    def _restart(self, child: _Child) -> None:
        error = None
        try:
            child.executor.restart()
        except BaseException as exc:  # its next batch fails (nothing runs) and starts it again
            error = exc
        try:
            self._loop.call_soon_threadsafe(self._restarted, child, error, threading.current_thread())
        except RuntimeError:  # the loop is closed: stop() closes the child
            pass

    def _restarted(self, child: _Child, error: BaseException | None, thread: threading.Thread) -> None:
        self._restarts.remove(thread)
        if self._released:  # stop() let go of the children (a restart during the drain still serves)
            return
        if error is not None:
            log.error("%s pipeline: worker process %d could not restart: %s", self.name, child.executor.worker, error)
        else:
            self._watch(child)
        self._next(child)

    def _next(self, child: _Child) -> None:
        """A free child takes the oldest waiting batch, or waits idle."""
        self._clear(child)
        if self._waiting:
            batch, plan, resent = self._waiting.popleft()
            self._send(child, batch, plan, resent)  # a child that failed to restart fails it, and tries again
        else:
            self._idle.append(child)

    def _finish(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None) -> None:
        """A batch's end: out of the depth, then its callback (exactly once per batch)."""
        if error is not None:
            log.error("batch of %d seeds failed in pipeline %s", batch.num_seeds, self.name, exc_info=error)
        self._depth -= 1
        if self._depth == 0:
            self._drained.set()
        try:
            self._on_done(batch, plan, result, error)
        except Exception:
            log.exception("completion callback failed in pipeline %s", self.name)

    def _watch(self, child: _Child) -> None:
        child.fd = child.executor.fileno()
        self._loop.add_reader(child.fd, self._answered, child)
        # uvloop (libuv's poll) makes the descriptor non-blocking; a batch's seeds larger
        # than the socket's buffer then broke off mid-message (EAGAIN), read as the child's
        # exit. Writes block (inline ones fit the buffer; larger ones wait on a thread, for
        # at most the socket's stall limit); reads never do, whatever the mode.
        os.set_blocking(child.fd, True)

    def _unwatch(self, child: _Child) -> None:
        if child.fd is not None:
            self._loop.remove_reader(child.fd)
            child.fd = None

    @staticmethod
    def _clear(child: _Child) -> None:
        for timer in (child.timer, child.stall, child.look):
            if timer is not None:
                timer.cancel()
        child.batch = child.plan = child.timings = child.timer = child.stall = child.look = None
        child.liveness = None
        child.resent = False

    async def _detach(self) -> None:
        self._release_all()

    def _release_all(self) -> None:
        """Stop watching the children; batches still held or waiting fail (stop's timeout)."""
        self._released = True
        stopped = WorkerProcessError(f"pipeline {self.name} stopped before the batch finished")
        left = [(batch, plan) for batch, plan, _ in self._waiting]
        self._waiting.clear()
        self._idle.clear()
        for child in self._children:
            self._unwatch(child)
            if child.batch is not None:
                left.append((child.batch, child.plan))
            self._clear(child)
        for batch, plan in left:
            self._finish(batch, plan, None, stopped)


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread is running `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
