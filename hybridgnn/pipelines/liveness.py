"""Whether a worker process holding a batch can still answer it, from what /proc says.

A stopped child (SIGSTOP, a terminal's ^Z to its group) or a deadlocked one never answers,
and the batch timeout that would end it is minutes. Pure decisions over readings: the
pipelines look, this judges.
"""

from __future__ import annotations

import dataclasses
import math

from hybridgnn.config import env_default

# A child that answers no batch for this long is hung (stopped, deadlocked): it is killed,
# its batch fails, and the next batch starts a new one. Far past a batch's time, even a
# first one paging its rows in from slow storage; HYBRIDGNN_WORKER_BATCH_TIMEOUT_S sets
# it (0: never).
DEFAULT_BATCH_TIMEOUT_S = 300.0


def batch_timeout_s() -> float | None:
    """The hung-child timeout from the environment (None: off)."""
    value = env_default("WORKER_BATCH_TIMEOUT_S", DEFAULT_BATCH_TIMEOUT_S, float)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"HYBRIDGNN_WORKER_BATCH_TIMEOUT_S must be a number of seconds >= 0, got {value}")
    return value or None


# Between answers a child holding a batch is looked at every LIVENESS_CHECK_S: one stopped
# (SIGSTOP, a terminal's ^Z to its group) for STOPPED_LIMIT_S, or one that spends no CPU for
# IDLE_LIMIT_S while not waiting on the disk (deadlocked: a CPU batch always computes, its
# intra-op threads' time counts too), will not answer and is treated as hung, long before the
# batch timeout. A debugger's stop ('t') is left alone.
LIVENESS_CHECK_S = 1.0
STOPPED_LIMIT_S = 10.0
IDLE_LIMIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class ChildActivity:
    """What /proc says of a child: its state letter and CPU clock ticks (all threads)."""
    state: str
    cpu_ticks: int


def read_activity(pid: int) -> ChildActivity | None:
    """/proc/PID/stat's state and utime+stime (None: not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the name in parentheses may hold spaces
    try:
        return ChildActivity(fields[0].decode("ascii", "replace"), int(fields[11]) + int(fields[12]))
    except (IndexError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Hung:
    """Why a child will not answer, and whether its batch may go to another child: a stop
    came from outside (the batch is innocent), a deadlock may be the batch's own doing."""
    reason: str
    resend: bool


@dataclasses.dataclass
class Liveness:
    """How long a child holding a batch has been stopped, or without using CPU."""
    stopped_s: float = 0.0
    idle_s: float = 0.0
    cpu_ticks: int | None = None

    def observe(self, now: ChildActivity | None, elapsed_s: float) -> Hung | None:
        """Take one look: why the child is hung, or None while it may still answer."""
        if now is None:
            return None  # unknown (no /proc): the batch timeout alone decides
        self.stopped_s = self.stopped_s + elapsed_s if now.state == "T" else 0.0
        idle = self.cpu_ticks is not None and now.cpu_ticks == self.cpu_ticks and now.state not in "DTt"
        self.idle_s = self.idle_s + elapsed_s if idle else 0.0
        self.cpu_ticks = now.cpu_ticks
        if self.stopped_s >= STOPPED_LIMIT_S:
            return Hung(f"was stopped (SIGSTOP) for {self.stopped_s:.0f} s holding a batch", resend=True)
        if self.idle_s >= IDLE_LIMIT_S:
            return Hung(f"used no CPU for {self.idle_s:.0f} s holding a batch (deadlocked)", resend=False)
        return None
