"""`hybridgnn serve`: run the inference server (the demo graph and model by default)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridgnn.capabilities import CPU_COUNT
from hybridgnn.config import (
    GRAPH_PLACEMENTS,
    AdmissionConfig,
    BatcherConfig,
    DeviceMemoryConfig,
    NewNodeConfig,
    PipelineConfig,
    PolicyConfig,
    RouterConfig,
    SamplingConfig,
    ServeConfig,
    ServerConfig,
    UpdateConfig,
    env_default,
    parse_bytes,
    parse_fanouts,
)
from hybridgnn.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve GNN inference over HTTP (KServe v2)",
                       description="Serve a model over HTTP (KServe v2). With no --dataset/--model, the demo graph "
                                   "and model are generated and trained into the cache directory on first run. "
                                   "Every flag can also be set as HYBRIDGNN_<FLAG> (e.g. HYBRIDGNN_PORT=9000).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", type=Path, default=env_default("DATASET", None, Path), help="dataset directory")
    p.add_argument("--model", type=Path, default=env_default("MODEL", None, Path), help="model directory")
    p.add_argument("--model-name", default=env_default("MODEL_NAME", ServerConfig.model_name), help="name in /v2/models/{name}")
    p.add_argument("--fanouts", default=env_default("FANOUTS", None),
                   help="comma-separated fanouts, hop 1 first (default: the model's training fanouts)")
    p.add_argument("--host", default=env_default("HOST", ServerConfig.host))
    p.add_argument("--port", type=int, default=env_default("PORT", ServerConfig.port, int))
    p.add_argument("--workers", type=int, default=env_default("WORKERS", CPU_COUNT, int), help="CPU pipeline workers")
    add_worker_processes_flag(p, env_default("WORKER_PROCESSES", "auto", _on_off_auto))
    p.add_argument("--max-batch-seeds", type=int, default=env_default("MAX_BATCH_SEEDS", BatcherConfig.max_batch_seeds, int))
    p.add_argument("--max-batch-requests", type=int, default=env_default("MAX_BATCH_REQUESTS", BatcherConfig.max_batch_requests, int))
    p.add_argument("--max-wait-ms", type=float, default=env_default("MAX_WAIT_MS", BatcherConfig.max_wait_s * 1000, float),
                   help="longest a request waits for its batch to fill")
    p.add_argument("--max-pending", type=int, default=env_default("MAX_PENDING", BatcherConfig.max_pending_requests, int),
                   help="hard cap on requests in flight (memory); the queue-delay bound usually refuses first")
    p.add_argument("--max-queue-delay-ms", type=float, default=env_default("MAX_QUEUE_DELAY_MS", None, float),
                   help="admit a request only while the queueing delay it would see (queued work over the measured "
                        "service rate) stays within this; else 429 + Retry-After (default: the room an slo:<ms> "
                        "policy leaves, else 100)")
    p.add_argument("--max-request-nodes", type=int, default=env_default("MAX_REQUEST_NODES", ServerConfig.max_request_nodes, int))
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "emulate"], default=env_default("DEVICE", "auto"),
                   help="pipelines to run: cpu (CPU only), cuda (CPU and GPU pipelines, hybrid routing), auto "
                        "(cuda when a GPU is visible), emulate (the GPU pipeline's code on CPU tensors, for "
                        "testing and profiling without a GPU)")
    p.add_argument("--psgs-threshold", type=float, default=env_default("PSGS_THRESHOLD", None, float),
                   help="batches with PSGS below go to the CPU pipeline, the rest to the GPU one (default with "
                        "two pipelines: the PSGS of 64 average seeds; inf: CPU unless spilled)")
    p.add_argument("--no-spill", dest="spill", action="store_false",
                   default=env_default("SPILL", True, lambda v: v not in ("0", "")),
                   help="never move a batch to the other pipeline when its own is saturated (with "
                        "--psgs-threshold 0: GPU only, for single-device baselines)")
    p.add_argument("--profile", type=Path, default=env_default("PROFILE", None, Path),
                   help="a profile from `hybridgnn profile` for this dataset, model and fanouts; its policy sets "
                        "the PSGS threshold (and, for slo:<ms>, the batch PSGS bound)")
    p.add_argument("--policy", default=env_default("POLICY", None),
                   help="with --profile: latency | throughput | cpu | gpu (operating points) or slo:<ms> (most "
                        f"predicted throughput with predicted p99 within <ms>); default {PolicyConfig.policy}")
    p.add_argument("--adapt", action="store_true", default=env_default("ADAPT", False, lambda v: v not in ("0", "")),
                   help="with --profile: re-fit the curves from live batches every 10 s and move the policy "
                        "(at most 2x per step); logged and counted in hybridgnn_policy_changes_total")
    p.add_argument("--request-seeds", type=float, default=env_default("REQUEST_SEEDS", PolicyConfig.request_seeds, float),
                   help="slo:<ms> assumes requests of this many seeds on average (--adapt uses the live mean)")
    p.add_argument("--frontend-cpu-us", type=float, default=env_default("FRONTEND_CPU_US", PolicyConfig.frontend_cpu_us, float),
                   help="slo:<ms> charges each request this much event-loop CPU (microseconds), which slows "
                        "the CPU pipeline as load grows")
    p.add_argument("--colocated-cpu-us", type=float, default=env_default("COLOCATED_CPU_US", PolicyConfig.colocated_cpu_us, float),
                   help="CPU per request (microseconds) spent by other processes on these cores, e.g. a load "
                        "generator on the same machine; slo:<ms> leaves it to them")
    p.add_argument("--service-scale", type=float, default=env_default("SERVICE_SCALE", PolicyConfig.service_scale, float),
                   help="slo:<ms> assumes batches take this many times as long as profiled, load aside (the "
                        "machine drifting since the profile; service_stretch in the model metadata shows it)")
    p.add_argument("--seed-log", type=Path, default=env_default("SEED_LOG", None, Path),
                   help="write per-node request counts here (a .counts.npy, every 60 s and at stop) for "
                        "`hybridgnn place --from-log`")
    p.add_argument("--gpu-workers", type=int, default=env_default("GPU_WORKERS", PipelineConfig.workers, int),
                   help="GPU pipeline workers, each with its own CUDA stream")
    p.add_argument("--gpu-cache-bytes", type=parse_bytes, default=env_default("GPU_CACHE_BYTES", "1G", parse_bytes),
                   help="device memory for the hottest feature rows by FAP (e.g. 512M, 4G)")
    p.add_argument("--graph-placement", choices=list(GRAPH_PLACEMENTS), default=env_default("GRAPH_PLACEMENT", DeviceMemoryConfig.graph_placement),
                   help="GPU sampler reads the topology from pinned host memory over UVA, or from a copy in "
                        "device memory")
    p.add_argument("--placement", type=Path, default=env_default("PLACEMENT", None, Path),
                   help="a plan directory from `hybridgnn place`: both pipelines read features through its tiers "
                        "(GPU, peer GPU, pinned host, disk) instead of the FAP-ordered cache")
    p.add_argument("--placement-server", type=int, default=env_default("PLACEMENT_SERVER", DeviceMemoryConfig.placement_server, int),
                   help="which server of the plan this replica is")
    p.add_argument("--cpu-compute-device", default=env_default("CPU_COMPUTE_DEVICE", "cpu"),
                   help="where the CPU pipeline gathers features and runs the model (cpu, or cuda: only sampling "
                        "stays on the CPU, as in Quiver)")
    p.add_argument("--idle-timeout-s", type=float, default=env_default("IDLE_TIMEOUT_S", ServerConfig.idle_timeout_s, float),
                   help="close keep-alive connections idle this long between requests")
    p.add_argument("--request-timeout-s", type=float, default=env_default("REQUEST_TIMEOUT_S", ServerConfig.request_timeout_s, float),
                   help="a request must arrive whole within this long of its first byte (else 408)")
    p.add_argument("--max-connections", type=int, default=env_default("MAX_CONNECTIONS", ServerConfig.max_connections, int),
                   help="open connections beyond this get 503 + Retry-After (capped by the descriptor limit)")
    p.add_argument("--drain-timeout-s", type=float, default=env_default("DRAIN_TIMEOUT_S", ServerConfig.drain_timeout_s, float))
    p.add_argument("--shutdown-grace-s", type=float, default=env_default("SHUTDOWN_GRACE_S", ServerConfig.shutdown_grace_s, float),
                   help="after draining, keep answering 503 this long before closing the listener")
    p.add_argument("--unready-delay-s", type=float, default=env_default("UNREADY_DELAY_S", ServerConfig.unready_delay_s, float),
                   help="on SIGTERM, report not-ready but keep serving this long before draining "
                        "(longer than the balancer's health-check interval)")
    p.add_argument("--new-node-mode", choices=["full", "pe", "srpe"], default=env_default("NEW_NODE_MODE", NewNodeConfig.default_mode),
                   help="mode of new-node requests that name none")
    p.add_argument("--srpe-gamma", type=float, default=env_default("SRPE_GAMMA", NewNodeConfig.gamma, float),
                   help="default share of the query nodes' direct neighbours that SRPE recomputes")
    p.add_argument("--update-token", default=None,  # env read in build_config, so --help never prints it
                   help="enable POST /v2/models/{m}/graph for clients sending 'Authorization: Bearer <token>' "
                        "(prefer the HYBRIDGNN_UPDATE_TOKEN environment variable: flags show in ps)")
    p.add_argument("--update-batch", type=int, default=env_default("UPDATE_BATCH", UpdateConfig.max_batch_updates, int),
                   help="queued update requests are merged and applied together up to this many updates")
    p.add_argument("--update-propagation", choices=["auto", "recompute"],
                   default=env_default("UPDATE_PROPAGATION", UpdateConfig.propagation),
                   help="auto: deltas for sum/mean/GCN/GIN layers, recompute for max/attention; "
                        "recompute: recompute every affected node (slower)")
    p.add_argument("--update-log", default=env_default("UPDATE_LOG", UpdateConfig.log),
                   help="with --update-token: where applied update batches are logged durably before they are "
                        "acknowledged and replayed from at start: sqlite:///<path> or a path (default "
                        "<dataset>/updates.sqlite), or off (updates live in memory only and are lost on restart)")
    p.add_argument("--seed", type=int, default=env_default("SEED", SamplingConfig.seed, int), help="sampling seed")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the demo graph and model live")
    p.set_defaults(run=run)


def _on_off_auto(value: str) -> str:
    v = value.strip().lower()
    return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "off"}.get(v, v)


def add_worker_processes_flag(p, default: str = "auto") -> None:
    p.add_argument("--worker-processes", nargs="?", const="on", default=default, choices=("auto", "on", "off"),
                   help="run each CPU worker's batches in a process of its own: no GIL shared with the HTTP "
                        "event loop, so an overloaded front end does not slow the batches; the graph stays "
                        "memory-mapped and shared. auto (default): on for a static graph computed on the CPU, "
                        "off with graph updates or --cpu-compute-device cuda")


def worker_processes(choice: str, compute_device: str, updates: bool) -> bool:
    """The --worker-processes choice resolved: auto means wherever processes can serve."""
    if choice == "auto":
        return compute_device == "cpu" and not updates
    return choice == "on"


def gpu_pipeline_config(device: str, workers: int) -> PipelineConfig | None:
    """--device → the GPU pipeline's config, or None for a CPU-only server."""
    from hybridgnn.capabilities import HAS_CUDA

    if device == "auto":
        device = "cuda" if HAS_CUDA else "cpu"
    if device == "cpu":
        return None
    if device == "cuda" and not HAS_CUDA:
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    return PipelineConfig(name="gpu", device="cuda" if device == "cuda" else "cpu", workers=workers)


def check_ranges(args) -> None:
    """Flag ranges in the flags' own units (the config dataclasses check seconds)."""
    if not 0 <= args.max_wait_ms <= 10_000:
        raise ConfigError(f"--max-wait-ms must be within [0, 10000] milliseconds, got {args.max_wait_ms:g}")


def chosen_policy(args) -> str:
    """--policy, refused without --profile: without one there are no curves to pick from,
    and silently ignoring the choice would serve something else than asked."""
    if args.policy is None:
        return PolicyConfig.policy
    if args.profile is None:
        raise ConfigError(f"--policy {args.policy} needs --profile (a profile from `hybridgnn profile` for this "
                          "dataset and model); without one the server routes by --psgs-threshold")
    return args.policy


def build_config(args) -> ServeConfig:
    check_ranges(args)
    from hybridgnn.models.checkpoint import read_config

    if (args.dataset is None) != (args.model is None):
        raise ValueError("give both --dataset and --model, or neither (to serve the demo)")
    if args.dataset is None:
        from hybridgnn.demo import ensure_demo

        args.dataset, args.model = ensure_demo(args.cache_dir)
    if args.fanouts:
        fanouts = parse_fanouts(args.fanouts)
    else:
        model_cfg = read_config(args.model)
        fanouts = tuple(model_cfg.get("fanouts") or [10] * model_cfg["num_layers"])
    update_token = args.update_token or env_default("UPDATE_TOKEN", None)
    processes = worker_processes(args.worker_processes, args.cpu_compute_device, bool(update_token))
    return ServeConfig(
        new_nodes=NewNodeConfig(default_mode=args.new_node_mode, gamma=args.srpe_gamma),
        updates=UpdateConfig(token=update_token, max_batch_updates=args.update_batch,
                             propagation=args.update_propagation, log=args.update_log),
        dataset_dir=args.dataset,
        model_dir=args.model,
        sampling=SamplingConfig(fanouts=fanouts, seed=args.seed),
        batcher=BatcherConfig(max_batch_seeds=args.max_batch_seeds, max_batch_requests=args.max_batch_requests,
                              max_wait_s=args.max_wait_ms / 1000.0, max_pending_requests=args.max_pending),
        cpu_pipeline=PipelineConfig(name="cpu", device=args.cpu_compute_device, workers=args.workers,
                                    processes=processes),
        gpu_pipeline=gpu_pipeline_config(args.device, args.gpu_workers),
        gpu_memory=DeviceMemoryConfig(cache_bytes=args.gpu_cache_bytes, graph_placement=args.graph_placement,
                                      placement_plan=args.placement, placement_server=args.placement_server),
        router=RouterConfig(psgs_threshold=args.psgs_threshold, spill=args.spill),
        admission=AdmissionConfig(max_queue_delay_s=(args.max_queue_delay_ms / 1000.0
                                                     if args.max_queue_delay_ms is not None else None)),
        policy=PolicyConfig(profile=args.profile, policy=chosen_policy(args), adapt=args.adapt,
                            request_seeds=args.request_seeds, frontend_cpu_us=args.frontend_cpu_us,
                            colocated_cpu_us=args.colocated_cpu_us, service_scale=args.service_scale),
        server=ServerConfig(host=args.host, port=args.port, model_name=args.model_name,
                            max_request_nodes=args.max_request_nodes, drain_timeout_s=args.drain_timeout_s,
                            shutdown_grace_s=args.shutdown_grace_s, unready_delay_s=args.unready_delay_s,
                            seed_log=args.seed_log, request_timeout_s=args.request_timeout_s, max_connections=args.max_connections,
                            idle_timeout_s=args.idle_timeout_s),
    )


def run(args) -> int:
    from hybridgnn.serving.lifecycle import run as run_server
    from hybridgnn.telemetry.metrics import Telemetry

    cfg = build_config(args)
    return run_server(cfg, Telemetry(model=cfg.server.model_name))
