"""Looking at a worker process that holds a batch: stopped or deadlocked children are told
apart from ones that compute, wait on the disk or sit under a debugger."""

import os

import pytest

from hybridgnn.pipelines import liveness
from hybridgnn.pipelines.liveness import (
    DEFAULT_BATCH_TIMEOUT_S,
    ChildActivity,
    Liveness,
    batch_timeout_s,
    read_activity,
)


def looks(states_and_ticks, step_s=1.0):
    """The verdict after each look at a child reporting these (state, ticks)."""
    watch = Liveness()
    verdicts = [watch.observe(ChildActivity(state, ticks), step_s) for state, ticks in states_and_ticks]
    return [(v.reason, v.resend) if v is not None else None for v in verdicts]


def test_a_stopped_child_is_hung_after_the_stopped_limit_and_not_before(monkeypatch):
    monkeypatch.setattr(liveness, "STOPPED_LIMIT_S", 3.0)
    verdicts = looks([("R", 5), ("T", 5), ("T", 5), ("T", 5)])
    assert verdicts[:3] == [None, None, None]
    assert "stopped (SIGSTOP) for 3 s" in verdicts[3][0] and verdicts[3][1]  # its batch is innocent


def test_a_child_resumed_before_the_limit_starts_counting_again(monkeypatch):
    monkeypatch.setattr(liveness, "STOPPED_LIMIT_S", 3.0)
    assert looks([("T", 5), ("T", 5), ("R", 6), ("T", 6), ("T", 6)]) == [None] * 5


def test_a_child_without_cpu_progress_is_deadlocked_after_the_idle_limit(monkeypatch):
    monkeypatch.setattr(liveness, "IDLE_LIMIT_S", 2.0)
    verdicts = looks([("S", 7), ("S", 7), ("S", 7)])
    assert verdicts[:2] == [None, None] and "used no CPU for 2 s" in verdicts[2][0]
    assert not verdicts[2][1]  # the batch may be what deadlocks it


@pytest.mark.parametrize("state", ["D", "t"])  # waiting on the disk; under a debugger
def test_disk_waits_and_debuggers_are_not_hung(monkeypatch, state):
    monkeypatch.setattr(liveness, "IDLE_LIMIT_S", 2.0)
    monkeypatch.setattr(liveness, "STOPPED_LIMIT_S", 2.0)
    assert looks([(state, 7)] * 6) == [None] * 6


def test_a_computing_child_is_never_hung(monkeypatch):
    monkeypatch.setattr(liveness, "IDLE_LIMIT_S", 2.0)
    assert looks([("R", t) for t in range(10)] + [("S", t) for t in range(10, 20)]) == [None] * 20


def test_unknown_activity_leaves_the_decision_to_the_timeout(monkeypatch):
    monkeypatch.setattr(liveness, "IDLE_LIMIT_S", 1.0)
    watch = Liveness()
    assert all(watch.observe(None, 5.0) is None for _ in range(5))


def test_read_activity_reads_this_process_and_none_for_a_missing_one():
    me = read_activity(os.getpid())
    if me is None:
        pytest.skip("no /proc here")
    assert me.state in "RS" and me.cpu_ticks >= 0
    assert read_activity(2**22 + 12345) is None  # past pid_max: no such process


def test_the_worker_batch_timeout_comes_from_the_environment(monkeypatch):
    assert batch_timeout_s() == DEFAULT_BATCH_TIMEOUT_S
    monkeypatch.setenv("HYBRIDGNN_WORKER_BATCH_TIMEOUT_S", "0")
    assert batch_timeout_s() is None  # never
    monkeypatch.setenv("HYBRIDGNN_WORKER_BATCH_TIMEOUT_S", "2.5")
    assert batch_timeout_s() == 2.5
    for bad in ("-1", "nan", "soon"):
        monkeypatch.setenv("HYBRIDGNN_WORKER_BATCH_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="HYBRIDGNN_WORKER_BATCH_TIMEOUT_S"):
            batch_timeout_s()
