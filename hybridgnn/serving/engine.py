"""The serving engine: admission, batching, routing, pipelines, completion and lifecycle.

It executes what scheduler/ decides (admission, routes, the policy in force). Requests
served beside the pipelines (lookups, new nodes, graph updates) are in graph_requests.py,
the placement refresh in placement_refresh.py, self-description in metadata.py.

Runs in the event loop thread except Pipeline workers; results cross back with
loop.call_soon_threadsafe. Invariant: every admitted request's future is resolved
exactly once (result or error), including during drain.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from hybridgnn.config import ServeConfig
from hybridgnn.errors import BatchFailed, Draining, Overloaded, RemovedNode
from hybridgnn.models.gnn import embedding_width
from hybridgnn.pipelines.pool import Pipeline
from hybridgnn.runtime.resources import Resources
from hybridgnn.scheduler.admission import admission_for, full_batch_work
from hybridgnn.scheduler.control import PolicyControl
from hybridgnn.scheduler.policy import Policy, Profile
from hybridgnn.scheduler.router import Router
from hybridgnn.serving.batcher import MicroBatcher
from hybridgnn.serving.eager import EagerFuture, together
from hybridgnn.serving.graph_requests import GraphRequests
from hybridgnn.serving.metadata import describe_engine
from hybridgnn.serving.placement_refresh import PlacementRefresh
from hybridgnn.serving.statistics import ModelStatistics
from hybridgnn.serving.updates import UpdateApplier
from hybridgnn.types import (
    Batch,
    BatchResult,
    InferenceRequest,
    RequestResult,
    RoutePlan,
    ServingStats,
)
from hybridgnn.updates.follower import Follower

log = logging.getLogger(__name__)

# Without a profile, a hybrid server sends a batch to the GPU once its PSGS exceeds that
# of this many average seeds (a stand-in until `hybridgnn profile` measures the crossover).
DEFAULT_GPU_BATCH_SEEDS = 64
# How often the loop-lag timer runs: often enough to see a lag well under the 100 ms
# default bound, cheap enough (a few µs per tick) to cost nothing.
LAG_TICK_S = 0.005


class Engine:
    def __init__(self, cfg: ServeConfig, stats: ServingStats | None = None, *, base: Resources | None = None):
        """base: another engine's resources over the same graph, shared (a model repository)."""
        self.cfg = cfg
        self.stats = stats if stats is not None else ServingStats()  # telemetry/ implements it
        self.resources = Resources.open(cfg, base)
        r = self.resources
        # what the request path reads, as attributes of the engine (one object, shared)
        self.graph, self.model, self.model_config, self.tables = r.graph, r.model, r.model_config, r.tables
        self.embedding_dim = embedding_width(self.model)
        self.embeddings, self.new_nodes, self.dynamic, self.incremental = (r.embeddings, r.new_nodes, r.dynamic,
                                                                           r.incremental)
        self.plan, self.features, self.device_graph, self.gpu_features = (r.plan, r.features, r.device_graph,
                                                                          r.gpu_features)
        self.updates: UpdateApplier | None = None
        self.follower: Follower | None = None  # applies the update log here (updates on)
        self.model_stats = ModelStatistics()  # this version's counts, as Triton's statistics extension has them
        self.model_version = "1"  # the version requests name it by (a model repository sets it)
        self.update_log = r.update_log
        self.placement = PlacementRefresh(r, self.stats)  # seed counts; SIGHUP rebuilds the GPU cache
        self.side = GraphRequests(self)  # lookups, new nodes, graph updates
        self.pipelines: dict[str, Pipeline] = {
            cfg.cpu_pipeline.name: Pipeline(cfg.cpu_pipeline, lambda w: self.make_executor("cpu", w),
                                            self._on_batch_done)
        }
        if cfg.gpu_pipeline is not None:
            self.pipelines[cfg.gpu_pipeline.name] = Pipeline(cfg.gpu_pipeline, lambda w: self.make_executor("gpu", w),
                                                             self._on_batch_done)
        self.router = Router(cfg.router, tuple(self.pipelines))
        if len(self.pipelines) > 1 and cfg.router.psgs_threshold is None:
            self.router.set_threshold(float(DEFAULT_GPU_BATCH_SEEDS * np.mean(self.tables.psgs)))
            log.info("no PSGS threshold given: batches above %.0f (%d average seeds) go to the GPU pipeline",
                     self.router.threshold, DEFAULT_GPU_BATCH_SEEDS)
        self.batcher = MicroBatcher(cfg.batcher, self._dispatch, self._has_capacity)
        self.started = False
        self.control = PolicyControl(cfg, tuple(self.pipelines))
        if cfg.policy.profile is not None:
            self.set_policy(self.control.load(self.graph.fingerprint))
        self._seed_psgs = self._mean_request_psgs = float(np.mean(self.tables.psgs))
        self._admitted_seed_psgs = self._seed_psgs  # PSGS per seed of admitted requests (moving mean)
        self.admission = admission_for(cfg, sum(p.cfg.workers for p in self.pipelines.values()),
                                       self._full_batch_psgs(), self.policy, self.profile)
        self._sampled_lane = self.admission.lanes["sampled"]
        self.refused_in_flight_cap = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._adapt_task: asyncio.Task | None = None
        self._lag_handle: asyncio.TimerHandle | None = None
        self._pending = 0
        self._idle = asyncio.Event()
        self.draining = False  # refusing new requests (503) until admitted ones finish
        self.ready = False  # what /v2/health/ready reports; turns False before draining starts
        self.stats.watch(self)

    # --- lifecycle -------------------------------------------------------------------
    def make_executor(self, pipeline: str, worker: int):
        """A fresh executor of the named pipeline, as its workers get."""
        return self.resources.make_executor(pipeline, worker)

    def _full_batch_psgs(self) -> float:
        b = self.batcher.cfg
        return full_batch_work(b.max_batch_psgs, b.max_batch_seeds, b.max_batch_requests, self._seed_psgs,
                               self._mean_request_psgs)

    # --- policy (decided by self.control, applied here) ------------------------------
    @property
    def policy(self) -> Policy | None:
        return self.control.policy

    @property
    def profile(self) -> Profile | None:
        return self.control.profile

    @property
    def graph_version(self) -> int:
        """The update log position applied here (0: none yet, or updates off)."""
        return self.follower.applied if self.follower is not None else 0

    def adapt_once(self) -> bool:
        """One --adapt step now; True if the policy moved."""
        step = self.control.adapt_once()
        if step is not None:
            self._apply_adapted(step)
        return step is not None

    def _apply_adapted(self, step: Policy) -> None:
        self.set_policy(step)
        self.stats.policy_in_force(step.name, changed=True)

    def set_policy(self, policy: Policy) -> None:
        """Put a policy in force (at start, and from --adapt): the router takes its threshold
        and spill limits, the batcher its batch-PSGS bound."""
        self.control.policy = policy
        self.router.apply_policy(policy)
        self.batcher.limit_psgs(policy.max_batch_psgs if policy.max_batch_psgs > 0 else math.inf)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        torch.set_num_threads(self.cfg.cpu_pipeline.torch_threads)
        self._idle.set()
        # Off the loop (worker processes take seconds to start, warm-up compiles and runs
        # the model): a version loading into a running server (a model repository) gets
        # ready while the others serve.
        for p in self.pipelines.values():
            await asyncio.to_thread(p.start)
        await asyncio.to_thread(self.resources.warm_up)  # the first request of each kind is not slow
        self.started = True
        self._adapt_task = (asyncio.create_task(self.control.adapt_loop(self._apply_adapted), name="adapt")
                            if self.cfg.policy.adapt and self.profile is not None else None)
        self._lag_tick(self._loop.time())
        if self.dynamic is not None:
            r = self.resources
            snap = r.snapshot
            self.follower = Follower(self.update_log, self.dynamic, self.incremental, self.stats, self.cfg.updates,
                                     position=snap.position if snap is not None else 0,
                                     keys=snap.keys if snap is not None else None, snapshots=r.snapshots)
            await asyncio.to_thread(self.follower.catch_up)  # the log so far, before anything is served
            self.follower.start()
            self.updates = UpdateApplier(self.cfg.updates, self.follower, self.dynamic, self.stats)
            self.updates.start()
        self.ready = True

    def _lag_tick(self, due: float) -> None:
        """Feed admission how late this timer ran (the event loop's lag), every LAG_TICK_S."""
        now = self._loop.time()
        self.admission.loop_lag.observe(now - due)
        self._lag_handle = self._loop.call_at(now + LAG_TICK_S, self._lag_tick, now + LAG_TICK_S)

    def mark_unready(self) -> None:
        """Report not-ready (balancers stop routing here) while still serving what arrives."""
        self.ready = False

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait until every admitted request has its answer."""
        self.draining = True
        self.ready = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            log.error("drain timed out with %d requests pending", self._pending)
            return False

    async def stop(self) -> None:
        if self._lag_handle is not None:
            self._lag_handle.cancel()
        if self.updates is not None:
            await self.updates.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self._adapt_task is not None:
            self._adapt_task.cancel()
            await asyncio.gather(self._adapt_task, return_exceptions=True)
        self.batcher.close()
        for p in self.pipelines.values():
            await asyncio.to_thread(p.stop)
        self.resources.close()

    # --- request path ----------------------------------------------------------------
    @property
    def pending(self) -> int:
        return self._pending

    def _admit(self, lane: str, work: float, waited_s: float = 0.0) -> float:
        """Count one more request in flight on `lane`, or raise Draining / Overloaded (its
        predicted queueing delay, plus waited_s already spent in the front end, past the
        bound; or the hard cap on requests in flight). Returns the lane's prediction of its wait."""
        if self.draining or not self.started:
            raise Draining("server is shutting down" if self.draining else "server is starting",
                           retry_after_s=self.cfg.server.retry_after_s)
        if self._pending >= self.cfg.batcher.max_pending_requests:
            self.refused_in_flight_cap += 1
            raise Overloaded(f"{self._pending} requests in flight (limit {self.cfg.batcher.max_pending_requests})",
                             retry_after_s=self.cfg.server.retry_after_s)
        predicted = self.admission.admit(lane, work, waited_s)
        self._pending += 1
        self._idle.clear()
        return predicted

    def _release(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()

    def shed(self, waited_s: float, lane: str | None = None, seeds: int = 0) -> None:
        """Raise Overloaded, before a request is decoded, if it already waited in the front
        end past the delay bound, or (lane given) that lane would be past the bound with the
        work its `seeds` are expected to bring (the mean PSGS per seed of admitted requests;
        submit then judges the request's own PSGS)."""
        if self.started and not self.draining:
            self.admission.check(lane, seeds * self._admitted_seed_psgs if lane == "sampled" else 0.0, waited_s)

    def shed_standing(self) -> bool:
        """Whether a request the front end found waiting past the target of a queue that
        stands there is refused (and counted so): yes unless the engine is starting or
        draining, whose own answer (503) applies then."""
        if self.started and not self.draining:
            self.admission.count_standing()
            return True
        return False

    def submit(self, node_ids: np.ndarray, waited_s: float = 0.0,
               on_done: Callable[[RequestResult | None, BaseException | None], None] | None = None
               ) -> asyncio.Future | None:
        """Admit one request (ids already validated) or raise Overloaded / Draining.
        waited_s: how long it already waited in the front end. Its answer goes to
        on_done(result, error), called once on the loop; without on_done, to the future
        returned (an EagerFuture: what is chained to it runs in the call that completes it)."""
        psgs = self.tables.batch_psgs(node_ids)
        predicted = self._admit("sampled", psgs, waited_s)
        self._mean_request_psgs += 0.01 * (psgs - self._mean_request_psgs)
        if node_ids.shape[0]:
            self._admitted_seed_psgs += 0.01 * (psgs / node_ids.shape[0] - self._admitted_seed_psgs)
        requests = self.control.count_admitted(int(node_ids.shape[0]))
        if not requests & 255:  # the batch size under backlog follows the request mix
            self._sampled_lane.full_batch = self._full_batch_psgs()
        fut = None
        if on_done is None:
            fut = EagerFuture(loop=self._loop)
            on_done = functools.partial(_settle, fut)
        self.batcher.add(InferenceRequest(node_ids=node_ids, on_done=on_done, arrival_s=time.perf_counter(),
                                          psgs=psgs, predicted_wait_s=predicted, waited_s=waited_s))
        return fut

    def _has_capacity(self) -> bool:
        return any(p.depth <= p.cfg.workers for p in self.pipelines.values())

    def _dispatch(self, batch: Batch) -> None:
        try:
            self.placement.count(batch.seeds)
            # Requests carry their PSGS (always >= 1 per seed) when the batcher bounds it: no
            # second lookup, unless a request was admitted before a bound was set.
            batch.psgs = (sum(r.psgs for r in batch.requests) if all(r.psgs > 0 for r in batch.requests)
                          else self.tables.batch_psgs(batch.seeds))
            plan = self.router.route(batch.psgs, {n: p.load() for n, p in self.pipelines.items()})
            self._submit_to(batch, plan)
        except Exception as exc:
            log.exception("could not dispatch a batch of %d requests", len(batch.requests))
            failure = BatchFailed(f"{type(exc).__name__}: {exc}")
            for req in batch.requests:
                self._resolve(req, exception=failure)

    def _submit_to(self, batch: Batch, plan: RoutePlan) -> None:
        self.stats.routed(plan.pipeline, plan.reason)
        self.pipelines[plan.pipeline].submit(batch, plan)

    def _on_batch_done(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None):
        # Called on a worker thread; the loop owns the futures. The time is taken here: a
        # busy loop runs completions late and in bursts, and admission's throughput and
        # waits must see when batches finished, not when the loop got to them.
        self._loop.call_soon_threadsafe(self._complete, batch, plan, result, error, time.perf_counter())

    def _complete(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None,
                  done_s: float | None = None):
        stats = self.stats
        self.batcher.capacity_freed()
        if error is not None:
            stats.batch_failed(plan.pipeline)
            try:
                retry = self.router.fallback(plan)
            except LookupError:
                retry = None
            if retry is not None:
                self._submit_to(batch, retry)
                return
            failure = BatchFailed(f"{type(error).__name__}: {error}")
            for req in batch.requests:
                self._resolve(req, exception=failure)
            return
        stats.batch_done(plan.pipeline, result.timings, batch.num_seeds, len(batch.requests), batch.psgs,
                        result.sampled_edges, result.gathered_rows)
        self.model_stats.executed()
        rt = result.timings
        service_s = rt.sample_s + rt.gather_s + rt.compute_s
        self.control.recent[plan.pipeline].append((batch.psgs, service_s))
        lane = self._sampled_lane
        lane.observe(batch.psgs, service_s)
        # What each request waited before its batch's service began, against what
        # admission predicted: the calibration that makes the bound hold for the tail.
        now = time.perf_counter()
        done_s = now if done_s is None else done_s
        # The wait is charged up to now, not done_s: a client waits for the loop too.
        service_began = now - service_s
        admission = self.admission
        bound = admission.bound_s
        slo = admission.slo is not None
        offs = batch.offsets.tolist()  # Python ints slice faster than numpy scalars
        logits, embeddings, predictions = result.logits, result.embeddings, result.predictions
        pipeline, timings, closed_s = plan.pipeline, result.timings, batch.closed_s
        with together():  # the batch's answers are made first, then leave back to back
            for i, req in enumerate(batch.requests):
                lane.calibrate(req.predicted_wait_s, service_began - req.arrival_s, bound)
                if slo:
                    admission.observe_latency(req.waited_s + now - req.arrival_s)
                stats.stage("batching", pipeline, closed_s - req.arrival_s)
                lo, hi = offs[i], offs[i + 1]
                self._resolve(req, RequestResult(logits[lo:hi], embeddings[lo:hi], predictions[lo:hi], pipeline,
                                                 timings))
        lane.completed(batch.psgs, done_s)

    def _resolve(self, req: InferenceRequest, result: RequestResult | None = None, exception=None) -> None:
        # The books first: on_done may answer at once, and what that answer lets in (a
        # pipelined request) must see this request gone.
        self._sampled_lane.remove(req.psgs)
        self._release()
        try:
            req.on_done(result, exception)
        except Exception as exc:  # as the loop treats a failing callback: report it, answer the rest
            self._loop.call_exception_handler({"message": "exception answering a request", "exception": exc})

    @property
    def num_nodes(self) -> int:
        """Node ids requests may name now (grows with graph updates)."""
        return self.dynamic.num_nodes if self.dynamic is not None else self.graph.num_nodes

    def check_alive(self, node_ids: np.ndarray) -> None:
        """Raise RemovedNode when a request names a node that a graph update removed."""
        if self.dynamic is not None:
            dead = node_ids[~self.dynamic.alive[node_ids]]
            if len(dead):
                raise RemovedNode(f"node {int(dead[0])} was removed from the graph")

    async def run_in_lane(self, lane_name: str, work: float, call, *args, waited_s: float = 0.0, **kwargs):
        """Admit `work` on a lane (after waited_s already spent in the front end), await
        call(*args, **kwargs), and release it. The lane's cost model learns from calls that
        found it empty (their time is service, not wait)."""
        self._admit(lane_name, work, waited_s)
        lane = self.admission.lanes[lane_name]
        alone = lane.queued <= work
        t0 = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            lane.remove(work)
            now = time.perf_counter()
            if alone:
                lane.observe(work, now - t0)
            lane.completed(work, now)
            self._release()

    async def run_in_thread_lane(self, lane_name: str, work: float, fn, *args, waited_s: float = 0.0, **kwargs):
        """Admit `work` on a lane (after waited_s already spent in the front end) and run fn
        off the event loop; the lane learns the time fn took in its thread (service), not
        the wait for the thread or the loop around it."""
        self._admit(lane_name, work, waited_s)
        lane = self.admission.lanes[lane_name]

        def timed():
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            return out, time.perf_counter() - t0

        try:
            out, seconds = await asyncio.to_thread(timed)
            lane.observe(work, seconds)
            return out
        finally:
            lane.remove(work)
            lane.completed(work, time.perf_counter())
            self._release()

    def metadata(self) -> dict:
        return describe_engine(self)


def _settle(fut: asyncio.Future, result: RequestResult | None, error: BaseException | None) -> None:
    """Complete fut with a request's answer (unless it was cancelled)."""
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
