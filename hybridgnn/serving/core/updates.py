"""Graph updates: the applier that appends decoded updates to the update log and answers
each once this replica's follower has applied it (the request is decoded and validated
by the v2 service: serving/v2/requests.py decode_update).

Updates (any of): add_edges [m, 2] (source, target: target aggregates from source),
remove_edges [k, 2], add_node_features [a, F] (new nodes, in order), remove_nodes [r],
update_ids [u] with update_features [u, F]. Ids -1 .. -a in add_edges / update_ids name
the request's new nodes (-1 the first), so a request never needs to know which ids the
server will assign; the answer lists them.

Each request applies entirely or not at all. Queued requests are merged into one log
entry (up to max_batch_updates); a request that would not apply to the graph as this
replica has it (once caught up with the log) is refused before it is logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridgnn.config import UpdateConfig
from hybridgnn.errors import (
    Conflict,
    Draining,
    ServiceUnavailable,
    ServingError,
    UpdateError,
)
from hybridgnn.types import ServingStats
from hybridgnn.updates.follower import ANSWER_WAIT_S, Follower, discard_outcome
from hybridgnn.updates.requests import (
    LoggedRequest,
    UpdateRequest,
    build_request,
    encode_entry,
    to_batch,
)

log = logging.getLogger("hybridgnn.updates")

APPEND_WAIT_S = 30.0  # how long a stop waits for a log append in flight before the log closes


@dataclass
class PendingUpdate:
    """A decoded update waiting to be logged."""

    logged: LoggedRequest
    num_updates: int
    received_s: float = 0.0
    # built once at decode where that needs no graph (a dataset without an id map); else
    # built against the graph when it is checked and applied
    built: UpdateRequest | None = None

    @property
    def idempotency_key(self) -> str | None:
        return self.logged.idempotency_key


@dataclass
class _Waiting:
    update: PendingUpdate
    future: asyncio.Future


class UpdateApplier:
    """Takes decoded updates, merges what is queued into log entries (one appender task,
    appends on a worker thread) and answers each request with its entry's outcome once
    the follower has applied it here."""

    def __init__(self, cfg: UpdateConfig, follower: Follower, graph, stats: ServingStats,
                 on_group: Callable[[float, float], None] | None = None):
        """on_group(updates, seconds): each log entry applied here, with the time from its
        group's checks to its outcomes (the updates lane's cost model learns from these)."""
        self.cfg = cfg
        self.follower = follower
        self.graph = graph  # DynamicGraph
        self.stats = stats
        self.on_group = on_group
        self._queue: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._inflight: dict[str, tuple[str, asyncio.Future]] = {}  # idempotency key -> (body sha256, future)
        # Every accepted update not answered yet (queued, being logged, or logged and not yet
        # applied here) -> when it was received: the staleness gauge's oldest.
        self._unanswered: dict[asyncio.Future, float] = {}
        self._task: asyncio.Task | None = None
        self._stop_why = "server is shutting down"
        self._append: asyncio.Future | None = None  # the log append in flight, if any

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="graph-updates")

    async def stop(self, why: str = "server is shutting down") -> None:
        self._stop_why = why  # what a group cut short by the cancellation is told
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._append is not None:  # the log is closed after this stop: let the append end first
            await asyncio.wait([self._append], timeout=APPEND_WAIT_S)
        for w in self._queue:  # a drain normally empties it first
            if not w.future.done():
                w.future.set_exception(Draining(f"{why}; nothing of this update was logged"))
        self._queue.clear()

    def hand_over(self, to: UpdateApplier) -> None:
        """Move the updates queued here (none logged yet) to another applier, in order."""
        to._queue[:0] = self._queue
        to.on_group = to.on_group or self.on_group
        for w in self._queue:
            to._track(w.future, w.update.received_s)
        self._queue.clear()
        if to._queue:
            to._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def staleness_s(self) -> float:
        """Age of the oldest update accepted but not yet visible here: queued, being logged,
        or logged and not yet applied by this replica (0 when none is)."""
        return time.monotonic() - min(self._unanswered.values()) if self._unanswered else 0.0

    def _track(self, fut: asyncio.Future, received_s: float) -> None:
        self._unanswered[fut] = received_s
        fut.add_done_callback(lambda f: self._unanswered.pop(f, None))

    def submit(self, update: PendingUpdate) -> asyncio.Future:
        """Queue an update; its future resolves to the answer. A request whose idempotency
        key was applied, or is in flight, gets that request's answer (marked "replayed")
        and applies nothing."""
        loop = asyncio.get_running_loop()
        key, digest = update.logged.idempotency_key, update.logged.body_sha256
        if key is not None:
            replay = self._replay(key, digest)
            if replay is not None:
                fut = loop.create_future()
                fut.set_result(replay)
                return fut
            if key in self._inflight:
                if self._inflight[key][0] != digest:
                    raise _key_conflict(key)
                return _replay_of(self._inflight[key][1])
        if self._task is not None and self._task.done():  # stopped: nothing would take it from the queue
            raise Draining(f"{self._stop_why}; nothing of this update was logged")
        if self.follower.stranded is not None:  # it would be logged (and applied elsewhere), never answered here
            raise ServiceUnavailable(f"{self.follower.stranded}; nothing of this update was logged (another replica "
                                     "takes it)")
        fut = loop.create_future()
        self._queue.append(_Waiting(update, fut))
        self._track(fut, update.received_s)
        if key is not None:
            self._inflight[key] = (digest, fut)
            fut.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))
        self._wake.set()
        return fut

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                take, total = [], 0
                while self._queue and (not take or total + self._queue[0].update.num_updates
                                       <= self.cfg.max_batch_updates):
                    w = self._queue.pop(0)
                    take.append(w)
                    total += w.update.num_updates
                await self._log_group(take)

    async def _log_group(self, group: list[_Waiting]) -> None:
        """Refuse what would not apply, append the rest as one entry, and answer each
        request from the entry's outcomes when the follower has applied it."""
        log_ = self.follower.log
        appending = False
        t0 = time.perf_counter()
        try:
            errors = await asyncio.to_thread(self._refusals, [w.update for w in group])
            if any(e is not None for e in errors):
                head = await asyncio.to_thread(log_.head)
                if self.follower.applied < head:
                    # Behind the log: what looks invalid may be valid once caught up.
                    await self.follower.wait_for(head, self.cfg.max_catch_up_s)
                    errors = await asyncio.to_thread(self._refusals, [w.update for w in group])
            for w, err in zip(group, errors, strict=True):
                if err is None or self._replayed(w):
                    continue
                self.stats.updates_rejected()
                if not w.future.done():  # done: cancelled, its caller gone (setting it would raise)
                    w.future.set_exception(err)
            group = [w for w, err in zip(group, errors, strict=True) if err is None]
            if not group:
                return
            entry = [w.update.logged for w in group]
            # The append goes on in its thread even if this task is cancelled (shielded: an
            # entry is never half-written); whether it lands is then unknown here.
            appending = True
            self._append = asyncio.ensure_future(asyncio.to_thread(lambda: log_.append(encode_entry(entry))))
            position = await asyncio.shield(self._append)
        except asyncio.CancelledError:
            if appending:
                self._append.add_done_callback(discard_outcome)
            # Stopped with this group taken from the queue: each request hears now.
            cut_short = (ServiceUnavailable(f"{self._stop_why}; the update may have been logged: retry with the "
                                            "same Idempotency-Key (applied once), or read graph_version first")
                         if appending else Draining(f"{self._stop_why}; nothing of this update was logged"))
            for w in group:
                if not w.future.done():
                    w.future.set_exception(cut_short)
            raise
        except Exception as exc:
            if not isinstance(exc, ServingError):
                log.exception("logging a graph update failed")
            for w in group:
                if not w.future.done():
                    w.future.set_exception(exc)
            return
        loop = asyncio.get_running_loop()

        def too_slow() -> None:
            for w in group:
                if not w.future.done():
                    w.future.set_exception(ServiceUnavailable(
                        f"the update was logged (position {position}) but this replica has not applied it within "
                        f"{ANSWER_WAIT_S:.0f}s; retry with the same Idempotency-Key"))

        timer = loop.call_later(ANSWER_WAIT_S, too_slow)

        def answer(done: asyncio.Future) -> None:
            timer.cancel()
            exc = done.exception()
            outcomes = done.result() if exc is None else [exc] * len(group)
            if len(outcomes) != len(group):  # an unreadable entry: nothing of it applied
                outcomes = [ServingError("the update's log entry could not be read back", status=500)] * len(group)
            elif exc is None and self.on_group is not None:
                self.on_group(float(sum(max(1, w.update.num_updates) for w in group)), time.perf_counter() - t0)
            for w, out in zip(group, outcomes, strict=True):
                if w.future.done():
                    continue
                if isinstance(out, BaseException):
                    w.future.set_exception(out)
                else:
                    w.future.set_result(out)

        self.follower.outcomes(position).add_done_callback(answer)

    def _replay(self, key: str, digest: str) -> dict | None:
        """The first answer to the applied request that carried `key`, marked "replayed"
        (None if none applied); Conflict if that request had another body."""
        seen = self.follower.answer_for(key)
        if seen is None:
            return None
        if seen[0] != digest:
            raise _key_conflict(key)
        return {**seen[1], "replayed": True}

    def _replayed(self, w: _Waiting) -> bool:
        """Whether a request refused by the check is a retry of one the follower applied
        meanwhile (its first attempt was logged after it was queued): it gets the first
        answer, as at submit, not the refusal the applied update now causes."""
        key = w.update.logged.idempotency_key
        if w.future.done():  # cancelled: no one to answer
            return False
        try:
            replay = self._replay(key, w.update.logged.body_sha256) if key is not None else None
        except Conflict as exc:
            w.future.set_exception(exc)
            return True
        if replay is not None:
            w.future.set_result(replay)
        return replay is not None

    def _refusals(self, updates: list[PendingUpdate]) -> list[ServingError | None]:
        """For each update, the error it would get alone on the graph as it is now."""
        out: list[ServingError | None] = []
        g = self.graph
        for u in updates:
            try:
                req = u.built if u.built is not None else build_request(
                    u.logged.inputs, feature_dim=g.feature_dim, max_updates=self.cfg.max_request_updates,
                    id_map=g.base.id_map)
                g.check(lambda n, req=req: to_batch([req], n)[0])
                ids = req.new_external_ids
                if ids is not None and len(ids) and g.base.id_map.to_internal(ids)[1].any():
                    raise UpdateError("a node in add_node_ids already exists")
                out.append(None)
            except ServingError as exc:
                out.append(exc)
        return out


def _replay_of(first: asyncio.Future) -> asyncio.Future:
    """A retry's answer while its first attempt is in flight: the first one's outcome,
    marked "replayed" as any retry's is (it applies nothing). A future of its own, so
    that cancelling one waiter never cancels the other."""
    fut = first.get_loop().create_future()

    def copy(done: asyncio.Future) -> None:
        if fut.done():
            return
        if done.cancelled():
            fut.cancel()
        elif done.exception() is not None:
            fut.set_exception(done.exception())
        else:
            fut.set_result({**done.result(), "replayed": True})

    first.add_done_callback(copy)
    return fut


def _key_conflict(key: str) -> Conflict:
    return Conflict(f"Idempotency-Key {key!r} was used with a different update; use a new key for a new update")
