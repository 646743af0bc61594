"""The serving engine: admission, batching, routing, pipelines and completion.

Runs in the event loop thread except Pipeline workers; results cross back with
loop.call_soon_threadsafe. Invariant: every admitted request's future is resolved
exactly once (result or error), including during drain.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from hybridgnn.config import ServeConfig
from hybridgnn.embeddings.newnodes import DynamicGraphView, NewNodeEvaluator
from hybridgnn.embeddings.store import hidden_rows
from hybridgnn.errors import (
    BatchFailed,
    Conflict,
    Draining,
    Forbidden,
    Overloaded,
    RemovedNode,
)
from hybridgnn.models.checkpoint import model_kind
from hybridgnn.models.gnn import embedding_width
from hybridgnn.pipelines.pool import Pipeline
from hybridgnn.runtime.resources import Resources
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.scheduler.admission import (
    Admission,
    delay_bound_s,
    full_batch_work,
    serving_lanes,
)
from hybridgnn.scheduler.control import PolicyControl
from hybridgnn.scheduler.policy import Policy, Profile
from hybridgnn.scheduler.router import Router
from hybridgnn.serving.batcher import MicroBatcher
from hybridgnn.serving.updates import UpdateApplier
from hybridgnn.types import (
    Batch,
    BatchResult,
    InferenceRequest,
    RoutePlan,
    ServingStats,
    StageTimings,
)

log = logging.getLogger(__name__)

# Without a profile, a hybrid server sends a batch to the GPU once its PSGS exceeds that
# of this many average seeds (a stand-in until `hybridgnn profile` measures the crossover).
DEFAULT_GPU_BATCH_SEEDS = 64
# How often the loop-lag timer runs: often enough to see a lag well under the 100 ms
# default bound, cheap enough (a few µs per tick) to cost nothing.
LAG_TICK_S = 0.005


@dataclass
class RequestResult:
    logits: np.ndarray  # the model's output
    embeddings: np.ndarray  # what the model's head reads (hidden representation)
    predictions: np.ndarray
    pipeline: str
    timings: StageTimings


class Engine:
    def __init__(self, cfg: ServeConfig, stats: ServingStats | None = None):
        self.cfg = cfg
        self.stats = stats if stats is not None else ServingStats()  # telemetry/ implements it
        self.resources = Resources.open(cfg)
        r = self.resources
        # what the request path reads, as attributes of the engine (one object, shared)
        self.graph, self.model, self.model_config, self.tables = r.graph, r.model, r.model_config, r.tables
        self.embedding_dim = embedding_width(self.model)
        self.embeddings, self.new_nodes, self.dynamic, self.incremental = (r.embeddings, r.new_nodes, r.dynamic,
                                                                           r.incremental)
        self.plan, self.features, self.device_graph, self.gpu_features = (r.plan, r.features, r.device_graph,
                                                                          r.gpu_features)
        self._sampling_only: NewNodeEvaluator | None = None
        self._current_graph_nodes: NewNodeEvaluator | None = None  # new nodes after graph updates
        self.updates: UpdateApplier | None = None
        # Requests per node since start (or since the seed log was last read): the seed
        # distribution a placement refresh computes FAP from.
        self.seed_counts = np.zeros(self.graph.num_nodes, dtype=np.int64)
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
        self.batcher_cfg = cfg.batcher
        self._batcher: MicroBatcher | None = None
        self.control = PolicyControl(cfg, tuple(self.pipelines))
        if cfg.policy.profile is not None:
            self.set_policy(self.control.load(self.graph.fingerprint))
        self.admission = self._make_admission()
        self._sampled_lane = self.admission.lanes["sampled"]
        self._refused_in_flight_cap = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batcher_task: asyncio.Task | None = None
        self._adapt_task: asyncio.Task | None = None
        self._lag_handle: asyncio.TimerHandle | None = None
        self._pending = 0
        self._idle = asyncio.Event()
        self.draining = False  # refusing new requests (503) until admitted ones finish
        self.ready = False  # what /v2/health/ready reports; turns False before draining starts
        self.stats.watch(self)

    # --- lifecycle -------------------------------------------------------------------
    def model_on(self, device: str) -> torch.nn.Module:
        return self.resources.model_on(device)

    def make_executor(self, pipeline: str, worker: int):
        """A fresh executor of the named pipeline, as its workers get."""
        return self.resources.make_executor(pipeline, worker)

    def count_seeds(self, seeds: np.ndarray) -> None:
        """Count requested seeds of the stored graph (nodes added by updates are not counted:
        placement plans cover the stored graph)."""
        n = self.seed_counts.shape[0]
        np.add.at(self.seed_counts, seeds[seeds < n] if seeds.size and seeds.max() >= n else seeds, 1)

    def save_seed_log(self, path) -> None:
        """Write the per-node request counts (atomically) for `hybridgnn place --from-log`."""
        from pathlib import Path

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npy")
        np.save(tmp, self.seed_counts)
        tmp.replace(path)

    async def refresh_placement(self) -> dict:
        """Recompute FAP from the seeds requested so far and swap in a device cache of the
        new hottest rows; requests keep flowing (see SwappableFeatureStore)."""
        if self.gpu_features is None:
            raise LookupError("no GPU feature cache to refresh (the server runs the CPU pipeline only)")
        if self.plan is not None:
            raise LookupError("serving a fixed placement plan: recompute it with `hybridgnn place --from-log` "
                              "and restart with the new --placement")
        counts = self.seed_counts.copy()
        if counts.sum() == 0:
            raise LookupError("no requests counted yet: nothing to compute a seed distribution from")
        old = self.gpu_features.current
        t0 = time.perf_counter()
        cache, fap, order = await asyncio.to_thread(self.resources.cache_for_seed_counts, counts)
        seconds = time.perf_counter() - t0
        self.gpu_features.swap(cache)
        self.stats.placement_refreshed()
        kept = int(np.intersect1d(np.flatnonzero(old.slot.cpu().numpy() >= 0),
                                  np.flatnonzero(cache.slot.cpu().numpy() >= 0)).size)
        report = {"cached_rows": cache.cached_rows, "rows_kept": kept, "requests_counted": int(counts.sum()),
                  "seconds": round(seconds, 3), "cached_fap_share": float(fap[order[:cache.cached_rows]].sum()
                                                                            / max(fap.sum(), 1e-12))}
        log.info("placement refreshed from %d counted requests in %.2fs: %d of %d cached rows kept",
                 report["requests_counted"], seconds, kept, cache.cached_rows)
        return report

    def _make_admission(self) -> Admission:
        """Lanes for each kind of work and the delay bound (scheduler/admission.py decides)."""
        self._seed_psgs = float(np.mean(self.tables.psgs))
        self._mean_request_psgs = self._seed_psgs
        full_batch = self._full_batch_psgs()
        slo_s = service_s = None
        if self.policy is not None and self.policy.name.startswith("slo"):
            slo_s = float(self.policy.name.split(":", 1)[1]) / 1000.0
            service_s = max(float(dev.tail(full_batch)) for dev in self.profile.devices.values())
        bound = delay_bound_s(self.cfg.admission.max_queue_delay_s, slo_s, self.cfg.batcher.max_wait_s, service_s)
        workers = sum(p.cfg.workers for p in self.pipelines.values())
        log.info("admission: a request is refused (429) when its predicted queueing delay passes %.0f ms", bound * 1e3)
        return Admission(bound, serving_lanes(workers, self.cfg.cpu_pipeline.workers, full_batch,
                                              self.cfg.updates.max_batch_updates))

    def _full_batch_psgs(self) -> float:
        b = self.batcher_cfg
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
    def recent(self) -> dict[str, collections.deque]:
        return self.control.recent

    def service_stretch(self, last: int = 500) -> dict[str, float] | None:
        return self.control.service_stretch(last)

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
        """Put a threshold and batch-PSGS bound in force (at start, and from --adapt)."""
        self.control.policy = policy
        if len(self.pipelines) > 1:
            self.router.set_threshold(policy.psgs_threshold)
        self.router.spill_limits = dict(policy.pipeline_limits)
        self.batcher_cfg = dataclasses.replace(self.cfg.batcher, max_batch_psgs=policy.max_batch_psgs
                                               if policy.max_batch_psgs > 0 else math.inf)
        if self._batcher is not None:
            self._batcher.cfg = self.batcher_cfg

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        torch.set_num_threads(self.cfg.cpu_pipeline.torch_threads)
        self._idle.set()
        for p in self.pipelines.values():
            p.start()
        self._warm_up()
        self._batcher = MicroBatcher(self.batcher_cfg, self._dispatch, self._has_capacity)
        self._batcher_task = asyncio.create_task(self._batcher.run(), name="batcher")
        self._adapt_task = (asyncio.create_task(self.control.adapt_loop(self._apply_adapted), name="adapt")
                            if self.cfg.policy.adapt and self.profile is not None else None)
        self._lag_tick(self._loop.time())
        if self.dynamic is not None:
            self.updates = UpdateApplier(self.cfg.updates, self.incremental, self.dynamic, self.stats)
            self.updates.start()
        self.ready = True

    def _lag_tick(self, due: float) -> None:
        """Feed admission how late this timer ran (the event loop's lag), every LAG_TICK_S."""
        now = self._loop.time()
        self.admission.loop_lag.observe(now - due)
        self._lag_handle = self._loop.call_at(now + LAG_TICK_S, self._lag_tick, now + LAG_TICK_S)

    def _warm_up(self) -> None:
        """Compile the samplers (plain and with a query-edge overlay) and touch the model once,
        so the first request of either kind is not slow."""
        seeds = np.arange(min(4, self.graph.num_nodes), dtype=np.int64)
        self.resources.make_executor("cpu", 0, in_process=True).run(seeds)
        if self.gpu_features is not None:
            self.resources.make_executor("gpu", 0).run(seeds)
        n = self.graph.num_nodes
        base = CPUSampler(self.graph, self.cfg.sampling.fanouts)  # new-node requests sample the stored graph
        base.sample(np.array([n]), overlay=(np.array([n]), np.array([0, 1]), np.array([0])), num_extra_nodes=1)

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
        if self._adapt_task is not None:
            self._adapt_task.cancel()
            await asyncio.gather(self._adapt_task, return_exceptions=True)
        if self._batcher is not None:
            self._batcher.close()
        if self._batcher_task is not None:
            await asyncio.gather(self._batcher_task, return_exceptions=True)
        for p in self.pipelines.values():
            await asyncio.to_thread(p.stop)
        self.resources.close()

    # --- request path ----------------------------------------------------------------
    @property
    def pending(self) -> int:
        return self._pending

    def _admit(self, lane: str, work: float) -> None:
        """Count one more request in flight on `lane`, or raise Draining / Overloaded (its
        predicted queueing delay past the bound, or the hard cap on requests in flight)."""
        if self.draining or self._batcher is None:
            raise Draining("server is shutting down" if self.draining else "server is starting",
                           retry_after_s=self.cfg.server.retry_after_s)
        if self._pending >= self.cfg.batcher.max_pending_requests:
            self._refused_in_flight_cap += 1
            raise Overloaded(f"{self._pending} requests in flight (limit {self.cfg.batcher.max_pending_requests})",
                             retry_after_s=self.cfg.server.retry_after_s)
        self.admission.admit(lane, work)
        self._pending += 1
        self._idle.clear()

    def _release(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()

    def shed_sampled(self) -> None:
        """Raise Overloaded if the sampled lane is past its delay bound before any new
        request: the front end calls this before decoding a plain sampled request."""
        if self._batcher is not None and not self.draining:
            self.admission.check("sampled")

    def submit(self, node_ids: np.ndarray) -> asyncio.Future:
        """Admit one request (ids already validated) or raise Overloaded / Draining."""
        psgs = self.tables.batch_psgs(node_ids)
        self._admit("sampled", psgs)
        self._mean_request_psgs += 0.01 * (psgs - self._mean_request_psgs)
        requests = self.control.count_admitted(int(node_ids.shape[0]))
        if not requests & 255:  # the batch size under backlog follows the request mix
            self._sampled_lane.full_batch = self._full_batch_psgs()
        fut = self._loop.create_future()
        self._batcher.add(InferenceRequest(node_ids=node_ids, future=fut, arrival_s=time.perf_counter(), psgs=psgs))
        return fut

    def _has_capacity(self) -> bool:
        return any(p.depth <= p.cfg.workers for p in self.pipelines.values())

    def _dispatch(self, batch: Batch) -> None:
        try:
            self.count_seeds(batch.seeds)
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
        # Called on a worker thread; the loop owns the futures.
        self._loop.call_soon_threadsafe(self._complete, batch, plan, result, error)

    def _complete(self, batch: Batch, plan: RoutePlan, result: BatchResult | None, error: BaseException | None):
        stats = self.stats
        if self._batcher is not None:
            self._batcher.capacity_freed()
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
        rt = result.timings
        service_s = rt.sample_s + rt.gather_s + rt.compute_s
        self.recent[plan.pipeline].append((batch.psgs, service_s))
        self._sampled_lane.observe(batch.psgs, service_s)
        offs = batch.offsets
        for i, req in enumerate(batch.requests):
            stats.stage("batching", plan.pipeline, batch.closed_s - req.arrival_s)
            lo, hi = offs[i], offs[i + 1]
            self._resolve(req, RequestResult(result.logits[lo:hi], result.embeddings[lo:hi],
                                             result.predictions[lo:hi], plan.pipeline, result.timings))
        self._sampled_lane.completed(batch.psgs, time.perf_counter())

    def _resolve(self, req: InferenceRequest, result: RequestResult | None = None, exception=None) -> None:
        if not req.future.done():
            if exception is not None:
                req.future.set_exception(exception)
            else:
                req.future.set_result(result)
        self._sampled_lane.remove(req.psgs)
        self._release()

    async def lookup_precomputed(self, node_ids: np.ndarray, *, with_embeddings: bool = True) -> RequestResult:
        """Answer from the stored final layer: no sampling, constant time per id. The hidden
        rows (`embeddings`) are a second gather, made only when asked for (else 0 columns)."""
        if self.draining:
            raise Draining("server is shutting down", retry_after_s=self.cfg.server.retry_after_s)
        if self.embeddings is None:
            raise Conflict("no precomputed embeddings for this model and dataset; run `hybridgnn precompute`")
        if self.incremental is not None:
            # Off the loop: the lookup waits while an update batch holds the graph's writer lock.
            logits, hidden = await self._in_thread_lane("lookup", 1.0, self.incremental.lookup_both, node_ids,
                                                        with_embeddings)
        else:
            logits = self.embeddings.lookup(node_ids)
            hidden = (hidden_rows(self.model, self.embeddings.layers, self.graph.features.__getitem__, node_ids)
                      if with_embeddings else np.empty((len(node_ids), 0), np.float32))
        return RequestResult(logits, hidden, logits.argmax(axis=1).astype(np.int64), "precomputed", StageTimings())

    async def infer_new_nodes(self, features: np.ndarray, edge_index: np.ndarray, *, mode: str, gamma: float,
                              policy: str, num_nodes: int | None = None) -> RequestResult:
        """Embeddings of query nodes (full / pe / srpe from PEs, or sampled), computed off the
        event loop. Counted as pending, so a drain waits for it. num_nodes: the graph's size
        when the request was decoded (its query nodes are num_nodes..); after graph updates
        the request is evaluated on the graph and embeddings as they are then."""
        if self.new_nodes is None and mode != "sampled":
            raise Conflict("new-node requests need precomputed embeddings; run `hybridgnn precompute`")
        t0 = time.perf_counter()
        kw = dict(mode=mode, gamma=gamma, policy=policy, fanouts=self.cfg.sampling.fanouts)
        if self.dynamic is not None and self.dynamic.version > 0:
            res = await self._in_thread_lane("new_nodes", 1.0, self._infer_on_current_graph, features, edge_index,
                                             num_nodes if num_nodes is not None else self.num_nodes, kw)
        else:
            res = await self._in_thread_lane("new_nodes", 1.0, self._new_node_evaluator(mode).infer, features,
                                             edge_index, **kw)
        return RequestResult(res.logits, res.embeddings, res.logits.argmax(axis=1).astype(np.int64),
                             f"newnodes_{mode}", StageTimings(compute_s=time.perf_counter() - t0))

    def _infer_on_current_graph(self, features, edge_index, decoded_at: int, kw: dict):
        """A new-node request on the updated graph, under its read lock (one version)."""
        if self.incremental is None:
            raise Conflict("new-node requests after graph updates need precomputed embeddings kept fresh; "
                           "run `hybridgnn precompute` and restart")
        if self._current_graph_nodes is None:
            self._current_graph_nodes = NewNodeEvaluator(self.graph, self.model, self.embeddings,
                                                         view=DynamicGraphView(self.dynamic, self.incremental))
        with self.dynamic.lock.read():
            n = self.dynamic.num_nodes
            if n != decoded_at:  # nodes were added since decoding: query ids move up with them
                edge_index = np.where(edge_index >= decoded_at, edge_index + (n - decoded_at), edge_index)
            existing = edge_index[edge_index < n]
            self.check_alive(np.unique(existing))
            return self._current_graph_nodes.infer(features, edge_index, **kw)

    def _new_node_evaluator(self, mode: str) -> NewNodeEvaluator:
        if self.new_nodes is not None:
            return self.new_nodes
        # `sampled` needs no stored embeddings; an evaluator without them serves only it.
        if self._sampling_only is None:
            self._sampling_only = NewNodeEvaluator(self.graph, self.model, None)
        return self._sampling_only

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

    async def apply_update(self, req) -> dict:
        """Queue a decoded graph update; resolves once the graph and embeddings reflect it."""
        if self.dynamic is None:
            raise Forbidden("graph updates are disabled; start the server with --update-token")
        if self.updates is None:
            raise Draining("server is starting")
        if self.draining:
            raise Draining("server is shutting down")
        return await self._in_lane("updates", float(max(1, req.num_updates)), self.updates.submit, req)

    async def _in_lane(self, lane_name: str, work: float, call, *args, **kwargs):
        """Admit `work` on a lane, await call(*args, **kwargs), and release it. The lane's
        cost model learns from calls that found it empty (their time is service, not wait)."""
        self._admit(lane_name, work)
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

    async def _in_thread_lane(self, lane_name: str, work: float, fn, *args, **kwargs):
        """Admit `work` on a lane and run fn off the event loop; the lane learns the time fn
        took in its thread (service), not the wait for the thread or the loop around it."""
        self._admit(lane_name, work)
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

    # --- description -----------------------------------------------------------------
    def metadata(self) -> dict:
        thr = self.router.threshold
        return {
            "num_nodes": self.num_nodes,
            "num_edges": self.graph.num_edges if self.dynamic is None else self.dynamic.num_edges,
            "feature_dim": self.graph.feature_dim,
            "num_classes": self.model.out_dim,
            "logits_dim": self.model.out_dim,
            "embedding_dim": self.embedding_dim,
            "fanouts": list(self.cfg.sampling.fanouts),
            "model_kind": model_kind(self.model_config),
            "model_class": self.model_config["class"],
            "num_layers": self.model.num_layers,
            "dataset": self.graph.name,
            "dataset_fingerprint": self.graph.fingerprint,
            "pipelines": list(self.pipelines),
            "devices": {name: p.cfg.device for name, p in self.pipelines.items()},
            "gpu_cache_rows": (getattr(self.gpu_features.current, "cached_rows", None)
                               if self.gpu_features is not None else 0),
            "placement_plan": str(self.cfg.gpu_memory.placement_plan) if self.plan is not None else None,
            "psgs_threshold": "inf" if math.isinf(thr) else thr,
            "policy": self.policy.name if self.policy else None,
            "max_batch_psgs": "inf" if math.isinf(self.batcher_cfg.max_batch_psgs) else self.batcher_cfg.max_batch_psgs,
            "predicted_seeds_per_s": self.policy.predicted_seeds_per_s if self.policy else None,
            "predicted_assumes": self.control.prediction_assumes(),
            "service_stretch": self.service_stretch(),
            "admission": {**self.admission.describe(), "refused_in_flight_cap": self._refused_in_flight_cap},
            "max_request_nodes": self.cfg.server.max_request_nodes,
            "modes": ["sampled"] + (["precomputed"] if self.embeddings is not None else []),
            "node_ids": self.graph.id_map.kind if self.graph.id_map is not None else "dense",
            "new_node_modes": (["full", "pe", "srpe"] if self.embeddings is not None else []) + ["sampled"],
            "srpe_gamma": self.cfg.new_nodes.gamma,
            "pe_computed_unix_s": self.embeddings.computed_unix_s if self.embeddings is not None else None,
            "updates_enabled": self.dynamic is not None,
            "graph_version": self.dynamic.version if self.dynamic is not None else 0,
            "pe_updated_unix_s": (self.incremental.last_update_unix_s if self.incremental is not None else None),
        }
