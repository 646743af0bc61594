"""The loop-driven process pipeline over fake children (a socketpair each, no processes):
every batch reaches on_done exactly once, in submission order per free child; a failed
batch leaves its child serving; an exited or hung child fails its batch and is restarted
while waiting batches wait; stop fails what it cannot finish. Fast, but the fakes hold
sockets (the pipeline sets socket options), so it lives beside the integration tests."""

import asyncio
import os
import select
import socket
import threading
import time
from collections import deque

import numpy as np
import pytest

from hybridgnn.config import PipelineConfig
from hybridgnn.pipelines import liveness, process_pipeline
from hybridgnn.pipelines.liveness import ChildActivity
from hybridgnn.pipelines.process_pipeline import (
    ProcessPipeline,
    WorkerProcessError,
    WorkerProcessExited,
)
from hybridgnn.types import Batch, BatchResult, RoutePlan, StageTimings

PLAN = RoutePlan("cpu", 0.0, "only")


def make_batch(seeds):
    seeds = np.asarray(seeds, dtype=np.int64)
    return Batch(requests=[], seeds=seeds, offsets=np.array([0, len(seeds)]), psgs=0.0, closed_s=time.perf_counter())


class FakeChild:
    """A ProcessExecutor's loop-facing surface (its socket a socketpair, no process). A batch's
    answer (two bytes) is written to the pipe at once unless `hold`; seeds < 0 make the child
    report a failed batch, a seed of 666 makes it exit mid-batch, one of 777 sends an answer
    that cannot be read."""

    def __init__(self, worker: int, timeout_s: float | None = None):
        self.worker, self.batch_timeout_s = worker, timeout_s
        self.hold = False
        self.seen = None  # what /proc would say of it (None: unknown)
        self.sent: list[list[int]] = []
        self.restarts = self.kills = 0
        self.restart_gate = threading.Event()
        self.restart_gate.set()
        self.send_gate = threading.Event()
        self.send_gate.set()
        self._open()

    def _open(self):
        self._r, self._w = (s.detach() for s in socket.socketpair())  # a socket, as a child's is
        self._answers: deque = deque()
        self._got = b""

    def fileno(self):
        return self._r

    def send(self, seeds, conn=None):
        self.send_gate.wait(10)  # a child that does not read: the write waits
        if self._w is None:
            raise WorkerProcessExited(f"child {self.worker} is gone")
        self.sent.append(seeds.tolist())
        self._answers.append(seeds)
        if not self.hold:
            self.answer()

    def answer(self):
        os.write(self._w, b"ok")

    def answer_half(self):
        os.write(self._w, b"o")

    def exit(self):
        """The child dies: its pipe reads end-of-file."""
        os.close(self._w)
        self._w = None

    def poll_answer(self, timings=None):
        if select.select([self._r], [], [], 0)[0]:
            data = os.read(self._r, 2 - len(self._got))
            if not data:
                raise WorkerProcessExited(f"child {self.worker} exited")
            self._got += data
        if len(self._got) < 2:
            return None  # the rest is on its way
        self._got = b""
        seeds = self._answers.popleft()
        if (seeds < 0).any():
            raise WorkerProcessError("seed ids must lie in [0, n)")
        if (seeds == 777).any():
            raise ValueError("not enough values to unpack")
        if (seeds == 666).any():
            self.exit()
            raise WorkerProcessExited(f"child {self.worker} exited during a batch")
        return BatchResult(logits=seeds[:, None].astype(np.float32), predictions=seeds,
                           timings=timings or StageTimings())

    @property
    def answer_started(self):
        return bool(self._got)

    def hung(self):
        return WorkerProcessExited(f"child {self.worker} answered no batch within {self.batch_timeout_s:g} s")

    def activity(self):
        return self.seen

    def stuck(self, reason):
        return WorkerProcessExited(f"child {self.worker} {reason}")

    def kill(self):
        self.kills += 1
        self.close()

    def signal_kill(self):
        self.kills += 1  # the process would die; its socket is closed by the restart

    @property
    def connection(self):
        return self._w

    def restart(self):
        self.restart_gate.wait(10)
        self.restarts += 1
        self.close()
        self._open()

    def close(self):
        for fd in (self._r, self._w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._r = self._w = None


def run_pipeline(scenario, workers=2, timeout_s=None):
    """scenario(pipeline, children, done) on a running loop; done: [(seeds, result, error)]."""
    children = []

    def make(i):
        children.append(FakeChild(i, timeout_s))
        return children[-1]

    done = []
    pipe = ProcessPipeline(PipelineConfig(workers=workers), make,
                           lambda b, p, r, e: done.append((b.seeds.tolist(), r, e)))

    async def main():
        pipe.start()
        pipe.attach(asyncio.get_running_loop())
        try:
            await scenario(pipe, children, done)
        finally:
            await asyncio.to_thread(pipe.stop, 2.0)

    asyncio.run(main())
    return pipe, children, done


async def until(predicate, deadline_s=5.0):
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.005)


def test_batches_queue_for_free_children_and_finish_once_each_in_order():
    async def scenario(pipe, children, done):
        for c in children:
            c.hold = True
        for i in range(6):
            pipe.submit(make_batch([i]), PLAN)
        assert pipe.depth == 6 and [c.sent for c in children] == [[[0]], [[1]]]  # the rest wait
        for round_ in range(1, 4):
            for c in children:
                c.answer()
            await until(lambda n=2 * round_: len(done) == n)
        assert pipe.depth == 0

    pipe, children, done = run_pipeline(scenario)
    assert sorted(s[0] for s, _, _ in done) == list(range(6))
    assert children[0].sent == [[0], [2], [4]] and children[1].sent == [[1], [3], [5]]
    assert all(e is None and r.predictions.tolist() == s for s, r, e in done)


def test_a_failed_batch_leaves_its_child_serving():
    async def scenario(pipe, children, done):
        pipe.submit(make_batch([-1]), PLAN)
        pipe.submit(make_batch([4]), PLAN)
        pipe.submit(make_batch([5]), PLAN)
        await until(lambda: len(done) == 3)

    _, children, done = run_pipeline(scenario, workers=1)
    errors = [e for _, _, e in done if e is not None]
    assert len(errors) == 1 and "lie in" in str(errors[0])
    assert children[0].restarts == 0 and [s for s, _, _ in done[1:]] == [[4], [5]]


def test_a_batch_whose_child_exits_is_sent_again_first_and_fails_only_if_it_kills_two():
    """A batch that kills its child (seed 666 here, as a batch the OOM killer ends would)
    is sent once more, ahead of the batches waiting, and fails when its second child exits
    too; the batches behind it are served."""
    async def scenario(pipe, children, done):
        children[0].restart_gate.clear()  # the restart takes a while: batches wait for the child
        pipe.submit(make_batch([666]), PLAN)
        pipe.submit(make_batch([7]), PLAN)
        await until(lambda: children[0].sent == [[666]] and pipe._restarts)
        assert not done and pipe.depth == 2 and [w[0].seeds.tolist() for w in pipe._waiting] == [[666], [7]]
        children[0].restart_gate.set()
        await until(lambda: len(done) == 2)

    _, children, done = run_pipeline(scenario, workers=1)
    assert isinstance(done[0][2], WorkerProcessExited) and done[0][0] == [666]
    assert done[1][0] == [7] and done[1][2] is None
    assert children[0].sent == [[666], [666], [7]] and children[0].restarts == 2


def test_a_batch_on_a_child_killed_mid_batch_is_answered_by_another():
    """A kill -9 of a busy child fails none of its requests: the batch goes to the idle
    child at once."""
    async def scenario(pipe, children, done):
        children[0].hold = True
        pipe.submit(make_batch([5]), PLAN)
        assert children[0].sent == [[5]]
        children[0].exit()  # killed, the batch unanswered
        await until(lambda: len(done) == 1)

    _, children, done = run_pipeline(scenario, workers=2)
    assert done[0][0] == [5] and done[0][2] is None and done[0][1].predictions.tolist() == [5]
    assert children[1].sent == [[5]]


def test_a_batch_sent_to_an_idle_child_killed_unnoticed_is_answered_by_its_replacement():
    """The loop had not yet seen the idle child's exit when the batch came: the write fails,
    and the batch waits for the restarted child instead of failing."""
    async def scenario(pipe, children, done):
        children[0].exit()
        pipe.submit(make_batch([3]), PLAN)  # on this turn of the loop: the exit is not yet seen
        await until(lambda: len(done) == 1)

    _, children, done = run_pipeline(scenario, workers=1)
    assert done == [([3], done[0][1], None)] and done[0][1].predictions.tolist() == [3]
    assert children[0].restarts == 1 and children[0].sent == [[3]]


def test_a_child_that_exits_while_idle_is_restarted_before_its_next_batch_and_idles_once():
    """An idle child that exited stayed on the idle list, and its restart put it there a
    second time: two batches went to one child, the first never answered and the second
    given the first's outputs."""
    async def scenario(pipe, children, done):
        children[0].exit()
        await until(lambda: children[0].restarts == 1 and not pipe._restarts)
        assert list(pipe._idle) == [pipe._children[0]]
        children[0].hold = True
        pipe.submit(make_batch([3]), PLAN)
        pipe.submit(make_batch([4]), PLAN)
        assert children[0].sent == [[3]] and len(pipe._waiting) == 1  # the second waits for the child
        children[0].answer()
        await until(lambda: len(done) == 1)
        children[0].answer()
        await until(lambda: len(done) == 2)

    _, children, done = run_pipeline(scenario, workers=1)
    assert [(s, e, r.predictions.tolist()) for s, r, e in done] == [([3], None, [3]), ([4], None, [4])]


def test_a_hung_child_fails_its_batch_at_the_timeout_and_is_replaced():
    async def scenario(pipe, children, done):
        children[0].hold = True
        pipe.submit(make_batch([1]), PLAN)
        await until(lambda: len(done) == 1, deadline_s=3)
        children[0].hold = False
        pipe.submit(make_batch([2]), PLAN)
        await until(lambda: len(done) == 2)

    _, children, done = run_pipeline(scenario, workers=1, timeout_s=0.2)
    assert "answered no batch within 0.2 s" in str(done[0][2]) and children[0].kills == 1
    assert children[0].restarts == 1 and done[1][2] is None


def test_a_stopped_child_is_replaced_long_before_the_timeout_and_its_batch_answered_by_another(monkeypatch):
    """A child stopped holding a batch (SIGSTOP) will not answer: it is killed at the
    stopped limit, not the batch timeout, and its batch goes to the next free child; a
    computing one is left to answer, and a deadlocked one's batch fails."""
    monkeypatch.setattr(process_pipeline, "LIVENESS_CHECK_S", 0.02)
    monkeypatch.setattr(liveness, "STOPPED_LIMIT_S", 0.2)
    monkeypatch.setattr(liveness, "IDLE_LIMIT_S", 0.2)

    async def scenario(pipe, children, done):
        children[0].hold = children[1].hold = True
        children[0].seen = ChildActivity("T", 10)
        children[1].seen = ChildActivity("R", 10)
        children[0].restart_gate.clear()  # its replacement comes after child 1 took the batch
        pipe.submit(make_batch([1]), PLAN)
        pipe.submit(make_batch([2]), PLAN)
        await until(lambda: children[0].kills == 1, deadline_s=3)
        assert children[1].kills == 0 and not done
        children[1].answer()  # answers [2], then takes the resent [1]
        await until(lambda: len(done) == 1)
        children[1].answer()
        await until(lambda: len(done) == 2)
        children[0].restart_gate.set()
        await until(lambda: children[0].restarts == 1)
        children[1].seen = ChildActivity("S", 11)  # and now deadlocks on the next
        pipe.submit(make_batch([3]), PLAN)
        await until(lambda: len(done) == 3, deadline_s=3)

    _, children, done = run_pipeline(scenario, workers=2, timeout_s=300)
    assert [d[0] for d in done] == [[2], [1], [3]] and done[0][2] is None and done[1][2] is None
    assert children[1].sent[:2] == [[2], [1]]
    assert "used no CPU" in str(done[2][2])


def test_stop_finishes_what_it_can_and_fails_the_rest_exactly_once():
    async def scenario(pipe, children, done):
        children[0].hold = True
        for i in range(3):
            pipe.submit(make_batch([i]), PLAN)
        await asyncio.to_thread(pipe.stop, 0.2)  # nothing answers: all three are failed by stop
        assert pipe.depth == 0
        with pytest.raises(RuntimeError, match="stopped"):
            pipe.submit(make_batch([9]), PLAN)

    _, _, done = run_pipeline(scenario, workers=1)
    assert sorted(s[0] for s, _, _ in done) == [0, 1, 2]
    assert all("stopped before the batch finished" in str(e) for _, _, e in done)


def test_a_child_lost_during_stop_is_replaced_only_while_batches_wait():
    """Children that took the server's own stop signal (a process group's SIGTERM) were each
    restarted during the drain with nothing left to serve, holding the stop seconds."""
    async def scenario(pipe, children, done):
        children[0].hold = True
        pipe.submit(make_batch([1]), PLAN)
        pipe.submit(make_batch([2]), PLAN)  # waits for the one child
        stopping = asyncio.create_task(asyncio.to_thread(pipe.stop, 5.0))
        await until(lambda: pipe._stopped)
        children[0].hold = False  # the new child answers
        children[0].exit()  # its batch goes first, then [2]: a new child serves both
        await until(lambda: len(done) == 2)
        assert children[0].restarts == 1 and [(s, e) for s, _, e in done] == [([1], None), ([2], None)]
        await stopping

    _, children, done = run_pipeline(scenario, workers=1)
    assert children[0].restarts == 1 and children[0].sent == [[1], [1], [2]]

    async def nothing_waits(pipe, children, done):
        children[0].hold = True
        pipe.submit(make_batch([1]), PLAN)
        stopping = asyncio.create_task(asyncio.to_thread(pipe.stop, 5.0))
        await until(lambda: pipe._stopped)
        children[1].exit()  # idle, and nothing waits: no restart
        await until(lambda: pipe._children[1].fd is None)
        assert not pipe._restarts
        children[0].answer()
        await stopping

    _, children, done = run_pipeline(nothing_waits, workers=2)
    assert children[1].restarts == 0 and [(s, e) for s, _, e in done] == [([1], None)]


def test_a_child_that_cannot_restart_fails_the_batches_sent_to_it_and_tries_again():
    """A batch sent to a child whose restart failed waits for the next restart; when that
    fails too, the batch fails, and the restart after it serves."""
    async def scenario(pipe, children, done):
        child = children[0]
        original = child.restart
        attempts = []

        def failing_restart():
            attempts.append(1)
            if len(attempts) <= 2:
                child.close()
                raise WorkerProcessError("could not start: out of memory")
            original()

        child.restart = failing_restart
        child.exit()  # killed while idle; its restart fails
        await until(lambda: len(attempts) == 1 and not pipe._restarts)
        pipe.submit(make_batch([8]), PLAN)  # sent to the broken child, then to its second failed restart
        await until(lambda: len(done) == 1 and len(attempts) == 3 and not pipe._restarts)
        pipe.submit(make_batch([9]), PLAN)
        await until(lambda: len(done) == 2)

    _, _, done = run_pipeline(scenario, workers=1)
    assert [(s, e is None) for s, _, e in done] == [([8], False), ([9], True)]
    assert "out of memory" in str(done[0][2]) or "gone" in str(done[0][2])


def test_submit_before_attach_is_refused():
    pipe = ProcessPipeline(PipelineConfig(workers=1), lambda i: FakeChild(i), lambda *a: None)
    with pytest.raises(RuntimeError, match="not started"):
        pipe.submit(make_batch([1]), PLAN)


def test_an_unreadable_answer_fails_its_batch_and_replaces_the_child():
    async def scenario(pipe, children, done):
        pipe.submit(make_batch([777]), PLAN)
        pipe.submit(make_batch([5]), PLAN)
        await until(lambda: len(done) == 2)

    _, children, done = run_pipeline(scenario, workers=1)
    assert "could not be read (ValueError" in str(done[0][2]) and done[1][2] is None
    assert children[0].restarts == 1


def test_a_large_batch_to_a_child_that_does_not_read_never_holds_the_loop():
    """Seed ids past what the socket's buffer takes are written on a thread: the other child
    serves meanwhile, and the hung timer ends the stuck one."""
    async def scenario(pipe, children, done):
        children[0].send_gate.clear()
        pipe.submit(make_batch(np.arange(20_000)), PLAN)  # 160 KB: to child 0, which reads nothing
        pipe.submit(make_batch([3]), PLAN)  # child 1 answers while child 0's write waits
        await until(lambda: len(done) == 1)
        assert done[0][0] == [3] and done[0][2] is None
        await until(lambda: len(done) == 2, deadline_s=3)  # the timer: child 0 is hung
        children[0].send_gate.set()  # the write ends (failing): the batch was already answered
        await until(lambda: children[0].restarts == 1)

    _, children, done = run_pipeline(scenario, workers=2, timeout_s=0.5)
    assert "answered no batch within 0.5 s" in str(done[1][2]) and len(done) == 2


def test_a_watched_socket_is_blocking():
    """uvloop makes a watched descriptor non-blocking: a batch's seeds larger than the
    socket's buffer broke off mid-message. Writes block again (reads never wait)."""
    async def scenario(pipe, children, done):
        assert os.get_blocking(pipe._children[0].fd)

    run_pipeline(scenario, workers=1)


def test_an_answer_in_pieces_is_read_as_it_comes_and_a_stalled_one_holds_only_its_batch(monkeypatch):
    """The loop reads what has arrived and returns: the other child serves meanwhile, a
    later piece completes the answer, and a child stopped mid-answer is killed after the
    stall limit (the loop never waits on it; before, it held the loop that long)."""
    import hybridgnn.pipelines.process_pipeline as process_pipeline

    monkeypatch.setattr(process_pipeline, "STALL_S", 2.0)  # the first half-answer must outlive a busy machine's lag

    async def scenario(pipe, children, done):
        children[0].hold = True
        pipe.submit(make_batch([1]), PLAN)
        children[0].answer_half()
        pipe.submit(make_batch([2]), PLAN)
        await until(lambda: len(done) == 1)  # child 1 answered; child 0's half waits
        assert done[0][0] == [2]
        os.write(children[0]._w, b"k")
        await until(lambda: len(done) == 2)
        assert done[1][0] == [1] and done[1][2] is None
        pipe.submit(make_batch([3]), PLAN)  # child 1 (idle first) answers it
        pipe.submit(make_batch([4]), PLAN)  # child 0, which stops mid-answer
        children[0].answer_half()
        await until(lambda: len(done) == 3)
        assert done[2][0] == [3]
        await until(lambda: len(done) == 4, deadline_s=10)

    _, children, done = run_pipeline(scenario, workers=2, timeout_s=None)  # no batch timeout: the stall ends it
    assert done[3][0] == [4] and "stopped in the middle of an answer for 2 s" in str(done[3][2])
    assert children[0].restarts == 1 and children[0].kills == 1
