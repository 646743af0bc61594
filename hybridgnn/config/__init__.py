"""Frozen configuration dataclasses, one per component.

Each checks its values in __post_init__ and quotes the bad value in the error, so a
wrong flag fails at start-up with a message rather than deep inside a worker.
Units are in the names (_s seconds, _us microseconds, _bytes bytes).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import field
from pathlib import Path

from hybridgnn.config.graph_state import NewNodeConfig, PartitionConfig, UpdateConfig  # noqa: F401
from hybridgnn.config.settings import (  # noqa: F401 (callers import these from hybridgnn.config)
    ENV_PREFIX,
    MAX_CORE,
    SMALL_JSON_BYTES,
    config_class,
    default_cache_dir,
    env_default,
    env_flag,
    parse_bytes,
    parse_cpus,
    parse_frontends,
    read_json,
    setting,
)


def parse_fanouts(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """'15,10,5' -> (15, 10, 5); hop 1 (neighbours of the seeds) comes first."""
    if isinstance(text, (tuple, list)):
        # whole numbers only: int() would read 2.9 as 2 and true as 1
        if any(type(v) is bool or not hasattr(v, "__index__") for v in text):
            raise ValueError(f"fanouts must be whole numbers, got {list(text)!r}")
        values = tuple(operator.index(v) for v in text)
    else:
        try:
            values = tuple(int(v) for v in str(text).replace(" ", "").split(",") if v)
        except ValueError as exc:
            raise ValueError(f"fanouts must be comma-separated positive integers, got {text!r}") from exc
    SamplingConfig(fanouts=values)  # validates
    return values


# A model saved without fanouts is served with this many neighbours per hop, one hop per layer.
DEFAULT_FANOUT = 10


def fanouts_for(saved: dict, *, flag=None, repository=None) -> tuple[int, ...]:
    """The fanouts a model is served and profiled with, by one precedence: the --fanouts
    flag, then its repository's <model>/config.json, then those it was saved with (its
    config.json), then DEFAULT_FANOUT per layer. saved: the model's saved config."""
    for given in (flag, repository, saved.get("fanouts")):
        if given:
            return parse_fanouts(given)
    return (DEFAULT_FANOUT,) * int(saved["num_layers"])


def fanouts_served(fanouts, num_layers: int, *, doing: str = "sampling", logger: str = "hybridgnn.serve"
                   ) -> tuple[int, ...]:
    """`fanouts` cut to one per layer, with a warning when that drops hops: a hop past the
    last layer cannot change an answer, so sampling it is work for nothing (and the
    workload tables would cost batches by hops never used). Fewer than the layers are the
    caller's to refuse (fewer_hops). doing: what the warning says is done with the first
    ones ("sampling" by a server, "writing" by save_model), on `logger`."""
    fanouts = tuple(int(f) for f in fanouts)
    if len(fanouts) > num_layers:
        logging.getLogger(logger).warning(
            "fanouts %s give %d hops but the model has %d %s; %s the first %d", list(fanouts), len(fanouts),
            num_layers, "layer" if num_layers == 1 else "layers", doing, num_layers)
    return fanouts[:num_layers]


def fewer_hops(fanouts, num_layers: int) -> str | None:
    """The one-line refusal of fanouts with fewer hops than the model's layers (a layer
    without its hop would see no neighbours), or None when there are enough."""
    fanouts = [int(f) for f in fanouts]
    if len(fanouts) >= num_layers:
        return None
    return (f"fanouts {fanouts} give {len(fanouts)} {'hop' if len(fanouts) == 1 else 'hops'} but the model has "
            f"{num_layers} layers; give one fanout per layer")


@config_class
class SamplingConfig:
    """K-hop uniform sampling without replacement; fanouts[0] applies to the seeds' neighbours.
    fanouts None: the model's (fanouts_for), resolved when the model is loaded."""

    fanouts: tuple[int, ...] | None = None
    seed: int = setting(0, "sampling seed")

    def __post_init__(self):
        if self.fanouts is None:
            return
        if len(self.fanouts) == 0:
            raise ValueError("fanouts must name at least one hop, got ()")
        for f in self.fanouts:
            # below 2**63: the samplers take them as int64 (a larger one was an OverflowError)
            if not isinstance(f, int) or not 0 < f < 1 << 63:
                raise ValueError(f"every fanout must be a positive integer (below 2**63), got {self.fanouts!r}")


@config_class
class BatcherConfig:
    """Micro-batching: a batch closes at max_batch_seeds seeds, max_batch_requests requests,
    or max_wait_s after its first request, whichever comes first; and at once while no
    batch is under way (a quiet server), unless wait_when_idle."""

    max_batch_seeds: int = setting(1024, "a batch closes at this many seeds")
    max_batch_requests: int = setting(256, "a batch closes at this many requests")
    max_wait_s: float = setting(0.002, "longest a request waits for its batch to fill while a batch is under way "
                                "(one that finds the server quiet goes at once, unless --wait-when-idle)",
                                flag="--max-wait-ms", scale=1000.0)
    # Requests admitted but not yet answered; beyond this new requests get 429.
    max_pending_requests: int = setting(2048, "hard cap on requests in flight (memory); the queue-delay bound "
                                        "usually refuses first", flag="--max-pending")
    # A batch also closes before its summed PSGS would pass this (Quiver's PSGS-bounded
    # batching; a profile's slo:<ms> policy sets it). A request is never split.
    max_batch_psgs: float = math.inf
    # False: a request that finds no batch under way (a quiet server) is dispatched at
    # once, and max_wait_s holds batches once any is; True: a batch always waits
    # max_wait_s to fill (bigger batches at light load, for up to max_wait_s more
    # latency). Under load the two are the same: batches are always under way.
    # (--wait-when-idle)
    wait_when_idle: bool = False

    def __post_init__(self):
        if self.max_batch_seeds < 1:
            raise ValueError(f"max_batch_seeds must be >= 1, got {self.max_batch_seeds}")
        if self.max_batch_requests < 1:
            raise ValueError(f"max_batch_requests must be >= 1, got {self.max_batch_requests}")
        if not (0.0 <= self.max_wait_s <= 10.0):
            raise ValueError(f"max_wait_s must be within [0, 10] seconds, got {self.max_wait_s}")
        if self.max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {self.max_pending_requests}")
        if not self.max_batch_psgs > 0:
            raise ValueError(f"max_batch_psgs must be > 0, got {self.max_batch_psgs}")


@config_class
class AdmissionConfig:
    """Requests are admitted while the queueing delay they would see (queued work over each
    lane's measured service rate) stays within max_queue_delay_s; past it, 429 + Retry-After.
    None: the SLO's room (slo:<ms> policy: the SLO less the batching wait and a full
    batch's p99 service time) or DEFAULT_QUEUE_DELAY_S."""

    max_queue_delay_s: float | None = setting(
        None, "admit a request only while the queueing delay it would see (queued work over the measured "
        "service rate) stays within this; else 429 + Retry-After (default: the room an slo:<ms> policy leaves, "
        "else 100)", flag="--max-queue-delay-ms", scale=1000.0)

    def __post_init__(self):
        if self.max_queue_delay_s is not None and not 0 < self.max_queue_delay_s <= 60:
            raise ValueError(f"max_queue_delay_s must be within (0, 60] seconds, got {self.max_queue_delay_s}")


DEFAULT_QUEUE_DELAY_S = 0.1


MAX_WORKERS = 1024  # workers (and torch threads) a pipeline may have; profiles allow as many

MIN_REPOSITORY_POLL_S = 0.01  # seconds between repository scans, at the least
# Seeds per request an SLO choice may assume: what a 16 MiB body holds as int64 ids. Past
# it (--request-seeds inf, 1e12) the simulator's draws were an OverflowError or MemoryError.
MAX_REQUEST_SEEDS = 1 << 21


@config_class
class PipelineConfig:
    """One sample→gather→compute pipeline: `workers` threads share one queue."""

    name: str = "cpu"
    device: str = "cpu"
    workers: int = 2
    # torch intra-op threads per worker; workers × threads should not exceed the cores.
    torch_threads: int = 1
    # each worker's batches run in a process of its own (pipelines/process.py): no GIL
    # shared with the event loop; CPU pipeline, static graph only
    processes: bool = False
    # cores the worker processes run on (empty: wherever the server runs); the server's own
    # threads then keep to the other cores, so the front end's work (refusals under
    # overload included) never takes CPU from the batches
    cpus: tuple[int, ...] = ()
    # Quiver's CPU lane (CPU pipeline only): its workers only sample, and the GPU pipeline's
    # device gathers and runs the model for both lanes (pipelines/split.py)
    split: bool = False

    def __post_init__(self):
        # at most MAX_WORKERS: each may be a process of its own, and a profile naming more is
        # refused when served (profile --workers 5000 ran, then wrote a profile serve refuses)
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be within [1, {MAX_WORKERS}], got {self.workers}")
        if not 1 <= self.torch_threads <= MAX_WORKERS:
            raise ValueError(f"torch_threads must be within [1, {MAX_WORKERS}], got {self.torch_threads}")
        if any(not isinstance(c, int) or c < 0 for c in self.cpus) or len(set(self.cpus)) != len(self.cpus):
            raise ValueError(f"worker cores must be distinct core numbers >= 0, got {self.cpus!r}")
        if self.cpus and not self.processes:
            raise ValueError("worker cores pin worker processes: they need --worker-processes on")


GRAPH_PLACEMENTS = ("uva", "gpu")


@config_class
class DeviceMemoryConfig:
    """What the GPU pipeline keeps where: the hottest feature rows by FAP fill cache_bytes
    of device memory; the topology is read zero-copy from pinned host memory (uva) or
    copied to the device (gpu)."""

    cache_bytes: int = setting(1 << 30, "device memory for the hottest feature rows by FAP (e.g. 512M, 4G)",
                               flag="--gpu-cache-bytes", parse=lambda v: parse_bytes(v))
    graph_placement: str = setting("uva", "GPU sampler reads the topology from pinned host memory over UVA, or "
                                   "from a copy in device memory", choices=GRAPH_PLACEMENTS)
    # A plan from `hybridgnn place`: both pipelines then read features through its tiers
    # (this replica is server `placement_server` of the plan), instead of the FAP cache.
    placement_plan: Path | None = setting(None, "a plan directory from `hybridgnn place`: both pipelines read "
                                          "features through its tiers (GPU, peer GPU, pinned host, disk) "
                                          "instead of the FAP-ordered cache", flag="--placement")
    placement_server: int = setting(0, "which server of the --placement plan this replica is")

    def __post_init__(self):
        if self.placement_server < 0:
            raise ValueError(f"placement_server must be >= 0, got {self.placement_server}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if self.graph_placement not in GRAPH_PLACEMENTS:
            raise ValueError(f"graph_placement must be one of {GRAPH_PLACEMENTS}, got {self.graph_placement!r}")


@config_class
class RouterConfig:
    """Batches with PSGS below the threshold go to the CPU pipeline, the rest to the GPU one.
    Without a GPU pipeline the threshold is +inf."""

    # None: +inf on a CPU-only server; on a hybrid one, the PSGS of default_gpu_batch_seeds
    # average seeds (a stand-in until `hybridgnn profile` measures the crossover). inf: CPU
    # unless spilled; 0: GPU.
    psgs_threshold: float | None = setting(
        None, "batches with PSGS below go to the CPU pipeline, the rest to the GPU one (default with two "
        "pipelines: the PSGS of 64 average seeds; inf: CPU unless spilled)")
    default_gpu_batch_seeds: int = 64
    # A queue holding at least this many batches per worker counts as saturated.
    saturation_batches_per_worker: float = 2.0
    # False: every batch stays on the pipeline the threshold picks (single-device
    # baselines on a two-pipeline server: --psgs-threshold 0 --no-spill is GPU only).
    spill: bool = True

    def __post_init__(self):
        if self.psgs_threshold is not None and not (self.psgs_threshold >= 0):
            raise ValueError(f"psgs_threshold must be >= 0, got {self.psgs_threshold}")
        if self.saturation_batches_per_worker <= 0:
            raise ValueError(
                f"saturation_batches_per_worker must be > 0, got {self.saturation_batches_per_worker}"
            )


@config_class
class ServerConfig:
    # The outputs a request that names none gets (None: all); a repository model's
    # config.json sets it ("outputs": ["logits"]).
    default_outputs: tuple[str, ...] | None = None
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    grpc_port: int | None = setting(None, "also serve KServe v2 over gRPC on this port (off unless given; 8001 "
                                    "is the usual one)")
    repository_poll_s: float = setting(0.0, "with --model-repository: look for new, changed or removed versions "
                                       "this often and load them in the background (0: only on POST "
                                       "/v2/repository/models/{m}/load)")
    model_name: str = setting("hybridgnn", "name in /v2/models/{name}")
    max_request_nodes: int = setting(8192, "most node ids one request may name (400 beyond; 413 for a heterogeneous "
                                     "model)")
    max_body_bytes: int = 16 * 1024 * 1024
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long admitted requests may take to finish")
    shutdown_grace_s: float = setting(0.5, "after draining, keep answering 503 this long before closing the "
                                      "listener")
    # After a stop signal, report not-ready but keep serving this long, so balancers that
    # poll readiness stop routing here before requests are refused (0: refuse at once).
    unready_delay_s: float = setting(0.0, "on SIGTERM, report not-ready but keep serving this long before "
                                     "draining (longer than the balancer's health-check interval)")
    # Per-node request counts written here every seed_log_interval_s and at stop, for
    # `hybridgnn place --from-log` and `workload build --seeds`: a .counts.npy, or for a
    # heterogeneous dataset a .counts.npz of one counts array per node type.
    seed_log: Path | None = setting(None, "write per-node request counts here (a .counts.npy; a .counts.npz of "
                                    "one array per node type for a heterogeneous dataset), every "
                                    "--seed-log-interval-s and at stop, for `hybridgnn place --from-log` and "
                                    "`workload build --seeds`")
    seed_log_interval_s: float = setting(60.0, "with --seed-log: write the counts this often, in seconds (they are "
                                         "also written at stop)")
    # Keep-alive connections idle this long between requests are closed.
    idle_timeout_s: float = setting(75.0, "close keep-alive connections idle this long between requests")
    # A request must arrive whole within this long of its first byte (else 408 and close).
    request_timeout_s: float = setting(30.0, "a request must arrive whole within this long of its first byte "
                                       "(else 408)")
    # Open connections beyond this get 503 + Retry-After and are closed (lowered at start to
    # what the process's descriptor limit leaves room for).
    max_connections: int = setting(10_000, "open connections beyond this get 503 + Retry-After (capped by the "
                                   "descriptor limit)")
    # Front-end processes around the one engine (None: auto, serving.frontends.frontends_for): with more than
    # one, each serves HTTP on the port and the engine's process serves none itself.
    frontends: int | None = setting(None, "front-end processes serving HTTP around the one engine: a number, or "
                                    "auto (the default: one per 4 cores, at most 8; 1 below 8 cores: HTTP in the "
                                    "engine's own process)", parse=parse_frontends)
    # The event loop answers at most this many requests per turn; the rest wait, in
    # arrival order, for later turns, so completions and timers are never starved by a
    # flood of new requests (see serving/http/turns.py).
    answers_per_turn: int = setting(64, "requests the event loop answers per turn of the loop; more wait for the "
                                    "next turn, so answers to admitted requests are not starved by new ones")
    # One line per answered request (HTTP and gRPC) on the logger hybridgnn.access (--access-log).
    access_log: bool = False

    def __post_init__(self):
        if self.frontends is not None and self.frontends < 1:
            raise ValueError(f"frontends must be >= 1 (or auto), got {self.frontends}")
        if self.answers_per_turn < 1:
            raise ValueError(f"answers_per_turn must be >= 1, got {self.answers_per_turn}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be within [0, 65535], got {self.port}")
        # 99999 served gRPC on 34463 (the port modulo 65536) without a word; the HTTP port
        # itself was found taken only after the workers had started, as "address already in use"
        if self.grpc_port is not None and not (0 <= self.grpc_port <= 65535):
            raise ValueError(f"grpc_port must be within [0, 65535], got {self.grpc_port}")
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"grpc_port {self.grpc_port} is the HTTP port too: gRPC needs a port of its own (8001 "
                             "is the usual one)")
        if self.max_request_nodes < 1:
            raise ValueError(f"max_request_nodes must be >= 1, got {self.max_request_nodes}")
        if not self.model_name or "/" in self.model_name:
            raise ValueError(f"model_name must be non-empty without '/', got {self.model_name!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        # below 0 was taken as 0 (no polling) without a word; a poll every nanosecond spun a
        # core scanning the repository
        if not (self.repository_poll_s == 0 or self.repository_poll_s >= MIN_REPOSITORY_POLL_S):
            raise ValueError(f"repository_poll_s must be 0 (no polling) or at least {MIN_REPOSITORY_POLL_S} s, "
                             f"got {self.repository_poll_s}")
        if not 0 <= self.shutdown_grace_s <= 60:
            raise ValueError(f"shutdown_grace_s must be within [0, 60], got {self.shutdown_grace_s}")
        if self.seed_log is not None and not str(self.seed_log).endswith((".counts.npy", ".counts.npz")):
            raise ValueError(f"the seed log must be a .counts.npy file (a .counts.npz for a heterogeneous dataset), "
                             f"got {self.seed_log}")
        # finite too: inf wrote nothing until stop (a log that stays empty while the server runs)
        if not 0 < self.seed_log_interval_s < math.inf:
            raise ValueError(f"seed_log_interval_s must be a finite number of seconds > 0, got "
                             f"{self.seed_log_interval_s}")
        if not 0 <= self.unready_delay_s <= 300:
            raise ValueError(f"unready_delay_s must be within [0, 300], got {self.unready_delay_s}")


@config_class
class PolicyConfig:
    """Serving from a profile (`hybridgnn profile`): the policy picks the PSGS threshold
    (latency | throughput | cpu | gpu operating points) or, with slo:<ms>, the threshold
    and the largest batch PSGS that maximise predicted throughput within that p99.
    adapt: re-fit the curves from live batches every adapt_interval_s and move the
    threshold by at most a factor of adapt_max_step each time."""

    profile: Path | None = None
    policy: str = "latency"
    adapt: bool = False
    adapt_interval_s: float = 10.0
    adapt_min_batches: int = 200
    adapt_max_step: float = 2.0
    # What slo:<ms> assumes beyond the profile (scheduler/queueing.py): seeds per request
    # (--adapt replaces it with the live mean), the event loop's CPU per request, and CPU
    # per request that other processes on these cores spend (a load generator beside it).
    request_seeds: float = setting(8.0, "slo:<ms> assumes requests of this many seeds on average (--adapt uses "
                                   "the live mean)")
    frontend_cpu_us: float = setting(500.0, "slo:<ms> charges each request this much event-loop CPU "
                                     "(microseconds), which slows the CPU pipeline as load grows")
    colocated_cpu_us: float = setting(0.0, "CPU per request (microseconds) spent by other processes on these "
                                      "cores, e.g. a load generator on the same machine; slo:<ms> leaves it "
                                      "to them")
    service_scale: float = setting(1.0, "slo:<ms> assumes batches take this many times as long as profiled, "
                                   "load aside (the machine drifting since the profile; service_stretch in the "
                                   "model metadata shows it)")

    def __post_init__(self):
        if not (self.policy in ("latency", "throughput", "cpu", "gpu")
                or self.policy.startswith(("slo:", "slo-mean:"))):
            raise ValueError(f"policy must be latency, throughput, cpu, gpu, slo:<ms> or slo-mean:<ms>, "
                             f"got {self.policy!r}")
        if self.adapt and self.profile is None:
            raise ValueError("--adapt needs a --profile to start from")
        if self.adapt_interval_s <= 0 or self.adapt_min_batches < 1 or self.adapt_max_step <= 1:
            raise ValueError("adapt_interval_s > 0, adapt_min_batches >= 1 and adapt_max_step > 1 needed")
        # finite too: an infinite cost said "no batch meets a p99 of <slo> ms", blaming the SLO
        if not (1 <= self.request_seeds <= MAX_REQUEST_SEEDS and 0 <= self.frontend_cpu_us < math.inf
                and 0 <= self.colocated_cpu_us < math.inf and 0 < self.service_scale < math.inf):
            raise ValueError(f"request_seeds within [1, {MAX_REQUEST_SEEDS}], frontend_cpu_us >= 0, colocated_cpu_us >= 0 "
                             "and service_scale > 0, each finite, "
                             f"needed, got {self.request_seeds}, {self.frontend_cpu_us}, {self.colocated_cpu_us}, "
                             f"{self.service_scale}")



@config_class
class ServeConfig:
    """Everything `hybridgnn serve` needs; CLI flags map onto these fields."""

    dataset_dir: Path
    model_dir: Path
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # A Triton-style model repository (<name>/<version>/): every version its policy
    # chooses is served over the one dataset (model_dir is then its first version).
    model_repository: Path | None = None
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    cpu_pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # None: CPU only. Otherwise a second pipeline, named "gpu", on device "cuda"/"cuda:N",
    # or "cpu": the GPU pipeline's code on CPU tensors, a stand-in second device for tests
    # and profiling where no GPU exists.
    gpu_pipeline: PipelineConfig | None = None
    gpu_memory: DeviceMemoryConfig = field(default_factory=DeviceMemoryConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    new_nodes: NewNodeConfig = field(default_factory=NewNodeConfig)
    updates: UpdateConfig = field(default_factory=UpdateConfig)
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig())
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    partitions: PartitionConfig = field(default_factory=PartitionConfig)

    @property
    def graph_updates(self) -> bool:
        """Whether this server applies graph updates: an update token, but not a model
        repository's (there it guards loading and unloading versions, which serve a static graph)."""
        return self.updates.enabled and self.model_repository is None

    def __post_init__(self):
        for pipe, expected in ((self.cpu_pipeline, "cpu"), (self.gpu_pipeline, "gpu")):
            if pipe is None:
                continue
            if pipe.name != expected:
                raise ValueError(f"the {expected} pipeline must be named {expected!r}, got {pipe.name!r}")
            if not (pipe.device == "cpu" or pipe.device == "cuda" or pipe.device.startswith("cuda:")):
                raise ValueError(f"pipeline device must be cpu, cuda or cuda:N, got {pipe.device!r}")
        if self.cpu_pipeline.processes and (self.graph_updates or self.cpu_pipeline.device != "cpu"):
            raise ValueError("worker processes serve a static graph on the CPU: drop --worker-processes, or the "
                             "update token and --cpu-compute-device")
        if self.cpu_pipeline.split and (self.gpu_pipeline is None or self.cpu_pipeline.processes
                                        or self.cpu_pipeline.device != "cpu" or self.graph_updates):
            raise ValueError("the split CPU lane samples on the CPU and computes on the GPU pipeline's device: it "
                             "needs the GPU pipeline, worker threads (not processes), no --cpu-compute-device and no "
                             "graph updates")
        if self.gpu_pipeline is not None and self.gpu_pipeline.processes:
            raise ValueError("worker processes are for the CPU pipeline; GPU workers share one CUDA context")
        if self.gpu_pipeline is not None and self.graph_updates:
            raise ValueError("graph updates run on the CPU pipeline only; drop the GPU pipeline (--device cpu) "
                             "or the update token")
        if self.partitions.enabled:
            if self.model_repository is not None:
                raise ValueError("--partitions serves one model; drop --model-repository")
            c = self.cpu_pipeline
            if c.processes or c.cpus or c.split:  # taken and ignored: --worker-cpus kept every thread off its cores
                raise ValueError("a partitioned server computes on its ranks: it runs no worker processes (nor "
                                 "--worker-cpus) and no split CPU lane")
            if self.policy.profile is not None:
                raise ValueError("a partitioned server serves no profile's policy: drop --profile")
            if self.updates.log_retain:
                raise ValueError("a partitioned server replays the whole update log each time its ranks start, so "
                                 "it keeps every entry: drop --update-log-retain")
