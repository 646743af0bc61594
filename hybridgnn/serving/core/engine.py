"""The serving engine: admission, batching, routing, pipelines, completion and lifecycle.

It executes what scheduler/ decides (admission, routes, the policy in force). Requests
served beside the pipelines (lookups, new nodes, graph updates) are in graph_requests.py,
the placement refresh in placement_refresh.py, self-description in metadata.py. Other
modules use its public methods and its snapshot(), never its internals.

Runs in the event loop thread except Pipeline workers; results cross back with
loop.call_soon_threadsafe. Invariant: every admitted request's on_done is called
exactly once (result or error), including during drain.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

import numpy as np
import torch

from hybridgnn.config import ServeConfig
from hybridgnn.models.gnn import embedding_width
from hybridgnn.pipelines.pool import Pipeline
from hybridgnn.pipelines.process_pipeline import ProcessPipeline
from hybridgnn.runtime.resources import Resources
from hybridgnn.scheduler.admission import admission_for
from hybridgnn.scheduler.control import PolicyControl
from hybridgnn.scheduler.policy import Policy
from hybridgnn.scheduler.router import Router
from hybridgnn.serving.core.admitting import Admitting, started
from hybridgnn.serving.core.batcher import MicroBatcher
from hybridgnn.serving.core.graph_requests import GraphRequests
from hybridgnn.serving.core.metadata import describe_engine
from hybridgnn.serving.core.placement_refresh import PlacementRefresh
from hybridgnn.serving.core.sampled import SampledInference
from hybridgnn.serving.core.statistics import ModelStatistics
from hybridgnn.serving.core.updates import UpdateApplier
from hybridgnn.types import (
    EngineSnapshot,
    RequestResult,
    ServingStats,
)
from hybridgnn.updates.follower import Follower

log = logging.getLogger(__name__)

OnDone = Callable[[RequestResult | None, BaseException | None], None]


async def open_engine(cfg: ServeConfig, stats: ServingStats | None = None, *, version: str = "1",
                      share_with: Engine | None = None) -> Engine:
    """A started engine for one model version (built off the event loop: loading takes
    seconds). share_with: a serving engine over the same graph whose dataset, tables and
    feature stores are shared (a model repository). An engine that fails to start is
    stopped before the error propagates, so its workers never outlive it."""
    engine = await asyncio.to_thread(Engine, cfg, stats, version=version,
                                     base=share_with._resources if share_with is not None else None)
    return await started(engine)


class Engine(Admitting, SampledInference):
    default_mode = "sampled"  # of existing-node requests that name none
    serves_full = False  # existing nodes over whole neighbourhoods (partitioned engines do)

    def __init__(self, cfg: ServeConfig, stats: ServingStats | None = None, *, version: str = "1",
                 base: Resources | None = None):
        """base: another engine's resources over the same graph, shared (a model repository)."""
        self.stats = stats if stats is not None else ServingStats()  # telemetry/ implements it
        self.model_version = version  # the version requests name it by
        self.model_stats = ModelStatistics()  # this version's counts, as Triton's statistics extension has them
        r = self._resources = Resources.open(cfg, base)
        cfg = self.cfg = r.cfg  # as served: the model's fanouts filled in
        self.graph = r.graph  # the dataset as loaded (read-only); num_nodes follows graph updates
        self.out_dim, self.embedding_dim = r.model.out_dim, embedding_width(r.model)
        self._tables = r.tables
        self._dynamic = r.dynamic  # the graph as updated (None: updates off)
        self._updates: UpdateApplier | None = None
        self._follower: Follower | None = None  # applies the update log here (updates on)
        self._placement = PlacementRefresh(r, self.stats)  # seed counts; SIGHUP rebuilds the GPU cache
        cpu_pipeline = ProcessPipeline if cfg.cpu_pipeline.processes else Pipeline  # worker processes: loop-driven
        self._pipelines: dict[str, Pipeline | ProcessPipeline] = {
            cfg.cpu_pipeline.name: cpu_pipeline(cfg.cpu_pipeline, lambda w: r.make_executor("cpu", w),
                                                self._on_batch_done)}
        if cfg.gpu_pipeline is not None:
            self._pipelines[cfg.gpu_pipeline.name] = Pipeline(cfg.gpu_pipeline, lambda w: r.make_executor("gpu", w),
                                                              self._on_batch_done)
        self._router = Router(cfg.router, tuple(self._pipelines))
        if len(self._pipelines) > 1 and cfg.router.psgs_threshold is None:
            seeds = cfg.router.default_gpu_batch_seeds
            self._router.set_threshold(float(seeds * np.mean(self._tables.psgs)))
            if cfg.policy.profile is None:  # else the profile's policy sets it just below, and says so
                log.info("no PSGS threshold given: batches above %.0f (%d average seeds) go to the GPU pipeline",
                         self._router.threshold, seeds)
        self._batcher = MicroBatcher(cfg.batcher, self._dispatch, self._has_capacity,
                                     None if cfg.batcher.wait_when_idle else self._is_quiet)
        self._control = PolicyControl(cfg, tuple(self._pipelines))
        if cfg.policy.profile is not None:
            self._set_policy(self._control.load(self.graph.fingerprint))
        self._seed_psgs = self._mean_request_psgs = float(np.mean(self._tables.psgs))
        self._admitted_seed_psgs = self._seed_psgs  # PSGS per seed of admitted requests (moving mean)
        self._admission = admission_for(cfg, sum(p.cfg.workers for p in self._pipelines.values()),
                                        self._full_batch_psgs(), self._control.policy, self._control.profile)
        self._sampled_lane = self._admission.lanes["sampled"]
        self._refused_in_flight_cap = 0
        self._side = GraphRequests(self, r)  # lookups, new nodes, graph updates
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._adapt_task: asyncio.Task | None = None
        self._pending = 0
        self._idle = asyncio.Event()
        self.draining = False  # refusing new requests (503) until admitted ones finish
        self._ready = False
        self.stats.watch(self.snapshot, tuple(self._pipelines))

    # --- what others read --------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """What /v2/health/ready reports: set once started, cleared before draining starts;
        False too while the update log is trimmed past this replica (it never catches up
        again, so a balancer sends its reads to replicas that do)."""
        return self._ready and (self._follower is None or self._follower.stranded is None)

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    def snapshot(self) -> EngineSnapshot:
        """This engine's state now (telemetry reads it at scrape time)."""
        f, d = self._follower, self._dynamic
        return EngineSnapshot(
            pending=self._pending, pending_capacity=self.cfg.batcher.max_pending_requests, ready=self.ready,
            queue_depths={n: p.depth for n, p in self._pipelines.items()}, psgs_threshold=self._router.threshold,
            max_batch_psgs=self._batcher.cfg.max_batch_psgs,
            policy=self._control.policy.name if self._control.policy else "none", graph_version=self.graph_version,
            update_log_head=f.head_seen if f is not None else 0, update_log_lag_s=f.lag_s() if f is not None else 0.0,
            update_follower_failing=bool(f is not None and f.failed),
            update_staleness_s=self._updates.staleness_s() if self._updates is not None else 0.0,
            graph_patched_entries=d.patched_entries if d is not None else 0)

    def metadata(self) -> dict:
        """What GET /v2/models/{m} reports under parameters (core/metadata.py)."""
        return describe_engine(self)

    @property
    def graph_version(self) -> int:
        """The update log position applied here (0: none yet, or updates off)."""
        return self._follower.applied if self._follower is not None else 0

    @property
    def takes_updates(self) -> bool:
        """Whether this engine applies graph updates (a token is set)."""
        return self._dynamic is not None

    @property
    def max_feature_dim(self) -> int:
        """The widest feature row a request may carry (transports bound elements by it)."""
        return self.graph.feature_dim

    @property
    def num_nodes(self) -> int:
        """Node ids requests may name now (grows with graph updates)."""
        d = self._dynamic
        return d.num_nodes if d is not None else self.graph.num_nodes

    # --- policy (decided by PolicyControl, applied here) ------------------------------
    def adapt_once(self) -> bool:
        """One --adapt step now; True if the policy moved."""
        step = self._control.adapt_once()
        if step is not None:
            self._apply_adapted(step)
        return step is not None

    def _apply_adapted(self, step: Policy) -> None:
        self._set_policy(step)
        self.stats.policy_in_force(step.name, changed=True)

    def _set_policy(self, policy: Policy) -> None:
        """The router takes the policy's threshold and spill limits, the batcher its bound."""
        self._control.policy = policy
        self._router.apply_policy(policy)
        self._batcher.limit_psgs(policy.max_batch_psgs if policy.max_batch_psgs > 0 else math.inf)

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        torch.set_num_threads(self.cfg.cpu_pipeline.torch_threads)
        self._idle.set()
        # Off the loop (worker processes take seconds to start, warm-up compiles and runs
        # the model): a version loading into a running server gets ready while others serve.
        for p in self._pipelines.values():
            await asyncio.to_thread(p.start)
            p.attach(self._loop)
        await asyncio.to_thread(self._resources.warm_up)  # the first request of each kind is not slow
        self._started = True
        self._adapt_task = (asyncio.create_task(self._control.adapt_loop(self._apply_adapted), name="adapt")
                            if self.cfg.policy.adapt and self._control.profile is not None else None)
        self.start_lag_ticks()
        if self._dynamic is not None:
            r = self._resources
            snap = r.snapshot
            self._follower = Follower(r.update_log, r.dynamic, r.incremental, self.stats, self.cfg.updates,
                                      position=snap.position if snap is not None else 0,
                                      keys=snap.keys if snap is not None else None, snapshots=r.snapshots)
            await asyncio.to_thread(self._follower.catch_up)  # the log so far, before anything is served
            self._follower.start()
            self._updates = UpdateApplier(self.cfg.updates, self._follower, r.dynamic, self.stats,
                                          on_group=self.lane("updates").observe)
            self._updates.start()
        self.ready = True

    async def stop_updates(self) -> None:
        """Take no more graph updates; those in hand are answered now (applied, or 503
        saying whether they may have been logged), while the transports can still carry
        the answers. stop() does this too."""
        if self._updates is not None:
            await self._updates.stop()

    async def stop(self) -> None:
        """Stop every worker and release the resources (telemetry stops watching)."""
        self.stop_lag_ticks()
        if self._updates is not None:
            await self._updates.stop()
        if self._follower is not None:
            await self._follower.stop()
        if self._adapt_task is not None:
            self._adapt_task.cancel()
            await asyncio.gather(self._adapt_task, return_exceptions=True)
        self._batcher.close()
        try:
            for p in self._pipelines.values():
                await asyncio.to_thread(p.stop)
            self._resources.close()
        finally:
            self.stats.unwatch(self.snapshot)

    async def refresh_placement(self) -> dict:
        """Rebuild the GPU feature cache from the seeds requested so far (SIGHUP)."""
        return await self._placement.refresh()

    def save_seed_log(self, path) -> None:
        """Write the per-node request counts (for `hybridgnn place --from-log`)."""
        self._placement.save_seed_log(path)

    # --- beside the pipelines (graph_requests.py) ------------------------------------
    def check_alive(self, node_ids: np.ndarray) -> None:
        """Raise RemovedNode when a request names a node that a graph update removed."""
        if self._dynamic is not None:
            self._dynamic.check_alive(node_ids)

    def local_lookup_spec(self) -> dict | None:
        """Front-end processes may answer this engine's precomputed lookups from its stored
        rows (GraphRequests.local_lookup_spec says when, and with what)."""
        return self._side.local_lookup_spec()

    def lookup_now(self, node_ids: np.ndarray, *, with_embeddings: bool = True, waited_s: float = 0.0):
        """A precomputed lookup answered now (a RequestResult), or None when it must wait
        (then lookup())."""
        return self._side.lookup_now(node_ids, with_embeddings=with_embeddings, waited_s=waited_s)

    def lookup(self, node_ids: np.ndarray, *, with_embeddings: bool = True, waited_s: float = 0.0):
        """Awaitable: answer from the precomputed embeddings (GraphRequests.lookup)."""
        return self._side.lookup(node_ids, with_embeddings=with_embeddings, waited_s=waited_s)

    def new_nodes(self, features: np.ndarray, edge_index: np.ndarray, **kw):
        """Awaitable: embeddings of query nodes (GraphRequests.new_nodes_infer)."""
        return self._side.new_nodes_infer(features, edge_index, **kw)

    def update_graph(self, update, waited_s: float = 0.0):
        """Awaitable: a decoded graph update applied; its answer (GraphRequests.update_graph)."""
        return self._side.update_graph(update, self._updates, waited_s)

    async def wait_for_version(self, wanted: int) -> bool:
        """Whether this replica applied graph version `wanted` within --max-catch-up-ms
        (False at once when it takes no updates)."""
        if self._follower is None:
            return False
        return await self._follower.wait_for(wanted, self.cfg.updates.max_catch_up_s)
