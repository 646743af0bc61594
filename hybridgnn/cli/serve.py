"""`hybridgnn serve`: run the inference server (the demo graph and model by default)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hybridgnn.capabilities import CPU_COUNT, allowed_cores
from hybridgnn.cli.flags import (
    DefaultsHelpFormatter,
    add_config_flags,
    config_values,
    flag_value,
    flags_given,
    user_path,
)
from hybridgnn.config import (
    MAX_WORKERS,
    AdmissionConfig,
    BatcherConfig,
    DeviceMemoryConfig,
    NewNodeConfig,
    PartitionConfig,
    PipelineConfig,
    PolicyConfig,
    RouterConfig,
    SamplingConfig,
    ServeConfig,
    ServerConfig,
    UpdateConfig,
    env_default,
    env_flag,
    parse_cpus,
    parse_fanouts,
)
from hybridgnn.config.settings import BadEnvValue
from hybridgnn.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve GNN inference over HTTP (KServe v2)",
                       description="Serve a model over HTTP (KServe v2). With no --dataset/--model, the demo graph "
                                   "and model are generated and trained into the cache directory on first run. "
                                   "Every flag can also be set as HYBRIDGNN_<FLAG> (e.g. HYBRIDGNN_PORT=9000).",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=user_path, default=env_default("DATASET", None, user_path), help="dataset directory (with --model; neither: the demo)")
    p.add_argument("--model", type=user_path, default=env_default("MODEL", None, user_path),
                   help="model directory (with --dataset; neither: the demo)")
    p.add_argument("--model-repository", type=user_path, default=env_default("MODEL_REPOSITORY", None, user_path),
                   help="instead of --model: a repository of <name>/<version>/ model directories (and optional "
                        "<name>/config.json: version_policy, fanouts), all served over --dataset")
    p.add_argument("--fanouts", default=env_default("FANOUTS", None),
                   help="comma-separated fanouts, hop 1 first (default: the model's training fanouts)")
    p.add_argument("--workers", type=int, default=env_default("WORKERS", None, int),
                   help="CPU pipeline workers (default: the cores given by --worker-cpus, else the cores this "
                        "process may use)")
    add_worker_processes_flag(p, env_default("WORKER_PROCESSES", "auto", on_off_auto))
    p.add_argument("--worker-cpus", default=env_default("WORKER_CPUS", ""),
                   help="cores for the CPU worker processes, e.g. 1-3 (default: anywhere); the event loop and "
                        "the server's other threads then keep to the remaining cores, so front-end work "
                        "(thousands of refusals a second under overload) never takes CPU from the batches")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "emulate"], default=env_default("DEVICE", "auto"),
                   help="pipelines to run: cpu (CPU only), cuda (CPU and GPU pipelines, hybrid routing), auto "
                        "(cuda when a GPU is visible, but cpu with graph updates, which run on the CPU pipeline "
                        "only), emulate (the GPU pipeline's code on CPU tensors, for "
                        "testing and profiling without a GPU)")
    p.add_argument("--no-spill", dest="spill", action="store_false",
                   default=_spill_default(),
                   help="never move a batch to the other pipeline when its own is saturated (with "
                        "--psgs-threshold 0: GPU only, for single-device baselines)")
    p.add_argument("--profile", type=user_path, default=env_default("PROFILE", None, user_path),
                   help="a profile from `hybridgnn profile` for this dataset, model and fanouts; its policy sets "
                        "the PSGS threshold (and, for slo:<ms>, the batch PSGS bound)")
    p.add_argument("--policy", default=env_default("POLICY", None),
                   help="with --profile: latency | throughput | cpu | gpu (operating points) or slo:<ms> (each "
                        "pipeline's batch PSGS bound with the most predicted throughput at a predicted p99 within "
                        f"<ms>; slo-mean:<ms> from the mean curve); default {PolicyConfig.policy}")
    p.add_argument("--adapt", action="store_true", default=env_default("ADAPT", False, env_flag),
                   help="with --profile: re-fit the curves from live batches every 10 s and move the policy "
                        "(at most 2x per step); logged and counted in hybridgnn_policy_changes_total")
    p.add_argument("--wait-when-idle", action="store_true", default=env_default("WAIT_WHEN_IDLE", False, env_flag),
                   help="hold each batch --max-wait-ms to fill even on a quiet server (bigger batches at light "
                        "load, for up to --max-wait-ms more latency); by default a request that finds no batch "
                        "under way is dispatched at once, and --max-wait-ms holds batches once any is")
    p.add_argument("--access-log", action="store_true", default=env_default("ACCESS_LOG", False, env_flag),
                   help="log one line per answered request, HTTP and gRPC (peer, request, status, bytes, "
                        "milliseconds, X-Request-Id) on the logger hybridgnn.access, whatever --log-level says")
    p.add_argument("--gpu-workers", type=int, default=env_default("GPU_WORKERS", PipelineConfig.workers, int),
                   help="GPU pipeline workers, each with its own CUDA stream")
    p.add_argument("--cpu-compute-device", default=env_default("CPU_COMPUTE_DEVICE", "cpu"),
                   help="where the CPU pipeline gathers features and runs the model (cpu, or cuda: only sampling "
                        "stays on the CPU, as in Quiver)")
    add_cpu_lane_flag(p)
    p.add_argument("--update-token", default=None,  # env read in build_config, so --help never prints it
                   help="enable POST /v2/models/{m}/graph for clients sending 'Authorization: Bearer <token>' "
                        "(prefer the HYBRIDGNN_UPDATE_TOKEN environment variable: flags show in ps)")
    p.add_argument("--cache-dir", type=user_path, default=None,
                   help="the demo graph and model live in <this>/demo (default: HYBRIDGNN_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/hybridgnn, else ~/.cache/hybridgnn)")
    # The rest come from the config dataclasses' fields (defaults, units and help live there).
    add_config_flags(p, ServerConfig, RouterConfig, BatcherConfig, AdmissionConfig, SamplingConfig, PolicyConfig, NewNodeConfig,
                     UpdateConfig, DeviceMemoryConfig, PartitionConfig)
    p.set_defaults(run=run)


def _spill_default():
    """--no-spill from HYBRIDGNN_NO_SPILL (true: never spill), as every flag is HYBRIDGNN_<FLAG>;
    without it from HYBRIDGNN_SPILL (0: never spill), the name it was read from before."""
    no_spill = env_default("NO_SPILL", None, env_flag)
    if no_spill is None:
        return env_default("SPILL", True, env_flag)
    return no_spill if isinstance(no_spill, BadEnvValue) else not no_spill


def on_off_auto(value: str) -> str:
    v = value.strip().lower()
    return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "off"}.get(v, v)


def add_worker_processes_flag(p, default: str = "auto") -> None:
    p.add_argument("--worker-processes", nargs="?", const="on", default=default, choices=("auto", "on", "off"),
                   help="run each CPU worker's batches in a process of its own: no GIL shared with the HTTP "
                        "event loop, so an overloaded front end does not slow the batches; the graph stays "
                        "memory-mapped and shared. auto (default): on for a static graph computed on the CPU, "
                        "off with graph updates, --cpu-compute-device cuda or a split --cpu-lane (heterogeneous and "
                        "partitioned servers run none)")


def worker_processes(choice: str, compute_device: str, updates: bool, split: bool = False,
                     threads_only: str | None = None) -> bool:
    """The --worker-processes choice resolved: auto means wherever processes can serve (a
    split CPU lane's workers hand batches to the device in this process: threads).
    threads_only: the engine that serves runs no worker processes (why, in a few words).
    An `on` that cannot be served is refused in one line naming what stands in its way."""
    if choice == "auto":
        return compute_device == "cpu" and not updates and not split and threads_only is None
    if choice != "on":
        return False
    if threads_only is not None:
        raise ConfigError(f"--worker-processes on: {threads_only}, not worker processes: drop it")
    if updates:
        raise ConfigError("--worker-processes on serves a static graph, and the update token turns graph updates "
                          "on (they run on worker threads): drop one of them")
    if compute_device != "cpu":
        raise ConfigError(f"--worker-processes on computes on the CPU: drop it or --cpu-compute-device "
                          f"{compute_device}")
    return True


def add_cpu_lane_flag(p) -> None:
    p.add_argument("--cpu-lane", choices=("auto", "split", "model"), default=env_default("CPU_LANE", "auto"),
                   help="what the CPU pipeline's workers do: split (Quiver's CPU lane: they only sample, and the "
                        "GPU gathers features and runs the model for both lanes), model (they sample, gather and "
                        "run the model on the CPU). auto (default): split on a CUDA GPU, model otherwise (and when worker "
                        "processes, graph updates or --cpu-compute-device are asked for)")


def cpu_lane_split(choice: str, gpu: PipelineConfig | None, compute_device: str, updates: bool,
                   processes_asked: bool = False) -> bool:
    """--cpu-lane resolved; ConfigError in one line for a split the server cannot run.
    processes_asked: worker processes were asked for (--worker-processes on, --worker-cpus),
    which auto honours by keeping the CPU-model lane."""
    if choice == "model":
        return False
    if choice == "split":
        if updates:
            raise ConfigError("--cpu-lane split computes on the GPU pipeline's device, and graph updates (the "
                              "update token) run on the CPU pipeline only: drop one of them")
        if gpu is None:
            raise ConfigError("--cpu-lane split hands samples to the GPU pipeline: start with --device cuda (or "
                              "--device emulate to run its code on CPU tensors)")
        if compute_device != "cpu":
            raise ConfigError(f"--cpu-lane split computes on the GPU pipeline's device: drop --cpu-compute-device "
                              f"{compute_device}")
        return True
    return (gpu is not None and gpu.device.startswith("cuda") and compute_device == "cpu" and not updates
            and not processes_asked)


def chosen_worker_cpus(text: str, processes: bool, why_off: str | None = None) -> tuple[int, ...]:
    """--worker-cpus as core numbers, refused in one line when it cannot be honoured: cores
    this process may not use, or worker threads (only processes can be pinned apart).
    why_off: why worker processes are off, in the words of what turned them off."""
    try:
        cpus = parse_cpus(text)
    except ValueError as exc:
        raise ConfigError(f"--worker-cpus: {exc}") from None
    if not cpus:
        return ()
    if not processes:
        raise ConfigError(f"--worker-cpus pins worker processes, which are off here ("
                          f"{why_off or '--worker-processes off, graph updates on, or --cpu-compute-device cuda'})")
    allowed = allowed_cores()
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ConfigError(f"--worker-cpus {text}: this process may not run on core(s) {outside} "
                          f"(it may use {sorted(allowed)})")
    return cpus


def gpu_pipeline_config(device: str, workers: int, updates: bool = False) -> PipelineConfig | None:
    """--device → the GPU pipeline's config, or None for a CPU-only server. updates: graph
    updates are on; they run on the CPU pipeline only, so auto is then cpu, and a GPU
    pipeline asked for is refused in one line naming --device."""
    from hybridgnn.capabilities import HAS_CUDA

    if device == "auto":
        device = "cuda" if HAS_CUDA and not updates else "cpu"
    if device == "cpu":
        return None
    if updates:
        raise ConfigError(f"--device {device} adds the GPU pipeline, and graph updates (the update token) run on the "
                          "CPU pipeline only: drop --device (auto serves updates on the CPU) or the update token")
    if device == "cuda" and not HAS_CUDA:
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    return PipelineConfig(name="gpu", device="cuda" if device == "cuda" else "cpu", workers=workers)


def check_cpu_compute_device(device: str) -> None:
    """--cpu-compute-device cuda[:i] on a machine without CUDA: one line, before anything
    starts (it failed as a traceback when the first worker moved the model)."""
    import re

    from hybridgnn.capabilities import HAS_CUDA

    # one the config refuses was said without its flag ("pipeline device must be ..."), and
    # cuda:x or cuda:7 on a one-GPU machine passed it, to fail in the first worker
    form = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if form is None:
        raise ValueError(f"--cpu-compute-device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not HAS_CUDA:
        raise ValueError(f"--cpu-compute-device {device}: no CUDA device is visible "
                         "(torch.cuda.is_available() is False)")
    if form.group(1) is not None:
        import torch

        if int(form.group(1)) >= torch.cuda.device_count():
            raise ValueError(f"--cpu-compute-device {device}: this machine has {torch.cuda.device_count()} CUDA "
                             "device(s), numbered from 0")


def check_workers(args) -> None:
    """--workers and --gpu-workers in the flag's words: both said "workers must be within
    [1, 1024], got 0", naming neither."""
    for flag, value in (("--workers", args.workers), ("--gpu-workers", args.gpu_workers)):
        if value is not None and not 1 <= value <= MAX_WORKERS:
            raise ConfigError(f"{flag} must be within [1, {MAX_WORKERS}], got {value}")


def check_ranges(args) -> None:
    """Flag ranges in the flags' own units (the config dataclasses check seconds)."""
    check_workers(args)
    wait_ms = flag_value(args, BatcherConfig, "max_wait_s")
    if not 0 <= wait_ms <= 10_000:
        raise ConfigError(f"--max-wait-ms must be within [0, 10000] milliseconds, got {wait_ms:g}")
    delay_ms = flag_value(args, AdmissionConfig, "max_queue_delay_s")
    if delay_ms is not None and not 0 < delay_ms <= 60_000:  # it said "max_queue_delay_s ... seconds, got 0.0"
        raise ConfigError(f"--max-queue-delay-ms must be within (0, 60000] milliseconds, got {delay_ms:g}")


def chosen_policy(args) -> str:
    """--policy, refused without --profile: without one there are no curves to pick from,
    and silently ignoring the choice would serve something else than asked."""
    if args.policy is None:
        return PolicyConfig.policy
    if args.profile is None:
        raise ConfigError(f"--policy {args.policy} needs --profile (a profile from `hybridgnn profile` for this "
                          "dataset and model); without one the server routes by --psgs-threshold")
    return args.policy


def _why_unserved(m) -> str:
    """Why a repository model has no version to serve, in a few words."""
    if m.error is not None:  # its config.json, or a directory that cannot be read
        return f"{m.name}/: {m.error}"
    if not m.available:
        try:
            others = sorted(p.name for p in m.root.iterdir() if p.is_dir())[:3]
        except OSError:  # gone or unreadable since the scan
            others = []
        return (f"{m.name}/ has no version directory (1/, 2/, ...)"
                + (f", only {', '.join(o + '/' for o in others)}" if others else ""))
    if not m.chosen:
        return f"{m.name}/: its version policy chooses none of {m.available}"
    dirs = [m.version_dir(v) for v in m.chosen]
    if not any((d / "config.json").is_file() for d in dirs):
        return f"{m.name}/: version {', '.join(map(str, m.chosen))} holds no hybridgnn model (config.json)"
    return next(why for why in map(_unreadable, dirs) if why is not None)  # a config.json it cannot serve: why


def _unreadable(path: Path) -> str | None:
    """Why `path` holds no model a repository serves (None when it holds one)."""
    from hybridgnn.models.checkpoint import read_config

    try:
        read_config(path)
        return None
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        return str(exc)


def engine_without_worker_processes(args) -> str | None:
    """What serves, in a few words, when its engine runs no CPU worker processes and no split
    lane (None for the one that does): partition ranks compute a partitioned server's
    requests, and a heterogeneous graph's engine runs worker threads of its own. Its
    --worker-processes auto is then off, and on, --worker-cpus or --cpu-lane split are
    refused (they were taken and did nothing: --worker-cpus kept every thread off its cores)."""
    from hybridgnn.graph.store import dataset_kind

    if flag_value(args, PartitionConfig, "partitions"):
        return "with --partitions, its ranks compute every request"
    if args.dataset is not None and dataset_kind(args.dataset) == "hetero":
        return f"the heterogeneous graph {args.dataset} is served by worker threads"
    return None


def check_flags_read(args, graph_updates: bool) -> None:
    """Refuse flags this server would take and never read: each was accepted in silence and
    did nothing (an update log a server without graph updates never follows, so a replica
    started without the token served a graph its peers had changed; a poll period with no
    repository to poll; a model name a repository's directories replace; a GPU for
    pipelines a partitioned server does not run)."""
    # --update-log off is read without updates too: the dataset served as stored, whatever
    # its log holds (what refuse_unfollowed_updates tells a server without the token to pass)
    unread = [f for f in flags_given(args, UpdateConfig)
              if not (f == "--update-log" and flag_value(args, UpdateConfig, "log") == "off")]
    if unread and not graph_updates:
        why = ("a model repository serves a static graph (its update token guards loading and unloading)"
               if args.model_repository is not None else
               "graph updates are off without --update-token (or HYBRIDGNN_UPDATE_TOKEN; every replica of a log "
               "takes it)")
        raise ConfigError(f"{', '.join(unread)}: {why}: drop {'it' if len(unread) == 1 else 'them'}")
    if args.model_repository is None and flag_value(args, ServerConfig, "repository_poll_s"):
        raise ConfigError("--repository-poll-s polls a model repository, and none is served: give "
                          "--model-repository DIR or drop it")
    name = flag_value(args, ServerConfig, "model_name")
    if args.model_repository is not None and name != ServerConfig.model_name:
        raise ConfigError(f"--model-name {name}: a model repository names each model by its directory "
                          f"({args.model_repository}/<name>/<version>): drop --model-name")
    if flag_value(args, PartitionConfig, "partitions") and args.device in ("cuda", "emulate"):
        raise ConfigError(f"--device {args.device} (or HYBRIDGNN_DEVICE): with --partitions, its ranks compute "
                          "every request and no GPU pipeline runs; --partition-device cuda puts the ranks' "
                          "exchange on GPUs")


def check_partition_ranks(partitions: PartitionConfig) -> None:
    """--partitions N ranks started here (not --ranks elsewhere) that this machine can run:
    --partitions 1000 started a thousand torch processes."""
    from hybridgnn.capabilities import check_local_ranks, usable_cores

    if partitions.ranks is None:
        check_local_ranks("--partitions", partitions.partitions, usable_cores(),
                          "start them with torchrun and pass --ranks")


def build_config(args, probe_ports: bool = False) -> ServeConfig:
    """probe_ports: refuse listen ports in use before anything slow (the demo's first run)."""
    # Flags are checked before anything slow (the demo's first generation takes ~30 s),
    # so a mistake is answered at once.
    check_ranges(args)
    policy = chosen_policy(args)
    # None: each model's own (config.fanouts_for), filled in when it is loaded
    fanouts = parse_fanouts(args.fanouts) if args.fanouts else None
    update_token = args.update_token or env_default("UPDATE_TOKEN", None)
    # a repository's update token guards loading and unloading only: its versions serve a static graph
    graph_updates = bool(update_token) and args.model_repository is None
    check_flags_read(args, graph_updates)  # before the GPU is looked for: --device cuda is not read with --partitions
    gpu = gpu_pipeline_config(args.device, args.gpu_workers, graph_updates)
    check_cpu_compute_device(args.cpu_compute_device)
    threads_only = engine_without_worker_processes(args)
    if threads_only is not None and args.profile is not None:  # it was taken and never read
        server = ("a partitioned server" if flag_value(args, PartitionConfig, "partitions")
                  else "a heterogeneous graph's server")
        raise ConfigError(f"--profile {args.profile}: {server} serves no profile's policy (it routes by "
                          "--psgs-threshold alone): drop --profile, --policy and --adapt")
    if threads_only is not None and args.cpu_lane == "split":
        raise ConfigError(f"--cpu-lane split: {threads_only}, with no split CPU lane: drop it")
    if gpu is None and args.policy in ("latency", "throughput", "cpu", "gpu"):
        # the engine's refusal of it called a --policy given "the default"
        raise ConfigError(f"--policy {args.policy} picks a point between the CPU and GPU pipelines, but only the CPU "
                          "pipeline is served (--device cpu, or auto without a GPU): give --policy slo:<ms> (e.g. "
                          "slo:50)")
    split = threads_only is None and cpu_lane_split(
        args.cpu_lane, gpu, args.cpu_compute_device, graph_updates,
        processes_asked=args.worker_processes == "on" or bool(args.worker_cpus.strip()))
    if split and args.worker_processes == "on":
        raise ConfigError("--cpu-lane split runs its workers as threads (they hand batches to the GPU in this "
                          "process): drop --worker-processes")
    processes = worker_processes(args.worker_processes, args.cpu_compute_device, graph_updates, split,
                                 threads_only)
    worker_cpus = chosen_worker_cpus(args.worker_cpus, processes, why_off=(
        threads_only and f"{threads_only}, not worker processes"
        or args.worker_processes == "off" and "--worker-processes off"
        or split and "--cpu-lane split runs its workers as threads"
        or graph_updates and "the update token turns graph updates on, which run on worker threads"
        or f"--cpu-compute-device {args.cpu_compute_device}"))
    workers = args.workers if args.workers is not None else (len(worker_cpus) or CPU_COUNT)

    if args.model_repository is not None:
        if args.model is not None or args.dataset is None:
            raise ValueError("--model-repository takes the place of --model and needs --dataset")
        from hybridgnn.serving.repository.layout import scan_repository

        # a model whose config.json or directory cannot be read spoils no other: the
        # repository lists it UNAVAILABLE with why (it refused the whole server)
        models = scan_repository(args.model_repository, strict=False)
        chosen = [m.version_dir(v) for m in models.values() for v in m.chosen]
        readable = [d for d in chosen if _unreadable(d) is None]
        if not readable:
            raise ValueError(f"model repository {args.model_repository}: no version directory chosen by a version "
                             "policy holds a readable model (" + "; ".join(map(_why_unserved, models.values())) + ")")
        args.model = readable[0]  # server-wide defaults; each version gets its own fanouts when served
    if (args.dataset is None) != (args.model is None):
        raise ValueError("give both --dataset and --model, or neither (to serve the demo)")
    # The whole configuration is checked before the demo is made; its paths come after.
    cfg = ServeConfig(
        new_nodes=NewNodeConfig(**config_values(args, NewNodeConfig)),
        updates=UpdateConfig(token=update_token, **config_values(args, UpdateConfig)),
        dataset_dir=args.dataset,
        model_dir=args.model,
        model_repository=args.model_repository,
        sampling=SamplingConfig(fanouts=fanouts, **config_values(args, SamplingConfig)),
        batcher=BatcherConfig(**config_values(args, BatcherConfig), wait_when_idle=args.wait_when_idle),
        cpu_pipeline=PipelineConfig(name="cpu", device=args.cpu_compute_device, workers=workers,
                                    processes=processes, cpus=worker_cpus, split=split),
        gpu_pipeline=gpu,
        gpu_memory=DeviceMemoryConfig(**config_values(args, DeviceMemoryConfig)),
        router=RouterConfig(spill=args.spill, **config_values(args, RouterConfig)),
        admission=AdmissionConfig(**config_values(args, AdmissionConfig)),
        policy=PolicyConfig(profile=args.profile, policy=policy, adapt=args.adapt,
                            **config_values(args, PolicyConfig)),
        server=ServerConfig(**config_values(args, ServerConfig), access_log=args.access_log),
        partitions=PartitionConfig(**config_values(args, PartitionConfig)),
    )
    if probe_ports:
        check_ports_free(cfg.server.host, (cfg.server.port, cfg.server.grpc_port))
    check_partition_ranks(cfg.partitions)
    if args.dataset is None:
        from hybridgnn.demo import ensure_demo

        args.dataset, args.model = ensure_demo(args.cache_dir)
        cfg = dataclasses.replace(cfg, dataset_dir=args.dataset, model_dir=args.model)
    return cfg

def check_ports_free(host: str, ports) -> None:
    """The listen ports, probed before anything slow (the demo's first generation, the
    worker processes): a port another server holds was reported only once the workers had
    started. Errors other than a port in use or an address not this machine's are left to
    the start, which says them."""
    import errno
    import socket

    for port in ports:
        if not port or not 0 < port < 65536:  # 0: any free one; out of range: ServerConfig says so
            continue
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
        except socket.gaierror as exc:
            raise ConfigError(f"--host {host}: {exc.strerror}") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is in use (another server still running?)") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"--host {host} is not an address of this machine") from None
        finally:
            probe.close()


def run(args) -> int:
    from hybridgnn.serving.lifecycle import run as run_server
    from hybridgnn.telemetry.metrics import Telemetry

    cfg = build_config(args, probe_ports=True)
    return run_server(cfg, Telemetry(model=cfg.server.model_name))
