"""The engine of a partitioned server (`serve --partitions N`): admission, batching and
answers as the single-process engine gives them, with every request computed by the
partition ranks together (types.PartitionRanks, one call at a time).

It holds no graph rows, features or embeddings: the dataset is opened for its
description only (memory-mapped, never read whole) and the model for its shape.
Requests of one kind that wait together go to the ranks as one call (existing-node ids
concatenated), and rank 0 splits the call by partition: each rank computes from its
own edges and rows. Modes: existing nodes `full` (whole neighbourhoods, the model's
exact output; the default) and `precomputed` (rows from their owners); new nodes
`full`, `pe`, `srpe` and `sampled` (keyed draws, the same sample one process draws).
Existing-node `sampled` is refused: the CPU and GPU samplers' draws would differ from
one process's, and answers are exact or refused. Graph updates (with an update token)
go through the update log to the ranks (partitioned_updates.py). With --seed-log, the ids of
full requests are counted per node (SeedCounts) and written as a single process's log is.

Event loop thread; calls run in a worker thread (RankGroup.call blocks).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from hybridgnn.config import ServeConfig, fanouts_for, fanouts_served
from hybridgnn.errors import (
    BadRequest,
    BatchFailed,
    Draining,
    Forbidden,
    RemovedNode,
    ServiceUnavailable,
)
from hybridgnn.graph.idmap import namer
from hybridgnn.scheduler.admission import admission_for
from hybridgnn.serving.core.admitting import Admitting
from hybridgnn.serving.core.partitioned_updates import PartitionedUpdates
from hybridgnn.serving.core.statistics import ModelStatistics
from hybridgnn.types import (
    EngineSnapshot,
    PartitionRanks,
    RequestResult,
    ServingStats,
    StageTimings,
)

log = logging.getLogger("hybridgnn.serving.core.engine")
NEW_NODE_MODES = ("full", "pe", "srpe", "sampled")
# A call waiting this long for the ranks (milliseconds, usually) makes the engine not ready:
# a balancer routes away while the ranks' own timeout (--partition-timeout-s) runs out
RANKS_STALLED_S = 5.0


@dataclass
class _Call:
    name: str                       # existing, lookup, new_nodes
    head: dict
    arrays: tuple
    future: asyncio.Future


class PartitionedEngine(Admitting):
    default_mode = "full"  # of existing-node requests that name none
    serves_full = True

    def __init__(self, cfg: ServeConfig, ranks: PartitionRanks, stats: ServingStats | None = None, *,
                 version: str = "1"):
        from hybridgnn.graph.store import GraphStore
        from hybridgnn.models.checkpoint import load_checkpoint, model_kind
        from hybridgnn.models.gnn import embedding_width

        self.stats = stats if stats is not None else ServingStats()
        self.model_version = version
        self.model_stats = ModelStatistics()
        self.graph = GraphStore.open(cfg.dataset_dir)  # its description: rows stay on disk
        model, saved = load_checkpoint(cfg.model_dir)
        if cfg.sampling.fanouts is None:
            cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, fanouts=fanouts_for(saved)))
        cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(
            cfg.sampling, fanouts=fanouts_served(cfg.sampling.fanouts, model.num_layers)))
        self.cfg = cfg
        self.out_dim, self.embedding_dim, self.num_layers = model.out_dim, embedding_width(model), model.num_layers
        self._kind, self._class = model_kind(saved), saved["class"]
        del model
        self.ranks = ranks
        self.updates = PartitionedUpdates(cfg, self.graph, self.stats) if cfg.updates.enabled else None
        if self.updates is not None:
            ranks.prepare = self.updates.prepare  # every group formed replays the log before it serves
        # one call at a time on the ranks: every lane has one server
        self._admission = admission_for(dataclasses.replace(cfg, cpu_pipeline=dataclasses.replace(
            cfg.cpu_pipeline, workers=1, processes=False, cpus=())), 1, 1.0, None, None)
        if self.updates is not None:
            self.updates.on_group = self.lane("updates").observe
        # per-node request counts, kept only for the seed log (--seed-log): the nodes full
        # requests are rooted at, as a single process counts its sampled requests' seeds
        self._seed_counts = None
        if cfg.server.seed_log is not None:
            from hybridgnn.serving.core.placement_refresh import SeedCounts

            self._seed_counts = SeedCounts(self.graph.num_nodes)
        self._admitted_seed_psgs = 1.0
        self._refused_in_flight_cap = 0
        self._pending = 0
        self._idle = asyncio.Event()
        self._started = False
        self._queue: collections.deque[_Call] = collections.deque()
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task | None = None
        self.draining = False
        self._ready = False
        self.stats.watch(self.snapshot, ("partitioned",))

    # --- state ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Started, not draining, every partition rank up, and no call (but an update's)
        waiting for them past RANKS_STALLED_S: calls run one at a time, so one held by a
        stopped or stuck rank (until the ranks' timeout) holds every request behind it."""
        return self._ready and self.ranks.up and self.ranks.stalled_s() < RANKS_STALLED_S

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    @property
    def max_feature_dim(self) -> int:
        """The widest feature row a request may carry (transports bound elements by it)."""
        return self.graph.feature_dim

    @property
    def num_nodes(self) -> int:
        """Node ids requests may name now (grows with graph updates)."""
        view = self.updates.view if self.updates is not None else None
        return view.num_nodes if view is not None else self.graph.num_nodes

    @property
    def num_edges(self) -> int:
        """Edges of the graph the ranks serve (changes with graph updates)."""
        view = self.updates.view if self.updates is not None else None
        return view.num_edges if view is not None else self.graph.num_edges

    @property
    def graph_version(self) -> int:
        """The update log position the ranks have applied (0: none, or updates off)."""
        f = self.updates.follower if self.updates is not None else None
        return f.applied if f is not None else 0

    @property
    def takes_updates(self) -> bool:
        return self.updates is not None

    def snapshot(self) -> EngineSnapshot:
        f = self.updates.follower if self.updates is not None else None
        a = self.updates.applier if self.updates is not None else None
        return EngineSnapshot(pending=self._pending, pending_capacity=self.cfg.batcher.max_pending_requests,
                              ready=self.ready, queue_depths={"partitioned": len(self._queue)},
                              psgs_threshold=float("inf"), max_batch_psgs=float("inf"), policy="none",
                              graph_version=self.graph_version, update_log_head=f.head_seen if f else 0,
                              update_log_lag_s=f.lag_s() if f else 0.0,
                              update_follower_failing=bool(f is not None and f.failed),
                              update_staleness_s=a.staleness_s() if a else 0.0)

    def metadata(self) -> dict:
        info = self.ranks.info
        precomputed = bool(info.get("precomputed"))
        return {
            "num_nodes": self.num_nodes, "num_edges": self.num_edges, "feature_dim": self.graph.feature_dim,
            "num_classes": self.out_dim, "logits_dim": self.out_dim, "embedding_dim": self.embedding_dim,
            "fanouts": list(self.cfg.sampling.fanouts), "model_kind": self._kind, "model_class": self._class,
            "num_layers": self.num_layers, "dataset": self.graph.name,
            "dataset_fingerprint": self.graph.fingerprint, "pipelines": [], "policy": None,
            "admission": {**self._admission.describe(), "refused_in_flight_cap": self._refused_in_flight_cap},
            "max_request_nodes": self.cfg.server.max_request_nodes,
            "modes": ["full"] + (["precomputed"] if precomputed else []),
            "node_ids": self.graph.id_map.kind if self.graph.id_map is not None else "dense",
            "new_node_modes": list(NEW_NODE_MODES) if precomputed else ["sampled"],
            "srpe_gamma": self.cfg.new_nodes.gamma, "updates_enabled": self.takes_updates,
            "graph_version": self.graph_version,
            "partitions": {"ranks": self.ranks.world, "partition": info.get("partition"), "up": self.ranks.up,
                           "restarts": self.ranks.restarts, "memory_bytes_per_rank": info.get("memory_bytes"),
                           "why_down": None if self.ranks.up else self.ranks.why_down,
                           "stalled_s": round(self.ranks.stalled_s(), 3)},
        }

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._idle.set()
        await asyncio.to_thread(self.ranks.start)  # with updates: the log replayed into the ranks
        if self.updates is not None:
            await self.updates.start(self.ranks.call)
        self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="partitioned-dispatch")
        self._started = True
        self.ready = True

    async def stop_updates(self) -> None:
        """As Engine.stop_updates."""
        if self.updates is not None:
            await self.updates.stop_applying()

    async def stop(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        for call in self._queue:
            if not call.future.done():
                call.future.set_exception(Draining("server is shutting down"))
        self._queue.clear()
        try:
            if self.updates is not None:
                await self.updates.stop()
            await asyncio.to_thread(self.ranks.close)
        finally:
            self.stats.unwatch(self.snapshot)

    async def refresh_placement(self) -> dict:
        raise LookupError("a partitioned server keeps no GPU feature cache")

    def save_seed_log(self, path) -> None:
        """Write the per-node request counts (atomically) as a single process's server
        writes them: ids of full existing-node requests over the stored graph (lookups and
        new nodes are not counted), for `workload build --seeds` and `place --from-log`."""
        if self._seed_counts is not None:
            self._seed_counts.save_seed_log(path)

    # --- requests ------------------------------------------------------------------------
    def check_alive(self, node_ids: np.ndarray) -> None:
        """Raise RemovedNode when a request names a node that a graph update removed."""
        view = self.updates.view if self.updates is not None else None
        if view is not None:
            dead = view.removed(np.asarray(node_ids, dtype=np.int64))
            if len(dead):
                raise RemovedNode.among(dead, namer(self.graph.id_map))

    def submit(self, node_ids, on_done=None, waited_s: float = 0.0):
        raise BadRequest("existing-node mode sampled is not served on a partitioned graph (its draws would differ "
                         f"from one process's); this server offers modes {list(self.metadata()['modes'])}")

    def full(self, node_ids: np.ndarray, waited_s: float = 0.0):
        """Awaitable: existing nodes over their whole neighbourhoods (the model's exact output)."""
        return self._request("new_nodes", "existing", {}, (np.asarray(node_ids, dtype=np.int64),), "partitioned_full",
                             waited_s)

    def lookup_now(self, node_ids: np.ndarray, *, with_embeddings: bool = True, waited_s: float = 0.0):
        return None  # the rows are on their owners: always a call

    def lookup(self, node_ids: np.ndarray, *, with_embeddings: bool = True, waited_s: float = 0.0):
        return self._request("lookup", "lookup", {"with_embeddings": bool(with_embeddings)},
                             (np.asarray(node_ids, dtype=np.int64),), "precomputed", waited_s)

    def new_nodes(self, features: np.ndarray, edge_index: np.ndarray, *, mode: str, gamma: float, policy: str,
                  num_nodes: int | None = None, waited_s: float = 0.0):
        if mode not in NEW_NODE_MODES:
            raise BadRequest(f"new-node mode {mode} is not served; this server offers {list(NEW_NODE_MODES)}")
        # query nodes are numbered from the node count the request was decoded against: the
        # ranks renumber them if updates added nodes since
        head = {"mode": mode, "gamma": float(gamma), "policy": policy, "seed": 0,
                "fanouts": list(self.cfg.sampling.fanouts),
                "num_nodes": int(num_nodes if num_nodes is not None else self.num_nodes)}
        return self._request("new_nodes", "new_nodes", head, (np.ascontiguousarray(features, dtype=np.float32),
                                                              np.ascontiguousarray(edge_index, dtype=np.int64)),
                             f"newnodes_{mode}", waited_s)

    async def update_graph(self, update, waited_s: float = 0.0) -> dict:
        """Queue a decoded graph update; resolves once the ranks applied it (graph and
        embeddings), with its graph_version and the ids of new nodes."""
        if self.updates is None:
            raise Forbidden("graph updates are disabled; start the server with --update-token")
        applier = self.updates.applier
        if applier is None:
            raise Draining("server is starting")
        if self.draining:
            raise Draining("server is shutting down")
        return await self.run_in_lane("updates", float(max(1, update.num_updates)), applier.submit, update,
                                      waited_s=waited_s, learn=False)

    async def wait_for_version(self, wanted: int) -> bool:
        """Whether the ranks apply update log position `wanted` within --max-catch-up-ms."""
        f = self.updates.follower if self.updates is not None else None
        if f is None:
            return False
        return await f.wait_for(wanted, self.cfg.updates.max_catch_up_s)

    async def _request(self, lane_name: str, name: str, head: dict, arrays: tuple, path: str,
                       waited_s: float) -> RequestResult:
        stalled = self.ranks.stalled_s()
        if stalled >= RANKS_STALLED_S:
            # it would queue behind a call held until the ranks' timeout (60 s): a 503 now
            # lets the client or balancer try a replica whose ranks answer
            raise ServiceUnavailable(f"the partition ranks have not answered a call for {stalled:.0f} s (a rank "
                                     "stopped or stuck); try another replica")
        self.admit(lane_name, 1.0, waited_s)
        lane = self.lane(lane_name)
        call = _Call(name, head, arrays, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        self._wake.set()
        try:
            out, rows, seconds = await call.future
            lane.observe(1.0, seconds)
        finally:
            lane.remove(1.0)
            lane.completed(1.0, time.perf_counter())
            self.release()
        logits, hidden = rows
        return RequestResult(logits, hidden, logits.argmax(axis=1).astype(np.int64) if logits.shape[1] else
                             np.zeros(len(logits), np.int64), path, StageTimings(compute_s=float(out["compute_s"])))

    # --- the ranks, one call at a time ---------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                group = self._take()
                try:
                    await self._run(group)
                except asyncio.CancelledError:  # stopped with this group out of the queue: it hears now
                    _fail(group, Draining("server is shutting down"))
                    raise
                except Exception as exc:  # a bug here must not end the loop that answers every call
                    log.exception("partitioned dispatch failed a group of %d calls", len(group))
                    _fail(group, BatchFailed(f"{type(exc).__name__}: {exc}"))

    def _take(self) -> list[_Call]:
        """The next call, with the existing-node calls of the same kind waiting behind it
        (up to --max-batch-seeds ids): one batch for the ranks."""
        first = self._queue.popleft()
        group = [first]
        if first.name in ("existing", "lookup"):
            ids = len(first.arrays[0])
            while (self._queue and self._queue[0].name == first.name and self._queue[0].head == first.head
                   and ids + len(self._queue[0].arrays[0]) <= self.cfg.batcher.max_batch_seeds):
                ids += len(self._queue[0].arrays[0])
                group.append(self._queue.popleft())
        return group

    async def _run(self, group: list[_Call]) -> None:
        first = group[0]
        arrays = first.arrays if len(group) == 1 else (np.concatenate([c.arrays[0] for c in group]),)
        if self._seed_counts is not None and first.name == "existing":  # once per call sent to the ranks
            self._seed_counts.count(arrays[0])
        t0 = time.perf_counter()
        try:
            out, rows = await asyncio.to_thread(self.ranks.call, first.name, first.head, arrays)
        except Exception as exc:  # the group is down (503) or the request is bad for every rank
            _fail(group, exc)
            return
        sent = len(arrays[0]) if first.name in ("existing", "lookup") else None
        if not (len(rows) == 2 and len(rows[0]) == len(rows[1]) and (sent is None or len(rows[0]) == sent)):
            # a rank of another build (--ranks) can answer in another shape: refuse, never mis-slice
            shapes = [getattr(r, "shape", None) for r in rows]
            failure = BatchFailed(f"partition rank 0 answered {first.name!r} with rows {shapes}, "
                                  f"not two arrays of {sent if sent is not None else 'equal'} rows")
            log.error("%s", failure)
            _fail(group, failure)
            return
        seconds = (time.perf_counter() - t0) / len(group)
        # ids an update removed after their requests were checked at decode: the ranks name them
        removed = np.asarray(out.get("removed", ()) if sent is not None else (), dtype=np.int64)
        at = 0
        for c in group:
            k = len(c.arrays[0]) if len(group) > 1 else len(rows[0])
            dead = c.arrays[0][np.isin(c.arrays[0], removed)] if len(removed) else removed
            if not c.future.done():
                if len(dead):
                    c.future.set_exception(RemovedNode.among(dead, namer(self.graph.id_map)))
                else:
                    c.future.set_result((out, (rows[0][at:at + k], rows[1][at:at + k]), seconds))
            at += k


def _fail(group: list[_Call], exc: BaseException) -> None:
    """Answer every call of group not yet answered with exc."""
    for c in group:
        if not c.future.done():
            c.future.set_exception(exc)
