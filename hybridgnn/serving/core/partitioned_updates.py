"""Graph updates on a partitioned graph (`serve --partitions N --update-token T`).

The guarantees are the single-process server's, by the same parts: an accepted update
is appended to the durable update log before it is acknowledged (UpdateApplier), every
replica applies the log in position order (Follower), and an answer's graph_version is
its log position (read-your-writes with parameters.min_graph_version). What differs is
where a batch applies: RankGraph forwards it to the ranks (one UPDATE call), each rank
applies what it owns and the ranks refresh the embeddings together
(distributed/part_updates.py); this process keeps only the graph's description: node
and edge counts, which nodes exist, and the names of added nodes.

Ranks keep their state in memory only. Whenever the group is formed (at start, and
after a rank died and the group was restarted) it starts from the stored dataset, so
before it serves anything a new follower replays the whole log into it (RankGroup's
prepare hook, on the supervisor's thread); then the new follower, view and applier
replace the old ones on the event loop. An update whose entry was being applied when
the group died is answered 503: retried with the same Idempotency-Key it gets its
answer from the replay, applied once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridgnn.config import ServeConfig
from hybridgnn.errors import ConfigError, ServiceUnavailable, ServingError, UpdateError
from hybridgnn.graph.dynamic import UpdateBatch
from hybridgnn.graph.idmap import IdMap
from hybridgnn.serving.core.updates import UpdateApplier
from hybridgnn.types import ServingStats
from hybridgnn.updates.follower import Follower
from hybridgnn.updates.log import open_update_log

log = logging.getLogger("hybridgnn.updates")


@dataclass
class _Named:
    id_map: IdMap | None  # the follower and applier read the graph's names as graph.base.id_map


@dataclass
class _Applied:
    affected_nodes: int
    propagate_s: float


class RankGraph:
    """The partitioned graph as the update follower and applier use it (both its graph
    and its incremental embeddings): check and apply are calls to the ranks."""

    patched_entries = 0  # nothing to compact here: the ranks fold their own patches

    def __init__(self, num_nodes: int, feature_dim: int, id_map: IdMap | None, call: Callable, num_edges: int = 0):
        self.num_nodes = num_nodes
        self.num_edges = num_edges  # of the graph the ranks serve (their update reports say it)
        self.feature_dim = feature_dim
        self.base = _Named(id_map)
        self.alive = np.ones(num_nodes, dtype=bool)
        self.call = call  # RankGroup's: the preparing one during a replay, then the serving one
        self.generation: int | None = None  # the rank group this view's state is on
        self.retired = False  # a newer group replaced the ranks this view was applying to

    def _send(self, batch: UpdateBatch, check_only: bool, names: np.ndarray | None = None) -> dict:
        if self.retired:
            raise ServiceUnavailable("the partition ranks were restarted; retry with the same Idempotency-Key")
        arrays = batch.arrays(self.feature_dim) + ((names,) if names is not None else ())
        try:
            out, _ = self.call("update", {"check_only": check_only}, arrays)
        except ServingError as exc:
            if exc.status == 400:  # the ranks refused the batch, all alike: nothing of it applied
                # rank 0 sends UpdateError's message whole: its prefix once, not twice
                raise UpdateError(exc.message.removeprefix(UpdateError.prefix)) from None
            raise
        return out

    def check(self, batch_for) -> None:
        """UpdateError if the batch (made for this node count) would not apply now."""
        self._send(batch_for(self.num_nodes), check_only=True)

    def compact(self) -> bool:
        return False

    def apply(self, batch: UpdateBatch, commit: Callable[[], None] | None = None) -> _Applied:
        """commit (the new nodes' names), then the batch on the ranks (all or nothing:
        UpdateError changes nothing, the names included), then the description here. The
        names go first: the ranks cannot take a batch back, and names that failed after it
        had landed there left the entry to be retried, adding its nodes twice. The ranks get
        the names too: their messages name nodes as the client does."""
        id_map = self.base.id_map
        named = id_map.mark() if id_map is not None else None
        if commit is not None:
            commit()
        try:
            names = None
            added = 0 if batch.add_node_features is None else len(batch.add_node_features)
            if id_map is not None and added and len(id_map) == self.num_nodes + added:
                names = id_map.to_external(np.arange(self.num_nodes, self.num_nodes + added, dtype=np.int64))
            out = self._send(batch, check_only=False, names=names)
        except BaseException:
            if id_map is not None:
                id_map.rewind(named)
            raise
        n = int(out["num_nodes"])
        if n > len(self.alive):
            self.alive = np.concatenate([self.alive, np.ones(n - len(self.alive), dtype=bool)])
        self.alive[np.asarray(batch.remove_nodes, dtype=np.int64)] = False
        self.num_nodes = n
        self.num_edges = int(out.get("num_edges", self.num_edges))
        return _Applied(int(sum(out["affected_per_layer"])), float(out["propagate_s"]))

    def removed(self, node_ids: np.ndarray) -> np.ndarray:
        """The ids among node_ids that an update removed."""
        alive = self.alive
        return node_ids[~alive[np.minimum(node_ids, len(alive) - 1)]] if len(alive) else node_ids[:0]


class PartitionedUpdates:
    """The update log, follower, view and applier of a partitioned engine; the last three
    are made anew each time the rank group is formed."""

    def __init__(self, cfg: ServeConfig, graph, stats: ServingStats):
        self.cfg, self.graph, self.stats = cfg, graph, stats
        self.on_group: Callable[[float, float], None] | None = None  # each applier's (UpdateApplier)
        self.log = open_update_log(cfg.updates.log, graph.root, graph.fingerprint, replayed=True)
        first = self.log.first()
        if first > 1:  # another server on this log trims it (--update-log-retain)
            self.log.close()
            raise ConfigError(f"the update log {self.log.url} was trimmed (it holds entries from position {first} "
                              "on), but a partitioned server replays the whole log each time its ranks start: give "
                              "it a log of its own")
        self._names = graph.id_map  # the dataset's own names (added nodes' come from the log)
        self.view: RankGraph | None = None
        self.follower: Follower | None = None
        self.applier: UpdateApplier | None = None
        self._ready: tuple[RankGraph, Follower] | None = None  # prepared, not yet in use
        # prepare (the supervisor's thread) puts a view in _ready and swap (the event loop)
        # takes it: unlocked, a prepare between swap's read and its clearing was lost, and
        # the ranks served no update until the next restart
        self._ready_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._swapping: set[asyncio.Task] = set()
        self._stopped = False

    def prepare(self, call: Callable, hello: dict) -> None:
        """(The rank supervisor's thread, group formed but not serving.) A new view and
        follower from the dataset, with the whole log replayed into the ranks (reset first
        when they hold updates already: ranks under torchrun outlive a server)."""
        if self.view is not None:
            self.view.retired = True  # its follower must not apply to the new ranks
        if hello.get("updates_applied"):
            log.info("the partition ranks hold %d applied updates: resetting them to the stored graph",
                     hello["updates_applied"])
            call("reset", {}, ())
        names = IdMap(self._names.external) if self._names is not None else None
        view = RankGraph(self.graph.num_nodes, self.graph.feature_dim, names, call, self.graph.num_edges)
        view.generation = hello.get("generation")
        follower = Follower(self.log, view, view, self.stats, self.cfg.updates)
        try:
            follower.catch_up()
        except Exception as exc:
            # the group is restarted and replays again: the position says whether one entry
            # fails every time (its apply kills a rank) or the group just died meanwhile
            where = (f"at position {follower.applying}" if follower.applying is not None
                     else f"after position {follower.applied}")
            raise ServiceUnavailable(f"replaying the update log into the ranks failed {where}: {exc}") from exc
        view.call = None  # set to the serving call when swapped in
        with self._ready_lock:
            self._ready = (view, follower)
        if self._loop is not None:  # a restart: swap on the event loop
            self._loop.call_soon_threadsafe(self._schedule_swap)

    def _schedule_swap(self) -> None:
        if self._stopped:  # a group prepared while the server stops: nothing to swap in
            return
        task = asyncio.ensure_future(self._swap_or_log())
        self._swapping.add(task)
        task.add_done_callback(self._swapping.discard)

    async def _swap_or_log(self) -> None:
        try:
            await self.swap()
        except Exception:  # no one awaits a restart's swap: say it here
            log.exception("putting the restarted partition ranks into service failed")

    async def start(self, serving_call: Callable) -> None:
        """Put the view the first prepare made into service (after the ranks started)."""
        self._serving_call = serving_call
        self._loop = asyncio.get_running_loop()
        await self.swap()

    async def swap(self) -> None:
        with self._ready_lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return
        view, follower = ready
        # only to the group it was replayed into: a newer one has a view of its own
        view.call = functools.partial(self._serving_call, generation=view.generation)
        old_follower, old_applier = self.follower, self.applier
        self.view, self.follower = view, follower
        self.graph.id_map = view.base.id_map  # the names the front end maps request ids with
        self.applier = UpdateApplier(self.cfg.updates, follower, view, self.stats, on_group=self.on_group)
        if old_applier is not None:
            old_applier.hand_over(self.applier)  # queued updates were not logged yet: they go on
        if old_follower is not None:
            follower.adopt_version_waiters(old_follower)  # the old one stops without releasing them
        follower.start()
        self.applier.start()
        why = "the partition ranks were restarted; retry with the same Idempotency-Key"
        if old_applier is not None:
            await old_applier.stop(why)
        if old_follower is not None:
            await old_follower.stop(why)
        log.info("partitioned graph at update log position %d (%d nodes)", follower.applied, view.num_nodes)

    async def stop_applying(self) -> None:
        """Take no more updates; answer those in hand (as UpdateApplier.stop). No swap
        starts after this."""
        self._stopped = True
        # A swap in flight has its new follower and applier in place and is retiring the
        # old ones: let it finish (bounded by their stops), so every follower started stops.
        await asyncio.gather(*self._swapping, return_exceptions=True)
        if self.applier is not None:
            await self.applier.stop()

    async def stop(self) -> None:
        await self.stop_applying()
        if self.follower is not None:
            await self.follower.stop()
        self.log.close()
