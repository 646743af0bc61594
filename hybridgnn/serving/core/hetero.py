"""The engine of a heterogeneous graph: node outputs per node type, link scores of pairs
and the top-k of candidate sets, batched and routed like node requests.

Requests wait in one queue; whenever a pipeline worker is free, the requests waiting
(up to --max-batch-seeds seeds and the batch-PSGS bound) become one batch, sampled
together, so a batch's PSGS is the sum of its requests' (each pair's both ends, each
top-k's seeds and candidates) from the typed tables. The router sends it to the CPU or
the GPU pipeline by that PSGS (Quiver's rule); each pipeline is a pool of worker threads,
each with its own typed sampler (pipelines/hetero.py). Admission judges each request by
its PSGS as on homogeneous graphs.

Event loop thread, except the batches themselves (worker threads; results cross back
through the loop's executor futures). Invariant: every admitted request's future is
completed exactly once (result or error), including at stop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridgnn.capabilities import HAS_CUDA
from hybridgnn.config import DEFAULT_FANOUT, ServeConfig, fanouts_served
from hybridgnn.errors import BatchFailed, ConfigError, Conflict, Draining, Forbidden
from hybridgnn.scheduler.admission import admission_for, new_node_work
from hybridgnn.scheduler.router import Router
from hybridgnn.serving.core.admitting import Admitting
from hybridgnn.serving.core.statistics import ModelStatistics
from hybridgnn.types import (
    EngineSnapshot,
    QueueLoad,
    RoutePlan,
    ServingStats,
    StageTimings,
    TypedNewNodes,
    TypedQuery,
    TypedResult,
)

log = logging.getLogger("hybridgnn.serving.core.engine")
TOPK_UNIT_PAIRS = 1 << 16  # (seed, candidate) pairs a top-k lookup scores per unit of lookup work


@dataclass
class _Job:
    query: TypedQuery
    psgs: float
    future: asyncio.Future
    predicted_wait_s: float
    num_seeds: int  # of both ends (pairs) or seeds and candidates (top-k)
    arrival_s: float = field(default_factory=time.perf_counter)


class _Workers:
    """One pipeline's worker threads; each builds its own executor on first use."""

    def __init__(self, name: str, device: str, workers: int, make):
        self.name, self.device, self.workers = name, device, workers
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"hetero-{name}")
        self.depth = 0  # batches submitted and not yet completed
        self._make = make
        self._local = threading.local()
        self._numbers = itertools.count()

    def executor(self):
        ex = getattr(self._local, "executor", None)
        if ex is None:
            ex = self._local.executor = self._make(self.name, next(self._numbers))
        return ex


def served_fanouts(cfg: ServeConfig, config: dict):
    """--fanouts (one list for every edge type), else the model's saved fanouts (a list or a
    dict per edge type), else DEFAULT_FANOUT per layer."""
    if cfg.sampling.fanouts is not None:
        return list(cfg.sampling.fanouts)
    return config.get("fanouts") or [DEFAULT_FANOUT] * int(config["num_layers"])


class HeteroEngine(Admitting):
    typed = True  # the v2 service decodes typed requests for it (node types, pairs, top-k)
    default_mode = "sampled"
    serves_full = False

    def __init__(self, cfg: ServeConfig, stats: ServingStats | None = None, *, version: str = "1"):
        from hybridgnn.embeddings.hetero import HeteroEmbeddingStore
        from hybridgnn.embeddings.hetero_newnodes import HeteroNewNodes
        from hybridgnn.graph.hetero import HeteroGraphStore
        from hybridgnn.models.checkpoint import CheckpointError
        from hybridgnn.models.hetero_checkpoint import open_hetero_model
        from hybridgnn.models.link import load_decoder
        from hybridgnn.pipelines.hetero import PrecomputedExecutor
        from hybridgnn.serving.core.placement_refresh import TypedSeedCounts
        from hybridgnn.workload.typed import (
            TypedWorkloadTables,
            num_hops,
            typed_fanouts,
        )

        self.stats = stats if stats is not None else ServingStats()
        self.model_version = version
        self.model_stats = ModelStatistics()
        self.graph = graph = HeteroGraphStore.open(cfg.dataset_dir)
        try:
            self.model, config = open_hetero_model(cfg.model_dir, graph)
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        self.out_dims: dict[str, int] = {t: int(v) for t, v in config["out_dims"].items()}
        self.decoder, self.link_pairs = None, []
        self.decoder_kind = None
        if config.get("link_decoder") is not None:
            try:
                self.decoder, self.link_pairs = load_decoder(cfg.model_dir, config["link_decoder"], self.out_dims)
            except (ValueError, CheckpointError) as exc:
                raise ConfigError(f"model {cfg.model_dir}: {exc}") from None
            self.decoder_kind = config["link_decoder"]["kind"]
        try:
            self.fanouts = typed_fanouts(graph.edge_types, served_fanouts(cfg, config))
        except ValueError as exc:
            raise ConfigError(f"fanouts: {exc}") from None
        if num_hops(self.fanouts) < self.model.num_layers:
            hops = num_hops(self.fanouts)
            raise ConfigError(f"fanouts give {hops} {'hop' if hops == 1 else 'hops'} but the model has "
                              f"{self.model.num_layers} layers")
        if num_hops(self.fanouts) > self.model.num_layers:  # as a homogeneous server: the hops an answer uses
            fanouts_served(next(iter(self.fanouts.values())), self.model.num_layers)  # says so
            self.fanouts = {e: f[:self.model.num_layers] for e, f in self.fanouts.items()}
        self.cfg = cfg
        self.model_class, self.num_layers = config["class"], self.model.num_layers
        # per-node request counts of each type, counted only for the seed log (--seed-log)
        self._seed_counts = (TypedSeedCounts({t: graph.num_nodes(t) for t in graph.node_types})
                             if cfg.server.seed_log is not None else None)
        t0 = time.perf_counter()
        self.tables = TypedWorkloadTables.load_or_build(graph, self.fanouts)
        log.info("typed PSGS/FAP tables ready in %.2fs", time.perf_counter() - t0)
        self._features = {t: n.features for t, n in graph.nodes.items()}
        self.embeddings = HeteroEmbeddingStore.for_graph(cfg.model_dir, graph)
        self._precomputed = self._new_nodes = None
        if self.embeddings is not None:
            lacking = sorted(set(self.out_dims) - set(self.embeddings.output))
            if lacking:
                raise ConfigError(f"the precomputed embeddings in {self.embeddings.root} lack node types {lacking}; "
                                  "run `hybridgnn precompute` again")
            self._precomputed = PrecomputedExecutor(self.embeddings, self.decoder)
            try:
                self._new_nodes = HeteroNewNodes(graph, self.model, self.embeddings)
            except ValueError as exc:
                raise ConfigError(f"precomputed embeddings in {self.embeddings.root}: {exc}; run `hybridgnn "
                                  "precompute` again") from None
            for e in graph.edge_types:  # what new-node decoding asks, found here, off the event loop
                graph.symmetric(e)
            log.info("precomputed embeddings of %s served (mode precomputed, new nodes)", self.embeddings.root)
        # Lookups leave the loop (a top-k over a whole node type is a matrix product), on as
        # many threads as admission's lookup lane counts servers.
        self._lookup_pool = concurrent.futures.ThreadPoolExecutor(cfg.cpu_pipeline.workers,
                                                                  thread_name_prefix="hetero-lookup")
        self._new_node_pool = concurrent.futures.ThreadPoolExecutor(cfg.cpu_pipeline.workers,
                                                                    thread_name_prefix="hetero-newnodes")
        self._workers = {cfg.cpu_pipeline.name: _Workers(cfg.cpu_pipeline.name, cfg.cpu_pipeline.device,
                                                         cfg.cpu_pipeline.workers, self._make_executor)}
        if cfg.gpu_pipeline is not None:
            g = cfg.gpu_pipeline
            self._workers[g.name] = _Workers(g.name, g.device, g.workers, self._make_executor)
        for w in self._workers.values():  # else the model's move failed with torch's own words
            if torch.device(w.device).type == "cuda" and not HAS_CUDA:
                raise ConfigError(f"the {w.name} pipeline is set to {w.device} but no CUDA device is visible; "
                                  "use --device cpu (or --device auto)")
        self._models = {w.device: self.model if w.device == "cpu" else self._on(w.device)
                        for w in self._workers.values()}
        self._router = Router(cfg.router, tuple(self._workers))
        mean_psgs = float(np.mean(np.concatenate([np.asarray(v, np.float64) for v in self.tables.psgs.values()])))
        if len(self._workers) > 1 and cfg.router.psgs_threshold is None:
            self._router.set_threshold(cfg.router.default_gpu_batch_seeds * mean_psgs)
        servers = sum(w.workers for w in self._workers.values())
        self._admission = admission_for(cfg, servers, cfg.batcher.max_batch_seeds * mean_psgs, None, None)
        self._sampled_lane = self._admission.lanes["sampled"]
        self._admitted_seed_psgs = mean_psgs
        self._refused_in_flight_cap = 0
        self._pending = 0
        self._idle = asyncio.Event()
        self._started = False
        self._waiting: collections.deque[_Job] = collections.deque()
        self._in_flight: set[asyncio.Future] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.ready = False
        # the GPU pipeline's typed CSR, once for all its workers (pinned host memory read over
        # UVA, or one copy in device memory: --graph-placement); released at stop
        self._device_graph = None
        if cfg.gpu_pipeline is not None:
            from hybridgnn.capabilities import DEVICE_GATE
            from hybridgnn.graph.uva import TypedDeviceGraph

            with DEVICE_GATE.work():  # registers host memory: no capture meanwhile
                self._device_graph = TypedDeviceGraph(graph, cfg.gpu_pipeline.device, cfg.gpu_memory.graph_placement)
        self.stats.watch(self.snapshot, tuple(self._workers))

    def _on(self, device: str):
        import copy

        return copy.deepcopy(self.model).to(device)

    def _make_executor(self, pipeline: str, worker: int):
        from hybridgnn.pipelines.hetero import TypedExecutor
        from hybridgnn.sampling.typed import TypedCPUSampler, TypedTorchSampler

        w = self._workers[pipeline]
        seed = self.cfg.sampling.seed + worker + (1000 if pipeline == "gpu" else 0)
        if pipeline == "gpu":  # the shared CSR tensors; the sampler owns only its id maps
            sampler = TypedTorchSampler(self._device_graph.csr, {t: self.graph.num_nodes(t) for t in
                                                                 self.graph.node_types}, self.fanouts, seed=seed)
        else:
            sampler = TypedCPUSampler(self.graph, self.fanouts, seed=seed)
        decoder = self.decoder.to(w.device) if hasattr(self.decoder, "to") else self.decoder
        return TypedExecutor(sampler, self._features, self._models[w.device], decoder, w.device)

    # --- what others read --------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return sum(self.graph.num_nodes(t) for t in self.graph.node_types)

    @property
    def max_feature_dim(self) -> int:
        """The widest feature row a new-node request may carry."""
        return max(self.graph.nodes[t].feature_dim for t in self.graph.node_types)

    @property
    def serves_new_nodes(self) -> bool:
        return self._new_nodes is not None

    @property
    def graph_version(self) -> int:
        return 0

    @property
    def takes_updates(self) -> bool:
        return False

    @property
    def modes(self) -> list[str]:
        """parameters.mode values this server answers (precomputed: after `hybridgnn precompute`)."""
        return ["sampled"] + (["precomputed"] if self._precomputed is not None else [])

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(pending=self._pending, pending_capacity=self.cfg.batcher.max_pending_requests,
                              ready=self.ready, queue_depths={n: w.depth for n, w in self._workers.items()},
                              psgs_threshold=self._router.threshold, max_batch_psgs=self.cfg.batcher.max_batch_psgs,
                              policy="none")

    def metadata(self) -> dict:
        g, thr = self.graph, self._router.threshold
        return {
            "graph": "heterogeneous", "dataset": g.name, "dataset_fingerprint": g.fingerprint,
            "node_types": [{"name": t, "num_nodes": g.num_nodes(t), "feature_dim": g.nodes[t].feature_dim,
                            "output_dim": self.out_dims.get(t), "node_ids": (g.nodes[t].id_map.kind if
                                                                             g.nodes[t].id_map is not None else
                                                                             "dense")} for t in g.node_types],
            "edge_types": [list(e) for e in g.edge_types],
            "fanouts": {"__".join(e): list(v) for e, v in self.fanouts.items()},
            "model_class": self.model_class, "num_layers": self.num_layers,
            "link_decoder": self.decoder_kind, "link_types": [list(p) for p in self.link_pairs],
            "request_kinds": ["node"] + (["pair", "topk"] if self.decoder is not None else [])
            + (["new_nodes"] if self.serves_new_nodes else []),
            "new_node_modes": ["full", "pe", "srpe"] if self.serves_new_nodes else [],
            "pipelines": list(self._workers), "devices": {n: w.device for n, w in self._workers.items()},
            "psgs_threshold": "inf" if math.isinf(thr) else thr,
            "admission": {**self._admission.describe(), "refused_in_flight_cap": self._refused_in_flight_cap},
            "max_request_nodes": self.cfg.server.max_request_nodes, "modes": self.modes,
            **({"embeddings_computed_unix_s": self.embeddings.computed_unix_s} if self.embeddings else {}),
            "updates_enabled": False, "graph_version": 0,
        }

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        torch.set_num_threads(self.cfg.cpu_pipeline.torch_threads)
        self._idle.set()
        warm = TypedQuery("node", next(iter(self.out_dims)), np.zeros(1, np.int64))
        for name, w in self._workers.items():  # compiles the sampler and runs the model once, off the loop
            await asyncio.wrap_future(w.pool.submit(lambda w=w, name=name: w.executor().run([warm], name)))
        self.start_lag_ticks()
        self._started = True
        self.ready = True

    async def stop_updates(self) -> None:
        """Nothing to stop: heterogeneous graphs take no updates."""

    async def stop(self) -> None:
        self.stop_lag_ticks()
        for job in self._waiting:
            self._resolve(job, error=Draining("server is shutting down"))
        self._waiting.clear()
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        for pool in [w.pool for w in self._workers.values()] + [self._lookup_pool, self._new_node_pool]:
            await asyncio.to_thread(pool.shutdown, wait=True)
        device_graph, self._device_graph = self._device_graph, None
        if device_graph is not None:  # no worker reads it any more
            await asyncio.to_thread(device_graph.close)
        self.stats.unwatch(self.snapshot)

    async def refresh_placement(self) -> dict:
        raise LookupError("a heterogeneous server keeps no GPU feature cache")

    def save_seed_log(self, path) -> None:
        """Write the per-node request counts of every node type requests named (a .counts.npz
        of one array per type, for `hybridgnn workload build --seeds`)."""
        if self._seed_counts is not None:
            self._seed_counts.save_seed_log(path)

    async def update_graph(self, update, waited_s: float = 0.0):
        raise Forbidden("graph updates are not served for heterogeneous graphs")

    async def wait_for_version(self, wanted: int) -> bool:
        return False

    # --- requests ----------------------------------------------------------------------
    def query_psgs(self, query: TypedQuery) -> float:
        """The request's PSGS: its seeds' (both ends, or seeds and candidates) summed."""
        return sum(self.tables.batch_psgs(t, ids) for t, ids in query.seeds())

    def infer(self, query: TypedQuery, waited_s: float = 0.0, mode: str = "sampled",
              with_embeddings: bool = True) -> asyncio.Future:
        """Admit a validated query (or raise Overloaded / Draining; Conflict for mode
        precomputed without precomputed embeddings); an awaitable of its TypedResult."""
        if isinstance(query, TypedNewNodes):
            work = new_node_work(len(query.features), sum(e.shape[1] for e in query.edges.values()))
            return asyncio.ensure_future(self.run_in_lane("new_nodes", work, self._new_node_answer, query, work,
                                                          waited_s=waited_s, learn=False))
        if mode == "precomputed":
            if self._precomputed is None:
                raise Conflict("no precomputed embeddings for this model and dataset; run `hybridgnn precompute "
                               f"--dataset {self.cfg.dataset_dir} --model {self.cfg.model_dir}` and restart")
            # a lookup costs about one unit; a top-k scores every (seed, candidate) pair
            work = 1.0 + (len(query.src_ids) * len(query.dst_ids) / TOPK_UNIT_PAIRS if query.kind == "topk" else 0.0)
            return asyncio.ensure_future(self.run_in_lane("lookup", work, self._lookup, query, with_embeddings, work,
                                                          waited_s=waited_s, learn=False))
        psgs = self.query_psgs(query)
        predicted = self.admit("sampled", psgs, waited_s)
        job = _Job(query, psgs, self._loop.create_future(), predicted, sum(len(ids) for _, ids in query.seeds()))
        self._admitted_seed_psgs += 0.05 * (psgs / max(1, job.num_seeds) - self._admitted_seed_psgs)
        self._waiting.append(job)
        self._pump()
        return job.future

    # The lookup and new-node lanes learn their cost from every call's time on its thread
    # (not from calls that found the lane empty, whose wall time is all service): a client
    # sending only bursts found it never empty, and the unmeasured lane admitted every
    # heavy top-k of every burst (gigabytes, a loop held for tens of seconds).
    async def _lookup(self, query: TypedQuery, with_embeddings: bool, work: float) -> TypedResult:
        result = await asyncio.wrap_future(self._lookup_pool.submit(self._precomputed.run, query, with_embeddings))
        service_s = result.timings.gather_s + result.timings.compute_s
        self.lane("lookup").observe(work, service_s)
        self.stats.stage("compute", "precomputed", service_s)
        return result

    async def _new_node_answer(self, query: TypedNewNodes, work: float) -> TypedResult:
        result = await asyncio.wrap_future(self._new_node_pool.submit(self._evaluate_new_nodes, query))
        self.lane("new_nodes").observe(work, result.timings.compute_s)
        self.stats.stage("compute", result.pipeline, result.timings.compute_s)
        return result

    def _evaluate_new_nodes(self, query: TypedNewNodes) -> TypedResult:
        """Query nodes' outputs from the precomputed embeddings (and, with k, the top-k of
        every node of dst_type by the decoder's score against them); on a worker thread."""
        t0 = time.perf_counter()
        res = self._new_nodes.infer(query.node_type, query.features, query.edges, mode=query.mode,
                                    gamma=query.gamma, policy=query.policy, seed=self.cfg.sampling.seed)
        out = self._precomputed.new_node_outputs(query.node_type, res.embeddings, res.logits, query.dst_type,
                                                 query.k)
        return TypedResult(f"newnodes_{query.mode}", StageTimings(compute_s=time.perf_counter() - t0), **out)

    def _pump(self) -> None:
        """Start batches while a worker is free."""
        free = sum(w.workers - w.depth for w in self._workers.values())
        while self._waiting and free > 0:
            jobs = self._take()
            if self._seed_counts is not None:  # once per batch started (a retry on the other pipeline is not counted)
                self._seed_counts.count(seeds for j in jobs for seeds in j.query.seeds())
            psgs = sum(j.psgs for j in jobs)
            plan = self._router.route(psgs, {n: QueueLoad(w.depth, w.workers) for n, w in self._workers.items()})
            self._run(jobs, plan)
            free -= 1

    def _take(self) -> list[_Job]:
        b = self.cfg.batcher
        first = self._waiting.popleft()
        jobs, seeds, psgs = [first], first.num_seeds, first.psgs
        while self._waiting and len(jobs) < b.max_batch_requests:
            nxt = self._waiting[0]
            if seeds + nxt.num_seeds > b.max_batch_seeds or psgs + nxt.psgs > b.max_batch_psgs:
                break
            jobs.append(self._waiting.popleft())
            seeds += nxt.num_seeds
            psgs += nxt.psgs
        return jobs

    def _run(self, jobs: list[_Job], plan: RoutePlan) -> None:
        self.stats.routed(plan.pipeline, plan.reason)
        w = self._workers[plan.pipeline]
        w.depth += 1
        began = time.perf_counter()
        fut = self._loop.run_in_executor(w.pool, self._execute, w, [j.query for j in jobs])
        self._in_flight.add(fut)
        fut.add_done_callback(lambda f: self._complete(f, jobs, plan, began))

    @staticmethod
    def _execute(w: _Workers, queries: list[TypedQuery]) -> list[TypedResult]:
        return w.executor().run(queries, w.name)

    def _complete(self, fut: asyncio.Future, jobs: list[_Job], plan: RoutePlan, began: float) -> None:
        self._in_flight.discard(fut)
        self._workers[plan.pipeline].depth -= 1
        error = fut.exception() if not fut.cancelled() else Draining("server is shutting down")
        if error is None:  # never leave a job of the batch unanswered
            results = fut.result()
            if not isinstance(results, list) or len(results) != len(jobs):
                got = len(results) if isinstance(results, list) else type(results).__name__
                error = RuntimeError(f"the executor answered {got} of {len(jobs)} queries")
        if error is not None:
            self.stats.batch_failed(plan.pipeline)
            try:
                retry = self._router.fallback(plan)
            except LookupError:
                retry = None
            if retry is not None and not isinstance(error, Draining):
                self._run(jobs, retry)
                return
            log.error("a batch of %d heterogeneous requests failed on %s: %s", len(jobs), plan.pipeline, error,
                      exc_info=error)
            failure = BatchFailed(f"{type(error).__name__}: {error}")
            for job in jobs:
                self._resolve(job, error=failure)
        else:
            results = fut.result()
            t = results[0].timings
            service_s = t.sample_s + t.gather_s + t.compute_s
            psgs = sum(j.psgs for j in jobs)
            self.stats.batch_done(plan.pipeline, t, sum(j.num_seeds for j in jobs), len(jobs), psgs, 0)
            self.model_stats.executed()
            lane, now = self._sampled_lane, time.perf_counter()
            # as the homogeneous engine's: the rest of the batch's time, to the pipeline's
            # thread and back to the loop (no queue: a batch starts only with a worker free)
            self.stats.stage("handoff", plan.pipeline, max(0.0, now - began - t.queue_wait_s - service_s))
            lane.observe(psgs, service_s)
            for job, result in zip(jobs, results, strict=True):
                lane.calibrate(job.predicted_wait_s, began - job.arrival_s, self._admission.bound_s)
                self.stats.stage("batching", plan.pipeline, began - job.arrival_s)
                self._resolve(job, result)
            lane.completed(psgs, now)
        self._pump()

    def _resolve(self, job: _Job, result: TypedResult | None = None, error: BaseException | None = None) -> None:
        self._sampled_lane.remove(job.psgs)
        self.release()
        if not job.future.done():
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)


async def open_hetero_engine(cfg: ServeConfig, stats: ServingStats | None = None, *,
                             version: str = "1") -> HeteroEngine:
    """A started engine for a heterogeneous dataset and model (built off the event loop)."""
    from hybridgnn.serving.core.admitting import started

    if cfg.model_repository is not None or cfg.partitions.enabled:
        raise ConfigError("a heterogeneous graph is served from one --model directory, in one process (no "
                          "--model-repository or --partitions)")
    if cfg.updates.enabled:
        raise ConfigError("graph updates are not served for heterogeneous graphs: start without --update-token")
    if cfg.policy.profile is not None:  # HeteroEngine routes by --psgs-threshold alone: it was never read
        raise ConfigError("a heterogeneous graph's server serves no profile's policy: drop --profile")
    engine = await asyncio.to_thread(HeteroEngine, cfg, stats, version=version)
    return await started(engine)
