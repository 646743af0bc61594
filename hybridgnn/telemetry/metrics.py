"""Metric definitions (prefix hybridgnn_, base units, histograms so replicas aggregate).

`Telemetry` implements `ServingStats` (types.py): the engine, its API and update applier
report events as plain calls, and this module alone turns them into Prometheus series.
Gauges that mirror state (pending, ready, queue depths, the policy's threshold, the graph
version) read it from the engine by callback at scrape time (`watch`).

The registry is injected so tests and several servers in one process never collide.
Labels are small fixed sets (stage, pipeline, model, code, reason), never node ids.
"""

from __future__ import annotations

import copy

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridgnn.capabilities import own_usage
from hybridgnn.telemetry.histogram import LoopCounter, LoopHistogram
from hybridgnn.types import ServingStats, StageTimings, UpdateStats

STAGES = ("queue_wait", "batching", "sample", "gather", "compute", "handoff", "respond", "total")
# 5 µs .. 10 s: fine steps where serving latencies live (sub-ms to tens of ms), and
# around the default 100 ms admission bound, where admitted latency sits under overload.
# The steps under 50 µs are for the quick stages: encoding an answer (respond) takes 20-40 µs,
# and batching and queue_wait are often that short (the demo at 150 requests/s: half and a
# quarter of them); with 50 µs as the lowest bound, nine in ten respond observations fell
# in one bucket and its p50 read nothing.
LATENCY_BUCKETS = (
    0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
    0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
ROUTING_REASONS = ("threshold", "only", "spill", "fallback")
PIPELINES = ("cpu", "gpu")
FEATURE_TIERS = ("gpu", "peer_gpu", "host", "disk", "remote")
# Codes the dashboards and alert rules select on; created at zero so ratios exist before the first error.
PREDECLARED_CODES = ("200", "400", "404", "409", "413", "429", "500", "503")
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PSGS_BUCKETS = tuple(float(10**e * m) for e in range(0, 8) for m in (1, 3))


class Telemetry(ServingStats):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None, model: str = "hybridgnn"):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        self.version = "1"  # the label set of a single-model server; for_model() gives others
        r = self.registry
        # the process that renders /metrics holds the graph, the models and every queue: its
        # own CPU and memory, read at each scrape, as the front ends' are
        r.register(_EngineCollector())
        # observed three or four times per request on the event loop: the lighter histogram
        self.stage_seconds = LoopHistogram(
            "hybridgnn_stage_seconds", "Time spent per serving stage", ["stage", "pipeline", "model", "version"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.requests = LoopCounter(
            "hybridgnn_requests", "Inference requests answered, by HTTP status code", ["model", "version", "code"],
            registry=r)
        self.seeds = LoopCounter("hybridgnn_seeds", "Seed nodes answered", ["model", "version"], registry=r)
        self.batch_size = LoopHistogram(
            "hybridgnn_batch_size_seeds", "Seeds per executed batch", ["pipeline"], buckets=SIZE_BUCKETS, registry=r)
        self.batch_requests = LoopHistogram(
            "hybridgnn_batch_requests", "Requests per executed batch", ["pipeline"], buckets=SIZE_BUCKETS, registry=r)
        self.batch_psgs = LoopHistogram(
            "hybridgnn_batch_psgs", "Batch PSGS (sum of the seeds' expected sampled subgraph sizes)",
            ["pipeline"], buckets=PSGS_BUCKETS, registry=r)
        self.sampled_edges = LoopCounter(
            "hybridgnn_sampled_edges", "Edges sampled", ["pipeline"], registry=r)
        self.queue_depth = Gauge(
            "hybridgnn_queue_depth_batches", "Batches queued or running in a pipeline", ["pipeline"], registry=r)
        self.pending = Gauge(
            "hybridgnn_pending_requests", "Requests admitted and not yet answered", registry=r)
        self.routing = LoopCounter(
            "hybridgnn_routing_decisions", "Batches routed, by pipeline and reason", ["pipeline", "reason"],
            registry=r)
        self.batch_errors = LoopCounter(
            "hybridgnn_batch_errors", "Batches that failed in a pipeline", ["pipeline"], registry=r)
        self.rejected = LoopCounter(
            "hybridgnn_rejected_requests", "Requests refused before admission", ["reason"], registry=r)
        self.psgs_threshold = Gauge(
            "hybridgnn_psgs_threshold", "PSGS threshold in force (+Inf: all batches on CPU)", registry=r)
        self.max_batch_psgs = Gauge(
            "hybridgnn_max_batch_psgs", "Largest summed PSGS the batcher puts in one batch (+Inf: unbounded)",
            registry=r)
        self.policy = Gauge(
            "hybridgnn_policy_info", "1 for the routing policy in force (none: no profile)", ["policy"], registry=r)
        self.policy_changes = Counter(
            "hybridgnn_policy_changes", "Threshold or batch-PSGS changes made by --adapt", registry=r)
        self.placement_refreshes = Counter(
            "hybridgnn_placement_refreshes", "GPU feature caches rebuilt from live seed counts (SIGHUP)", registry=r)
        self.gathered_rows = LoopCounter(
            "hybridgnn_gathered_rows", "Feature rows gathered, by the tier that served them (gpu: device cache)",
            ["pipeline", "tier"], registry=r)
        self.ready = Gauge(
            "hybridgnn_ready", "1 while the replica accepts requests, 0 while starting or draining", registry=r)
        self.pending_capacity = Gauge(
            "hybridgnn_pending_capacity_requests", "Requests in flight allowed before new ones get 429", registry=r)

        # Graph updates and embedding freshness.
        self.graph_updates = Counter(
            "hybridgnn_graph_updates", "Graph updates applied, by kind", ["kind"], registry=r)
        self.update_batches = Counter(
            "hybridgnn_graph_update_batches", "Update batches, by outcome (applied, rejected)", ["outcome"],
            registry=r)
        self.update_affected_nodes = Histogram(
            "hybridgnn_graph_update_affected_nodes", "Embedding rows recomputed per update batch (all layers)",
            buckets=SIZE_BUCKETS + (65536, 262144, 1048576), registry=r)
        self.update_propagation_seconds = Histogram(
            "hybridgnn_graph_update_propagation_seconds", "Time to bring every layer's embeddings up to date",
            buckets=LATENCY_BUCKETS, registry=r)
        self.update_batch_seconds = Histogram(
            "hybridgnn_graph_update_batch_seconds", "Time to apply one update batch (graph and embeddings)",
            buckets=LATENCY_BUCKETS, registry=r)
        self.update_staleness = Gauge(
            "hybridgnn_embedding_staleness_seconds",
            "Age of the oldest accepted update not yet reflected in served embeddings (0: fresh)", registry=r)
        self.graph_version = Gauge("hybridgnn_graph_version",
                                   "Graph version served: the update log position applied on this replica", registry=r)
        self.update_log_position = Gauge(
            "hybridgnn_update_log_position", "Update log position applied on this replica (0: none)", registry=r)
        self.update_log_head = Gauge(
            "hybridgnn_update_log_head", "Highest update log position this replica has read", registry=r)
        self.update_log_lag = Gauge(
            "hybridgnn_update_log_lag_seconds",
            "Age of the oldest log entry read but not yet applied on this replica (0: caught up)", registry=r)
        self.update_follower_failing = Gauge(
            "hybridgnn_update_follower_failing", "1 while this replica cannot read or apply the update log",
            registry=r)
        self.graph_patched_entries = Gauge(
            "hybridgnn_graph_patched_entries", "Adjacency entries in update patches, not yet compacted", registry=r)
        self.compactions = Counter("hybridgnn_graph_compactions", "Patch compactions into the base CSR",
                                   registry=r)

        # labels() hashes and locks on every call; the request path reuses the children.
        self._children: dict[tuple, object] = {}
        self._engines: list = []  # snapshot sources, read at scrape time
        self._readiness: list = []  # the service's ready(), once it says (ready_from): shared by views

    def declare(self, pipelines: tuple[str, ...]) -> None:
        """Create the label sets dashboards and rules select on at zero, so every panel and
        rule has a series from the first scrape rather than after the first such event."""
        c = self._child
        for code in PREDECLARED_CODES:
            c(self.requests, self.model, self.version, code)
        c(self.seeds, self.model, self.version)
        for reason in ("overload", "draining", "behind"):
            c(self.rejected, reason)
        for name in PIPELINES:
            for reason in ROUTING_REASONS:
                c(self.routing, name, reason)
            c(self.batch_errors, name)
            for tier in FEATURE_TIERS:
                c(self.gathered_rows, name, tier)
        for outcome in ("applied", "rejected"):
            c(self.update_batches, outcome)
        for name in pipelines:
            c(self.queue_depth, name)
            c(self.sampled_edges, name)
            for stage in STAGES:
                c(self.stage_seconds, stage, name, self.model, self.version)
            for h in (self.batch_size, self.batch_requests, self.batch_psgs):
                c(h, name)

    def _child(self, metric, *labels):
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def unwatch(self, source) -> None:
        """Forget an engine (a model version unloaded): its gauges stop counting, and its
        memory is not held here."""
        if source in self._engines:
            self._engines.remove(source)

    def ready_from(self, ready) -> None:
        """Report readiness as ready() says: the server's own /v2/health/ready. Every watched
        engine's is not it in a model repository, where a version loading in the background
        or a retired one draining is not ready while the server serves on."""
        self._readiness[:] = [ready]
        self.ready.set_function(lambda: 1.0 if ready() else 0.0)

    def forget_model(self, name: str, version: str) -> None:
        """Drop the series labelled with this model version (unloaded from a repository):
        a server that polls new versions for months exposed every one it ever served."""
        for metric in (self.stage_seconds, self.requests, self.seeds):
            for labels in metric.remove_matching(model=name, version=version):
                self._children.pop((id(metric), labels), None)  # a version loaded again gets new series

    def for_model(self, name: str, version: str) -> Telemetry:
        """The same series, with this model and version in their model/version labels (one
        view per engine of a model repository; the registry and engines are shared)."""
        view = copy.copy(self)
        view.model, view.version = name, version
        return view

    def watch(self, source, pipelines: tuple[str, ...]) -> None:
        """Mirror engines' snapshots (source() -> types.EngineSnapshot), read at scrape time,
        and create the label sets they will use. Several engines (a model repository) share
        one Telemetry: the gauges add up their queues and pending requests, ready means
        every one is ready, and routing and update state are the first engine's."""
        self.declare(tuple(pipelines))
        sources = self._engines
        sources.append(source)

        def first():
            return sources[0]()

        self.pending.set_function(lambda: sum(s().pending for s in sources))
        if not self._readiness:
            self.ready.set_function(lambda: 1.0 if all(s().ready for s in sources) else 0.0)
        self.pending_capacity.set_function(lambda: sum(s().pending_capacity for s in sources))
        self.psgs_threshold.set_function(lambda: first().psgs_threshold)
        self.max_batch_psgs.set_function(lambda: first().max_batch_psgs)
        for name in pipelines:
            self._child(self.queue_depth, name).set_function(
                lambda n=name: sum(s().queue_depths.get(n, 0) for s in sources))
        self.update_staleness.set_function(lambda: first().update_staleness_s)
        self.graph_version.set_function(lambda: first().graph_version)
        self.update_log_position.set_function(lambda: first().graph_version)
        self.update_log_head.set_function(lambda: first().update_log_head)
        self.update_log_lag.set_function(lambda: first().update_log_lag_s)
        self.update_follower_failing.set_function(lambda: 1.0 if first().update_follower_failing else 0.0)
        self.graph_patched_entries.set_function(lambda: first().graph_patched_entries)
        self.policy_in_force(source().policy, changed=False)

    def batch_done(self, pipeline: str, t: StageTimings, num_seeds: int, num_requests: int,
                   psgs: float, sampled_edges: int, gathered_rows: dict[str, int] | None = None) -> None:
        h, c = self.stage_seconds.labels, self._child
        m, v = self.model, self.version
        h("queue_wait", pipeline, m, v).observe(t.queue_wait_s)
        h("sample", pipeline, m, v).observe(t.sample_s)
        h("gather", pipeline, m, v).observe(t.gather_s)
        h("compute", pipeline, m, v).observe(t.compute_s)
        c(self.batch_size, pipeline).observe(num_seeds)
        c(self.batch_requests, pipeline).observe(num_requests)
        c(self.batch_psgs, pipeline).observe(psgs)
        c(self.sampled_edges, pipeline).inc(sampled_edges)
        for tier, rows in (gathered_rows or {}).items():
            c(self.gathered_rows, pipeline, tier).inc(rows)

    def stage(self, stage: str, pipeline: str, seconds: float) -> None:
        # _child, not labels(): a few times per request, and labels() takes a lock each time
        self._child(self.stage_seconds, stage, pipeline, self.model, self.version).observe(seconds)

    def routed(self, pipeline: str, reason: str) -> None:
        self._child(self.routing, pipeline, reason).inc()

    def batch_failed(self, pipeline: str) -> None:
        self._child(self.batch_errors, pipeline).inc()

    def refused(self, reason: str, count: int = 1) -> None:
        self._child(self.rejected, reason).inc(count)

    def answered(self, status: int, seeds: int = 0) -> None:
        self._child(self.requests, self.model, self.version, str(status)).inc()
        if seeds:
            self._child(self.seeds, self.model, self.version).inc(seeds)

    def answered_elsewhere(self, pipeline: str, seconds, respond_s, seeds: int) -> None:
        m, v = self.model, self.version
        self._child(self.stage_seconds, "respond", pipeline, m, v).observe_many(respond_s)
        self._child(self.stage_seconds, "total", pipeline, m, v).observe_many(seconds)
        self._child(self.requests, m, v, "200").inc(len(seconds))
        if seeds:
            self._child(self.seeds, m, v).inc(seeds)

    def policy_in_force(self, name: str, changed: bool) -> None:
        self.policy.clear()
        self.policy.labels(name).set(1)
        if changed:
            self.policy_changes.inc()

    def placement_refreshed(self) -> None:
        self.placement_refreshes.inc()

    def updates_applied(self, stats: UpdateStats) -> None:
        if stats.propagate_s is not None:
            self.update_propagation_seconds.observe(stats.propagate_s)
        self.update_batch_seconds.observe(stats.seconds)
        self.update_affected_nodes.observe(stats.affected_nodes)
        for kind, count in stats.counts.items():
            if count:
                self._child(self.graph_updates, kind).inc(count)
        self._child(self.update_batches, "applied").inc()

    def updates_rejected(self) -> None:
        self._child(self.update_batches, "rejected").inc()

    def compacted(self) -> None:
        self.compactions.inc()

    def frontends(self, source) -> None:
        self.registry.register(_FrontendCollector(source))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), self.content_type


class _EngineCollector:
    """The engine process's CPU time and resident memory, read when scraped."""

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        cpu_s, rss = own_usage()
        g = GaugeMetricFamily("hybridgnn_engine_resident_memory_bytes",
                              "Resident memory of the engine process (the pages of the graph it has read included)")
        g.add_metric([], float(rss))
        yield g
        c = CounterMetricFamily("hybridgnn_engine_cpu_seconds", "CPU time (user + system) of the engine process")
        c.add_metric([], cpu_s)
        yield c


class _FrontendCollector:
    """Front-end processes' series, from their last reports (serving/frontends.py)."""

    _GAUGES = (("connections", "hybridgnn_frontend_connections", "Open client connections"),
               ("rss_bytes", "hybridgnn_frontend_resident_memory_bytes", "Resident memory"),
               ("up", "hybridgnn_frontend_up", "1 while the front end is linked to the engine"))
    _COUNTERS = (("requests", "hybridgnn_frontend_requests", "Requests sent on to the engine"),
                 ("cpu_s", "hybridgnn_frontend_cpu_seconds", "CPU time (user + system) of the process"),
                 ("refused_connections", "hybridgnn_frontend_refused_connections",
                  "Connections refused past the connection cap"),
                 ("restarts", "hybridgnn_frontend_restarts", "Times the front end was started again"))

    def __init__(self, source):
        self.source = source

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        reports = self.source()
        for key, name, doc in self._GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["frontend"])
            for index, r in sorted(reports.items()):
                g.add_metric([str(index)], float(r.get(key, 0)))
            yield g
        for key, name, doc in self._COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["frontend"])
            for index, r in sorted(reports.items()):
                c.add_metric([str(index)], float(r.get(key, 0)))
            yield c
