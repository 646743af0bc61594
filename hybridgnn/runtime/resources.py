"""Everything a server assembles from its configuration, in one place: the dataset, the
model (one copy of the weights per device), the workload tables, the precomputed
embeddings and new-node evaluator, the dynamic graph and its incremental embeddings when
updates are on, the placement plan, the feature stores (host; on a GPU pipeline the
device-readable topology and the FAP-ordered cache or tiered store), and the executor
factory. The serving engine, worker processes and the profiler all open their resources
here, so each is loaded the same way and the graph is stored once and shared.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time

import numpy as np
import torch

from hybridgnn.capabilities import DEVICE_GATE, HAS_CUDA
from hybridgnn.config import ServeConfig, fanouts_for, fanouts_served, fewer_hops
from hybridgnn.embeddings.incremental import (
    IncrementalConfig,
    IncrementalEmbeddings,
    computed_layers,
)
from hybridgnn.embeddings.newnodes import NewNodeEvaluator
from hybridgnn.embeddings.store import EmbeddingStore
from hybridgnn.errors import ConfigError, LogTrimmed, ServiceUnavailable
from hybridgnn.features.gather import TieredFeatureStore
from hybridgnn.features.placement import Plan
from hybridgnn.features.store import (
    CachedFeatureStore,
    DynamicFeatureStore,
    HostFeatureStore,
    SwappableFeatureStore,
    hottest_first,
)
from hybridgnn.graph.degrees import DeviceNodeDegrees, NodeDegrees
from hybridgnn.graph.dynamic import DynamicGraph
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.checkpoint import load_checkpoint
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.pipelines.process import ProcessExecutor
from hybridgnn.pipelines.split import (
    SplitDeviceStage,
    SplitExecutor,
    split_device_threads,
)
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler
from hybridgnn.updates.log import UpdateLog, open_update_log
from hybridgnn.updates.snapshot import (
    Snapshot,
    Snapshots,
    legacy_model_fingerprint,
    model_fingerprint,
)
from hybridgnn.workload.tables import WorkloadTables

log = logging.getLogger(__name__)


def embeddings_missing(cfg: ServeConfig, graph: GraphStore | None = None) -> bool:
    """Whether the model has no complete embeddings for the dataset (a model dropped into a
    repository without them: `hybridgnn precompute` makes them). ConfigError when its
    features do not fit the dataset's, which a precompute could not mend. graph: the
    dataset already open (shared), else it is opened here."""
    graph = graph if graph is not None else GraphStore.open(cfg.dataset_dir)
    if EmbeddingStore.for_graph(cfg.model_dir, graph) is not None:
        return False
    model, _ = load_checkpoint(cfg.model_dir)
    if model.in_dim != graph.feature_dim:
        raise ConfigError(f"model {cfg.model_dir} expects {model.in_dim}-dim features but dataset "
                          f"{cfg.dataset_dir} has {graph.feature_dim}")
    return True


def build_worker_executor(cfg: ServeConfig, worker: int):
    """A worker process's executor (run in the child): its own resources from the same
    configuration, the dataset memory-mapped like the server's."""
    return Resources.open(cfg, in_worker=True).make_executor("cpu", worker)


class Resources:
    """Loaded once per process and shared by every worker of it. Raises ConfigError for a
    dataset, model, plan or device that do not fit together."""

    @classmethod
    def open(cls, cfg: ServeConfig, base: Resources | None = None, *, in_worker: bool = False) -> Resources:
        with DEVICE_GATE.work():  # registers host memory, moves the model: no capture meanwhile
            return cls(cfg, base, in_worker=in_worker)

    def __init__(self, cfg: ServeConfig, base: Resources | None = None, *, in_worker: bool = False):
        """base: the resources of another model served over the same graph; its dataset,
        workload tables (for the same fanouts), placement plan and feature stores are
        shared, not loaded again (a model repository). Graph updates need their own.
        in_worker: opened again in a CPU worker process, whose server has already said
        what there is to say about this dataset and model (each worker repeated it)."""
        self.cfg = cfg
        if base is not None and (cfg.updates.enabled or base.dynamic is not None):
            raise ConfigError("graph updates serve one model; a model repository serves several without updates")
        self.graph = base.graph if base is not None else GraphStore.open(cfg.dataset_dir)
        self.model, self.model_config = load_checkpoint(cfg.model_dir)
        if cfg.sampling.fanouts is None:  # the model's own (config.fanouts_for)
            cfg = self.cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(
                cfg.sampling, fanouts=fanouts_for(self.model_config)))
        if self.model.in_dim != self.graph.feature_dim:
            raise ConfigError(
                f"model {cfg.model_dir} expects {self.model.in_dim}-dim features but dataset {cfg.dataset_dir} "
                f"has {self.graph.feature_dim}")
        refusal = fewer_hops(cfg.sampling.fanouts, self.model.num_layers)
        if refusal:
            raise ConfigError(refusal)
        cfg = self.cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(
            cfg.sampling, fanouts=fanouts_served(cfg.sampling.fanouts, self.model.num_layers)))
        trained_on = self.model_config.get("dataset_fingerprint")
        if trained_on and trained_on != self.graph.fingerprint and not in_worker:
            log.warning("model %s was trained on another dataset (fingerprint %s) than %s (%s), which it serves",
                        cfg.model_dir, trained_on, cfg.dataset_dir, self.graph.fingerprint)
        # Requests per node of the stored graph since start (the seed log, the placement
        # refresh): one count over every model served on the graph, whichever version or
        # model a request named, and kept when one is unloaded.
        self.seed_counts = base.seed_counts if base is not None else np.zeros(self.graph.num_nodes, dtype=np.int64)
        self.tables = (base.tables if base is not None and tuple(base.cfg.sampling.fanouts) == tuple(cfg.sampling.fanouts)
                       else WorkloadTables.load_or_build(self.graph, cfg.sampling.fanouts))
        self.embeddings = EmbeddingStore.for_graph(cfg.model_dir, self.graph, self.model)
        self.new_nodes = (NewNodeEvaluator(self.graph, self.model, self.embeddings)
                          if self.embeddings is not None else None)
        # Graph updates (off unless a token is configured): one DynamicGraph read by every
        # sampler and gather, and the embeddings kept fresh as it changes.
        self.dynamic = DynamicGraph(self.graph) if cfg.updates.enabled else None
        self.update_log: UpdateLog | None = None
        self.snapshots: Snapshots | None = None
        self.snapshot: Snapshot | None = None  # the one this process started from
        if self.dynamic is not None:
            self._open_update_log()
        # Whole-graph degrees a degree-normalised model (GCN) weights its samples by.
        self.node_degrees = (NodeDegrees(self.dynamic if self.dynamic is not None else self.graph)
                             if self.model.gcn_normalised else None)
        self._device_degrees: DeviceNodeDegrees | None = None
        self._split_stage: SplitDeviceStage | None = None  # the split lane's device stage, with its first worker
        self._split_stage_lock = threading.Lock()  # workers are made on their own threads
        self._closed = False
        self.incremental = None
        if self.dynamic is not None and self.embeddings is not None:
            snap = self.snapshot
            inc_cfg = IncrementalConfig(mode=cfg.updates.propagation)
            if snap is not None and snap.layers is None:  # a graph only (another model's snapshot)
                layers, output, aggregates = computed_layers(self.dynamic, self.model, inc_cfg), None, None
            elif snap is not None:
                layers, output, aggregates = snap.layers, snap.output, snap.aggregates
            else:
                layers, output, aggregates = self.embeddings.layers, self.embeddings.output, None
            self.incremental = IncrementalEmbeddings(self.dynamic, self.model, layers, inc_cfg, output=output,
                                                     aggregates=aggregates)
            log.info("graph updates on: embedding aggregates ready in %.1fs (layers: %s)",
                     self.incremental.init_s, ", ".join(self.incremental.kinds))
        self.plan = base.plan if base is not None else self._load_plan()
        if base is not None:
            self.features = base.features
        elif self.dynamic is not None:
            self.features = DynamicFeatureStore(self.dynamic)
        elif self.plan is not None:
            mem = cfg.gpu_memory
            self.features = TieredFeatureStore(self.graph.features, self.plan, device="cpu",
                                               server=mem.placement_server, plan_dir=mem.placement_plan,
                                               gpu_tiers=False)
        else:
            self.features = HostFeatureStore(self.graph.features)
        self._models = {"cpu": self.model}  # one copy of the weights per device
        self.device_graph: DeviceGraph | None = None
        self.gpu_features: SwappableFeatureStore | None = None
        self._host_table = None
        # Every Resources that reads the device graph (one, or a model repository's versions
        # sharing it): the last to close releases it, whatever order they close in.
        self._device_users: set[int] = {id(self)}
        if cfg.gpu_pipeline is not None and base is not None and base.device_graph is not None:
            self.device_graph, self.gpu_features, self._host_table = (base.device_graph, base.gpu_features,
                                                                      base._host_table)
            self._device_users = base._device_users
            self._device_users.add(id(self))
            self.model_on(cfg.gpu_pipeline.device)
        elif cfg.gpu_pipeline is not None:
            self._setup_gpu()

    def _open_update_log(self) -> None:
        """The update log, and the newest snapshot of it for this model: the dynamic graph
        (and below, the embeddings) start from there, and the follower replays the rest."""
        u = self.cfg.updates
        self.update_log = open_update_log(u.log, self.graph.root, self.graph.fingerprint)
        self.snapshots = Snapshots(u.snapshot_dir or self.graph.root / "snapshots",
                                   base_fingerprint=self.graph.fingerprint,
                                   model_fingerprint=model_fingerprint(self.cfg.model_dir),
                                   also_model=legacy_model_fingerprint(self.cfg.model_dir),
                                   log_id=self.update_log.log_id,
                                   every=u.snapshot_every if self.update_log.durable else 0, keep=u.snapshot_keep)
        snap = self.snapshots.latest(with_embeddings=self.embeddings is not None)
        if snap is not None and self.embeddings is not None and snap.layers is None:
            log.info("snapshot %s has no embeddings for this model: starting from the dataset", snap.path)
            snap = None
        start, first = (snap.position if snap is not None else 0), self.update_log.first()
        if first > start + 1:  # the entries after `start` were trimmed: this model's start cannot catch up
            graph_only = self.snapshots.latest_graph(at_least=first - 1)
            if graph_only is None:
                origin = f"snapshot {snap.path}" if snap is not None else "the dataset (no snapshot)"
                raise ConfigError(str(LogTrimmed(self.update_log.url, start, first,
                                                 replica=f"this replica's start, {origin},")))
            # Another model's snapshot has the graph (what the log did to it); this model's
            # embeddings are computed over it below.
            log.info("the update log %s holds entries from position %d on, after this model's newest snapshot: "
                     "starting from the graph of snapshot %s", self.update_log.url, first, graph_only.path)
            snap = graph_only
        if u.log_retain:  # a log that cannot be trimmed (Redis before 6.2) is refused now, not after each snapshot
            try:
                self.update_log.trim(0)  # trims nothing
            except ServiceUnavailable as exc:
                raise ConfigError(str(exc)) from exc
        if snap is None:
            return
        head = self.update_log.head()
        if snap.position > head:
            raise ConfigError(f"snapshot {snap.path} is at update log position {snap.position} but the log "
                              f"{self.update_log.url} ends at {head}: the log lost acknowledged updates (for Redis, run "
                              "it with appendonly yes and appendfsync always); move the snapshots away to start "
                              "from the log alone")
        t0 = time.perf_counter()
        self.dynamic.restore(snap.indptr, snap.indices, snap.features, snap.alive, snap.graph_version)
        if snap.added_ids is not None and self.graph.id_map is not None:
            self.graph.id_map.extend(np.asarray(snap.added_ids))
        self.snapshot = snap
        log.info("started from snapshot %s (log position %d, %d nodes) in %.1fs", snap.path, snap.position,
                 self.dynamic.num_nodes, time.perf_counter() - t0)

    def model_on(self, device: str) -> torch.nn.Module:
        if device not in self._models:
            self._models[device] = copy.deepcopy(self.model).to(device).eval()
        return self._models[device]

    def _setup_gpu(self) -> None:
        """The GPU pipeline's shared state: the topology as device-readable tensors (pinned
        host memory over UVA, or device memory), the FAP-ordered feature cache, the model."""
        pipe, mem = self.cfg.gpu_pipeline, self.cfg.gpu_memory
        device = torch.device(pipe.device)
        if device.type == "cuda" and not HAS_CUDA:
            raise ConfigError(f"the GPU pipeline is set to {pipe.device} but no CUDA device is visible; "
                              "use --device cpu (or --device auto)")
        if self.dynamic is not None:
            raise ConfigError("graph updates run on the CPU pipeline only; serve without the GPU pipeline")
        self.device_graph = DeviceGraph(self.graph, device, mem.graph_placement)
        self._host_table = (self.device_graph.host_visible(np.asarray(self.graph.features))
                            if device.type == "cuda" else None)
        self.gpu_features = SwappableFeatureStore(self._device_store())
        self.model_on(pipe.device)
        store = self.gpu_features.current
        if self.plan is not None:
            log.info("GPU pipeline on %s: topology %s, features by plan %s (%s)", device, mem.graph_placement,
                     mem.placement_plan, ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in store.bytes_by_store.items()))
        else:
            log.info("GPU pipeline on %s: topology %s, %d hottest feature rows cached (%.1f MiB)", device,
                     mem.graph_placement, store.cached_rows, store.cache_bytes / 2**20)

    def _load_plan(self):
        mem = self.cfg.gpu_memory
        if mem.placement_plan is None:
            return None
        if self.dynamic is not None:
            raise ConfigError("a placement plan and graph updates do not go together yet (updates add rows)")
        try:
            plan = Plan.load(mem.placement_plan)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"placement plan {mem.placement_plan}: {exc}") from exc
        if plan.num_nodes != self.graph.num_nodes:
            raise ConfigError(f"placement plan {mem.placement_plan} covers {plan.num_nodes} nodes; the dataset has "
                              f"{self.graph.num_nodes}")
        made_for = plan.made_for.get("dataset_fingerprint")
        if made_for is not None and made_for != self.graph.fingerprint:
            # its tiers follow another graph's access probabilities: the rows it calls hot are not
            raise ConfigError(f"placement plan {mem.placement_plan} was made for dataset {made_for}, not "
                              f"{self.graph.fingerprint} ({self.graph.root}): make it again with `hybridgnn place`")
        if mem.placement_server >= plan.topology.servers:
            raise ConfigError(f"placement server {mem.placement_server}: the plan has {plan.topology.servers} servers")
        return plan

    def _device_store(self):
        """The GPU pipeline's feature store: the plan's tiers, or the FAP-ordered cache."""
        if self.plan is None:
            return self.device_cache(hottest_first(self.tables.fap))
        mem, device = self.cfg.gpu_memory, torch.device(self.cfg.gpu_pipeline.device)
        if device.type == "cuda" and self.plan.topology.gpus_per_server < torch.cuda.device_count():
            log.warning("placement plan was made for %d GPUs per server; this machine has %d",
                        self.plan.topology.gpus_per_server, torch.cuda.device_count())
        return TieredFeatureStore(self.graph.features, self.plan, device=device, server=mem.placement_server,
                                  gpu=device.index or 0, plan_dir=mem.placement_plan,
                                  host_view=self.device_graph.host_visible if device.type == "cuda" else None)

    def hottest_for_seed_counts(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(FAP, node ids hottest first) under the seed distribution these per-node request
        counts give: CPU work only (seconds on a large graph)."""
        from hybridgnn.workload.tables import compute_fap

        fap = compute_fap(self.graph, self.cfg.sampling.fanouts, counts / counts.sum())
        return fap, hottest_first(fap)

    def device_cache(self, order: np.ndarray) -> CachedFeatureStore:
        """A device feature cache of the rows in `order` (hottest first), as many as fit."""
        return CachedFeatureStore(self.graph.features, self.cfg.gpu_pipeline.device, self.cfg.gpu_memory.cache_bytes,
                                  order=order, host_table=self._host_table)

    def warm_up(self) -> None:
        """Compile the samplers (plain and with a query-edge overlay) and touch the model once,
        so the first request of either kind is not slow."""
        seeds = np.arange(min(4, self.graph.num_nodes), dtype=np.int64)
        executor = self.make_executor("cpu", 0, in_process=True)
        try:
            executor.run(seeds)
        finally:
            if hasattr(executor, "close"):
                executor.close()
        if self.gpu_features is not None:
            self.make_executor("gpu", 0).run(seeds)
        n = self.graph.num_nodes
        base = CPUSampler(self.graph, self.cfg.sampling.fanouts)  # new-node requests sample the stored graph
        base.sample(np.array([n]), overlay=(np.array([n]), np.array([0, 1]), np.array([0])), num_extra_nodes=1)

    def make_executor(self, pipeline: str, worker: int, *, in_process: bool = False):
        """A fresh executor of the named pipeline, as its workers get: the engine's workers,
        worker processes and the profiler all build theirs here. in_process: a CPU
        executor in this process even where workers run in processes of their own."""
        if pipeline == "gpu":
            # device and pinned allocations: never while another thread's capture records
            # (a model repository builds one model's executors while another serves)
            with DEVICE_GATE.work():
                return self._make_gpu_executor(worker)
        if self.cfg.cpu_pipeline.processes and not in_process:
            return ProcessExecutor(self.cfg, worker, build_worker_executor)
        if self.cfg.cpu_pipeline.split or torch.device(self.cfg.cpu_pipeline.device).type == "cuda":
            with DEVICE_GATE.work():
                return self._make_cpu_executor(worker)
        return self._make_cpu_executor(worker)

    def _make_cpu_executor(self, worker: int) -> BatchExecutor | SplitExecutor:
        graph = self.dynamic if self.dynamic is not None else self.graph
        sampler = CPUSampler(graph, self.cfg.sampling.fanouts, seed=self.cfg.sampling.seed + worker)
        if self.cfg.cpu_pipeline.split:  # Quiver's CPU lane: the GPU pipeline's device does the rest
            device = self.cfg.gpu_pipeline.device
            return SplitExecutor(sampler, self.gpu_features, self.model_on(device), device,
                                 stage=self._split_device_stage(device))
        lock = self.dynamic.lock.read if self.dynamic is not None else contextlib.nullcontext
        device = self.cfg.cpu_pipeline.device
        return BatchExecutor(sampler, self.features, self.model_on(device), device=device, read_lock=lock,
                             degrees=self.node_degrees,
                             alive=(lambda: self.dynamic.alive) if self.dynamic is not None else None)

    def _split_device_stage(self, device) -> SplitDeviceStage:
        """The split lane's one device stage, made with its first worker (every worker's
        samples go through it; closed with these resources)."""
        with self._split_stage_lock:
            if self._closed:
                raise RuntimeError("these resources are closed: no new split-lane worker")
            if self._split_stage is None:
                self._split_stage = SplitDeviceStage(self.gpu_features, self.model_on(device), device,
                                                     self.cfg.sampling.fanouts, self._gpu_degrees(device),
                                                     threads=split_device_threads())
            return self._split_stage

    def _make_gpu_executor(self, worker: int) -> DeviceExecutor:
        sampler = TorchSampler(self.device_graph.indptr, self.device_graph.indices, self.cfg.sampling.fanouts,
                               seed=self.cfg.sampling.seed + 1000 + worker)
        degrees = self._gpu_degrees(sampler.device)
        return DeviceExecutor(sampler, self.gpu_features, self.model_on(self.cfg.gpu_pipeline.device), degrees)

    def _gpu_degrees(self, device) -> DeviceNodeDegrees | None:
        """Whole-graph degrees on the GPU pipeline's device, for GCN (one copy for every
        worker of either lane)."""
        if self.node_degrees is not None and self._device_degrees is None:
            has_loop = self.node_degrees.lookup(np.arange(self.graph.num_nodes))[1]
            self._device_degrees = DeviceNodeDegrees(self.device_graph.indptr, has_loop, torch.device(device))
        return self._device_degrees

    def close(self) -> None:
        """Release what is not garbage-collected, or not soon: the pinned host registrations,
        the log, the embedding store's memory maps (a stopped engine lives on in its
        reference cycles until a full collection)."""
        with self._split_stage_lock:
            self._closed = True
            stage, self._split_stage = self._split_stage, None
        if stage is not None:
            stage.close()
        if self.update_log is not None:
            self.update_log.close()
            self.update_log = None
        if self.new_nodes is not None:
            self.new_nodes.close()
        if self.embeddings is not None:
            self.embeddings.close()
        self._device_users.discard(id(self))
        if self.device_graph is not None and not self._device_users:
            self.device_graph.close()
        self.device_graph = None
