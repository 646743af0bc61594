"""The follower: applies the update log's entries, in position order, to this replica.

Every replica runs one, so every replica goes through the same states: an entry's
requests are built and validated against the graph as it is at that position, merged
and applied all or nothing; if the merge is rejected each request is applied alone (so
one bad request never takes the others down), and a request's new nodes get the next
ids. The outcome of an entry (an answer or an error per request) is therefore the same
on every replica; the replica that accepted a request answers with it.

Idempotency keys ride in the entries: a request whose key an earlier entry applied is
answered with that first answer (marked "replayed") and applies nothing; the most
recent MEMORY_KEYS keys are kept (in snapshots too).

The graph_version an answer reports is the log position of its entry; a replica's
applied position is how far its graph has got.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import sys
import time
from collections.abc import Callable

import numpy as np

from hybridgnn.config import UpdateConfig
from hybridgnn.errors import (
    ConfigError,
    Conflict,
    LogFromAnotherBuild,
    LogTrimmed,
    ServiceUnavailable,
    ServingError,
    UpdateError,
)
from hybridgnn.graph.journal import Journal
from hybridgnn.types import ServingStats, UpdateStats
from hybridgnn.updates.log import LogEntry, UpdateLog
from hybridgnn.updates.requests import (
    EntryFormat,
    LoggedRequest,
    UpdateRequest,
    build_request,
    decode_entry,
    to_batch,
)

log = logging.getLogger("hybridgnn.updates")

MEMORY_KEYS = 100_000  # idempotency keys remembered (bounded: keys come from clients)
MEMORY_KEY_IDS = 2_000_000  # new-node ids held in remembered answers, at most
ANSWER_WAIT_S = 30.0  # a logged update not applied here within this is answered 503 (retry with its key)
RECENT_OUTCOMES = 512  # entries whose outcomes stay readable after they applied
READ_LIMIT = 64  # entries per read
BLOCK_S = 0.1  # how long one read waits for a new entry
MAX_VERSION_WAITERS = 10_000  # reads waiting for a graph version, at most (more: 503 at once)

Outcome = dict | BaseException


class Follower:
    """Applies log entries after `position` to the graph (a DynamicGraph) and, when
    given, its incrementally maintained embeddings. `keys`: the idempotency keys a
    snapshot carried, as (key, body sha256, answer)."""

    def __init__(self, update_log: UpdateLog, graph, incremental, stats: ServingStats, cfg: UpdateConfig, *,
                 position: int = 0, keys: list[tuple[str, str, dict]] | None = None, snapshots=None):
        self.log = update_log
        self.graph = graph
        self.incremental = incremental
        self.stats = stats
        self.cfg = cfg
        self.applied = position  # the last position applied here
        self.head_seen = position  # the highest position this follower has read
        self.keys: collections.OrderedDict[str, tuple[str, dict]] = collections.OrderedDict()
        self._key_ids = 0
        for k, d, a in keys or []:
            self._remember(k, d, a)
        self._resume: tuple | None = None  # an entry stopped part-way: (position, logged, todo, outcomes, next)
        self.done_before_failure: list[tuple[int, list[Outcome]]] = []
        self._behind_since: float | None = None  # append time of the first entry read but not applied
        self._recent: collections.OrderedDict[int, list[Outcome]] = collections.OrderedDict()
        # The last position whose outcomes the event loop has handed out: `applied` moves
        # on the follower's thread first.
        self._resolved_upto = position
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._version_waiters: list[tuple[int, int, asyncio.Future]] = []  # a heap by position
        self._live_version_waiters = 0
        self._seq = itertools.count()
        self._stepping: asyncio.Future | None = None
        self._let_go_of: asyncio.Future | None = None  # a step whose awaiter was cancelled
        self._task: asyncio.Task | None = None
        self._background: asyncio.Task | None = None
        self.snapshots = snapshots  # updates.snapshot.Snapshots, or None (no snapshots written)
        self._job: Callable[[], None] | None = None  # a compaction or snapshot write to run in the background
        self._job_running = False
        self.failed: str | None = None  # why the last step failed (cleared by a good one)
        self._stopping = False  # stop() began: the log may be closed under a background job
        self.stranded: str | None = None  # why this replica cannot apply the log again (trimmed past it)
        self.applying: int | None = None  # the entry a failed step failed in (None: it failed reading)

    # --- applying (worker thread) ----------------------------------------------------------
    def step(self, limit: int = READ_LIMIT, block_s: float = BLOCK_S) -> list[tuple[int, list[Outcome]]]:
        """Read and apply the next entries; returns their outcomes by position. If an
        entry fails to apply, the ones before it are kept in `self.done_before_failure`
        (the caller still answers them) and the exception propagates: the entry is tried
        again from where it stopped."""
        done: list[tuple[int, list[Outcome]]] = []
        self.done_before_failure = done
        self.applying = None
        entries = self.log.read(self.applied, limit, block_s)
        for i, entry in enumerate(entries):
            self.head_seen = max(self.head_seen, entries[-1].position)
            self._behind_since = entry.appended_unix_s
            self.applying = entry.position
            done.append((entry.position, self.apply_entry(entry)))
            self._behind_since = entries[i + 1].appended_unix_s if i + 1 < len(entries) else None
        self.applying = None
        # also after a step that read nothing: entries applied while the last job ran were
        # otherwise never snapshotted until another entry came (a burst's last ones)
        if self._job is None and not self._job_running:
            self._job = self._maintenance()
        return done

    def _maintenance(self) -> Callable[[], None] | None:
        """Work for between entries (here, the only writer's thread, so what a snapshot
        copies is exactly the state at self.applied): folding the graph's patches, or a
        snapshot's copy, written to disk later in the background."""
        if self.graph.patched_entries >= self.cfg.compact_patched_entries:
            def compact() -> None:
                t0 = time.perf_counter()
                if self.graph.compact():
                    self.stats.compacted()
                    log.info("compacted the graph's patches in %.2fs", time.perf_counter() - t0)
            return compact
        if self.snapshots is not None and self.snapshots.due(self.applied):
            captured = self.snapshots.capture(self.applied, self.graph, self.incremental, self.keys)

            def snapshot() -> None:
                self.snapshots.write(captured)
                if not self._stopping:  # stopping does not wait for this write; the log closes after
                    self.trim_log()
            return snapshot
        return None

    def trim_log(self) -> int:
        """With log_retain set: drop the log's entries that every kept snapshot covers,
        beyond the newest log_retain, so a replica starting from any kept snapshot (the
        newest may not load) still finds the rest. Returns how many entries went."""
        retain = self.cfg.log_retain
        oldest = self.snapshots.oldest_position() if retain and self.snapshots is not None else None
        if oldest is None:
            return 0
        upto = min(oldest, self.log.head() - retain)
        if upto < self.log.first():
            return 0
        gone = self.log.trim(upto)
        if gone:
            log.info("trimmed the update log %s up to position %d (%d entries)", self.log.url, upto, gone)
        return gone

    def catch_up(self) -> int:
        """Apply every entry up to the log's head as it is now (at start, before serving);
        returns how many were applied. ConfigError (a refusal to start) when the log was
        trimmed past this replica."""
        head, start, t0 = self.log.head(), self.applied, time.perf_counter()
        if head > self.applied:
            log.info("catching up with the update log %s: positions %d..%d", self.log.url, self.applied + 1, head)
        next_report = self.applied + 1000
        while self.applied < head:
            try:
                if not self.step(256, BLOCK_S):
                    break
            except (LogTrimmed, LogFromAnotherBuild) as exc:
                # trimmed past it since it chose its start, or an entry of another build: no start
                raise ConfigError(str(exc)) from exc
            if self.applied >= next_report:
                log.info("applied update log position %d of %d", self.applied, head)
                next_report = self.applied + 1000
        self._resolved_upto = self.applied  # nobody waits for what was applied before serving
        if self.applied > start:
            log.info("caught up: %d log entries in %.2fs, graph version %d, %d nodes", self.applied - start,
                     time.perf_counter() - t0, self.applied, self.graph.num_nodes)
        return self.applied - start

    def apply_entry(self, entry: LogEntry) -> list[Outcome]:
        """Apply one entry (deterministically: same graph in, same graph and outcomes out).
        Each request applies atomically; if one fails for a reason of this replica (not
        an UpdateError), the exception propagates and the next call for this entry
        resumes at that request, so none is applied twice."""
        resume = self._resume if self._resume is not None and self._resume[0] == entry.position else None
        if resume is not None:
            _, logged, todo, outcomes, start = resume
        else:
            try:
                logged = decode_entry(entry.body)
            except EntryFormat as exc:  # written by another build: this one must not go past it
                raise LogFromAnotherBuild(self.log.url, entry.position, str(exc)) from None
            except (ValueError, OSError, KeyError) as exc:  # damaged: alike on every replica
                log.error("update log %s position %d is unreadable (%s); skipped on every replica", self.log.url,
                          entry.position, exc)
                self.applied = entry.position
                return []
            outcomes, todo = self._build(logged)
            try:
                self._apply_group(entry.position, todo, outcomes)
                start = len(todo)
            except UpdateError:
                start = 0  # one of them is bad: apply each alone, entirely or not at all
        for k in range(start, len(todo)):
            self._resume = (entry.position, logged, todo, outcomes, k)
            try:
                self._apply_group(entry.position, [todo[k]], outcomes)
            except UpdateError as exc:
                outcomes[todo[k][0]] = exc
        self._resume = None
        for i, lr in enumerate(logged):
            out = outcomes[i]
            if isinstance(out, int):  # a twin of an earlier request of this entry
                out = outcomes[i] = ({**outcomes[out], "replayed": True} if isinstance(outcomes[out], dict)
                                     else outcomes[out])
            if isinstance(out, BaseException):
                self.stats.updates_rejected()
            elif lr.idempotency_key is not None and not out.get("replayed"):
                self._remember(lr.idempotency_key, lr.body_sha256 or "", out)
        self.applied = entry.position
        return outcomes

    def _build(self, logged: list[LoggedRequest]) -> tuple[list, list[tuple[int, UpdateRequest]]]:
        """Each request built against the graph as it is (errors as outcomes), and the
        ones to apply; what a key already answered is that answer."""
        outcomes: list[Outcome | int | None] = [None] * len(logged)
        todo: list[tuple[int, UpdateRequest]] = []
        first_with_key: dict[str, int] = {}
        for i, lr in enumerate(logged):
            key = lr.idempotency_key
            if key is not None and (key in self.keys or key in first_with_key):
                twin = first_with_key.get(key)
                outcomes[i] = self._seen_key(lr, None if twin is None else logged[twin], twin)
                continue
            try:
                # No size limit here: limits are checked where a request is accepted, and
                # one replica's settings must not make it reject what the others apply.
                todo.append((i, build_request(lr.inputs, feature_dim=self.graph.feature_dim, max_updates=sys.maxsize,
                                              id_map=self.graph.base.id_map)))
            except ServingError as exc:
                outcomes[i] = exc
                continue
            if key is not None:
                first_with_key[key] = i
        return outcomes, todo

    def _remember(self, key: str, digest: str, answer: dict) -> None:
        """Keep a key's answer; the oldest go first past MEMORY_KEYS keys or
        MEMORY_KEY_IDS node ids in their answers (bounded: keys come from clients)."""
        self.keys[key] = (digest, answer)
        self._key_ids += len(answer["new_node_ids"])
        while len(self.keys) > MEMORY_KEYS or (self._key_ids > MEMORY_KEY_IDS and len(self.keys) > 1):
            _, (_, old) = self.keys.popitem(last=False)
            self._key_ids -= len(old["new_node_ids"])

    def _seen_key(self, lr: LoggedRequest, twin: LoggedRequest | None, twin_index: int | None) -> Outcome | int:
        """The outcome of a request whose key was applied before (or, twin, carried by an
        earlier request of this entry: then that request's index, resolved later)."""
        digest = twin.body_sha256 or "" if twin is not None else self.keys[lr.idempotency_key][0]
        if digest != (lr.body_sha256 or ""):
            return Conflict(f"Idempotency-Key {lr.idempotency_key!r} was used with a different update; use a new key "
                            "for a new update")
        return twin_index if twin is not None else {**self.keys[lr.idempotency_key][1], "replayed": True}

    def _apply_group(self, position: int, items: list[tuple[int, UpdateRequest]], outcomes: list) -> None:
        if not items:
            return
        requests = [r for _, r in items]
        t0 = time.perf_counter()
        n = self.graph.num_nodes  # this thread is the only writer: stable until the apply
        batch, assigned = to_batch(requests, n)
        id_map = self.graph.base.id_map
        new_external = None
        if id_map is not None:
            new_external = np.concatenate([r.new_external_ids for r in requests if r.new_external_ids is not None]
                                          or [np.empty(0, np.int64)])
            if len(np.unique(new_external)) != len(new_external):
                raise UpdateError("a node in add_node_ids is named by two requests")
            if len(new_external) and id_map.to_internal(new_external)[1].any():
                raise UpdateError("a node in add_node_ids already exists")

        def commit() -> None:  # last, under the writer lock: readers see the ids with the nodes
            if id_map is not None and len(new_external):
                id_map.extend(new_external)

        if self.incremental is not None:
            report = self.incremental.apply(batch, commit)
            affected, propagate_s = report.affected_nodes, report.propagate_s
        else:
            journal = Journal()
            with self.graph.lock.write():
                try:
                    self.graph.apply(batch, journal)
                    commit()
                except BaseException:
                    journal.rollback()
                    raise
            affected, propagate_s = 0, None
        counts = {"add_edges": len(batch.add_edges), "remove_edges": len(batch.remove_edges),
                  "add_nodes": sum(len(a) for a in assigned), "remove_nodes": len(batch.remove_nodes),
                  "update_features": len(batch.update_ids)}
        self.stats.updates_applied(UpdateStats(time.perf_counter() - t0, propagate_s, affected, counts))
        if id_map is not None:  # answer in the client's own ids
            assigned = [id_map.to_external(ids) for ids in assigned]
        for (i, r), ids in zip(items, assigned, strict=True):
            outcomes[i] = {"graph_version": position, "log_position": position, "new_node_ids": ids.tolist(),
                           "updates": r.num_updates, "batch_updates": batch.num_updates, "affected_nodes": affected}

    # --- the replica's view (event loop) -----------------------------------------------------
    def lag_s(self) -> float:
        """Seconds since the oldest entry this replica has read but not applied was appended
        (0 when caught up with what it has read); for a stranded replica (the log trimmed
        past it), at least the seconds since it found that out."""
        since = self._behind_since
        return max(0.0, time.time() - since) if since is not None else 0.0

    def answer_for(self, key: str) -> tuple[str, dict] | None:
        """(body sha256, answer) of the applied request that carried this key, if any."""
        return self.keys.get(key)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="update-follower")

    async def stop(self, why: str = "server is shutting down") -> None:
        self._stopping = True
        for t in (self._task, self._background):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        stepping = self._stepping
        if stepping is not None:  # let the step in flight finish before the log closes
            await asyncio.wait([stepping], timeout=30)
        if stepping is not None and stepping is self._let_go_of and stepping.done() and not stepping.cancelled():
            # _run was stopped while this step applied: what it applied is answered as
            # applied, not as a bare 503.
            failed = stepping.exception() is not None
            for position, outcomes in self.done_before_failure if failed else stepping.result():
                self._resolve(position, outcomes)
            self._release_versions()
        for futs in self._waiters.values():
            for f in futs:
                if not f.done():
                    f.set_exception(ServiceUnavailable(why))

    async def _run(self) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        while True:
            self._stepping = loop.run_in_executor(None, self.step)
            try:
                done = await asyncio.shield(self._stepping)
            except asyncio.CancelledError:
                # The shield lets go of the step: no one reads its outcome now (stop may).
                self._stepping.add_done_callback(discard_outcome)
                self._let_go_of = self._stepping
                raise
            except Exception as exc:
                # What applied before the failure is answered; the failing entry is tried
                # again (from the request it stopped at) after a pause.
                for position, outcomes in self.done_before_failure:
                    self._resolve(position, outcomes)
                if isinstance(exc, ServiceUnavailable):
                    # the log is unreachable or trimmed past us (reading), or what applies it
                    # is down (a partitioned graph's ranks, applying): the requests waiting on
                    # that entry hear now, not after ANSWER_WAIT_S
                    self._failed(str(exc), backoff, stranded=isinstance(exc, (LogTrimmed, LogFromAnotherBuild)),
                                 position=self.applying)
                else:  # an apply that failed for a reason of this replica (memory, a bug)
                    log.exception("applying update log position %d failed; retrying", self.applied + 1)
                    self._failed(f"applying position {self.applied + 1} failed: {exc}", backoff,
                                 position=self.applied + 1)
                self._release_versions()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
                continue
            backoff, self.failed = 0.05, None
            for position, outcomes in done:
                self._resolve(position, outcomes)
            if done:
                self._release_versions()
            self._start_job()

    def _failed(self, why: str, backoff: float, position: int | None = None, stranded: bool = False) -> None:
        """Note a failed step; the requests waiting on the entry that failed to apply (if
        one did) hear now, as a 503 (their retry with the same Idempotency-Key is safe).
        stranded: the log was trimmed past this replica, or holds an entry of another build,
        which retrying cannot mend (an error, not a warning; the engine then reports not
        ready and refuses updates)."""
        if stranded:
            self.stranded = why
            if self._behind_since is None:
                # the entries it lacks were trimmed with their append times: its lag reads
                # as at least the time since it found out, not 0 (caught up)
                self._behind_since = time.time()
        if self.failed != why and stranded:
            log.error("update follower: %s", why)
        elif self.failed != why:
            log.warning("update follower: %s (retrying every %.2fs at most)", why, backoff)
        self.failed = why
        for f in self._waiters.pop(position, []) if position is not None else []:
            if not f.done():
                f.set_exception(ServiceUnavailable(f"the update was logged but could not be applied here yet: {why}; "
                                                   "retry with the same Idempotency-Key"))

    def _start_job(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        self._job_running = True

        def run() -> None:
            try:
                job()
            except Exception:
                log.exception("background update work (compaction or snapshot) failed")
            finally:
                self._job_running = False

        self._background = asyncio.create_task(asyncio.to_thread(run), name="update-background")

    def _resolve(self, position: int, outcomes: list[Outcome]) -> None:
        self._recent[position] = outcomes
        self._resolved_upto = max(self._resolved_upto, position)
        while len(self._recent) > RECENT_OUTCOMES:
            self._recent.popitem(last=False)
        for fut in self._waiters.pop(position, []):
            if not fut.done():
                fut.set_result(outcomes)

    def outcomes(self, position: int) -> asyncio.Future:
        """A future of the outcomes of the entry at `position` (one per request of it)."""
        fut = asyncio.get_running_loop().create_future()
        if position in self._recent:
            fut.set_result(self._recent[position])
        elif position <= self._resolved_upto:
            fut.set_exception(ServiceUnavailable("the update applied but its answer is no longer held; retry with "
                                                 "the same Idempotency-Key"))
        else:
            self._waiters.setdefault(position, []).append(fut)
        return fut

    async def wait_for(self, position: int, timeout_s: float) -> bool:
        """Whether this replica applies `position` within timeout_s (False at once when
        MAX_VERSION_WAITERS requests already wait)."""
        if self.applied >= position:
            return True
        if timeout_s <= 0 or self._live_version_waiters >= MAX_VERSION_WAITERS:
            return False
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._version_waiters, (position, next(self._seq), fut))
        self._live_version_waiters += 1
        try:
            # asyncio.wait, not wait_for: before Python 3.12, wait_for returns the result of
            # a future done in the turn its task is cancelled, and the cancellation is lost
            # (an applier stopped as the swap released its catch-up wait ran on for ever)
            done, _ = await asyncio.wait([fut], timeout=timeout_s)
            return bool(done)
        finally:
            if not fut.done():  # timed out or cancelled: _release_versions skips it, the sweep drops it
                fut.cancel()
            self._live_version_waiters -= 1
            if len(self._version_waiters) > 2 * self._live_version_waiters + 1024:  # drop the timed-out ones
                self._version_waiters = [w for w in self._version_waiters if not w[2].done()]
                heapq.heapify(self._version_waiters)

    def adopt_version_waiters(self, other: Follower) -> None:
        """Take the reads waiting in `other` for a graph version (a follower that replaces
        it: stopped, it would never release them, and they would time out as not caught
        up although this one applies the version); those it has applied go at once."""
        for w in other._version_waiters:
            if not w[2].done():
                heapq.heappush(self._version_waiters, w)
        other._version_waiters = []
        self._release_versions()

    def _release_versions(self) -> None:
        heap = self._version_waiters
        while heap and heap[0][0] <= self.applied:
            _, _, fut = heapq.heappop(heap)
            if not fut.done():
                fut.set_result(True)


def discard_outcome(future: asyncio.Future) -> None:
    """Done callback for work that was let go of (its awaiter was cancelled while the work
    runs on in a thread): mark its outcome read, so a failure is not logged as "never
    retrieved" from a finaliser, at any time, on any thread."""
    if not future.cancelled():
        future.exception()
