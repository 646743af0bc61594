"""`hybridgnn profile`: PSGS–latency curves per pipeline, the four operating points, a plot."""

from __future__ import annotations

import json
from pathlib import Path

from hybridgnn.capabilities import CPU_COUNT
from hybridgnn.cli.flags import DefaultsHelpFormatter, flag_parser, user_path
from hybridgnn.cli.outputs import check_out
from hybridgnn.cli.serve import (
    add_cpu_lane_flag,
    add_worker_processes_flag,
    on_off_auto,
)
from hybridgnn.config import (
    GRAPH_PLACEMENTS,
    DeviceMemoryConfig,
    PipelineConfig,
    env_default,
    parse_bytes,
)

DEFAULT_DIR = Path("profiles")  # the default --out's folder


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure latency against batch PSGS per pipeline; write a profile + plot",
                       description="Drives each pipeline of the server you would run (same flags as serve) closed "
                                   "loop, with batches spanning the PSGS range, until every PSGS bin has enough "
                                   "samples for a stable p99 or the time budget is spent. Fits monotone mean and "
                                   "p99 curves, finds the four operating points, and writes a JSON profile plus a "
                                   "PNG and SVG plot. Serve with it: hybridgnn serve --profile P --policy ...",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=user_path, default=env_default("DATASET", None, user_path),
                   help="dataset directory (default: the demo)")
    p.add_argument("--model", type=user_path, default=env_default("MODEL", None, user_path),
                   help="model directory (default: the demo)")
    p.add_argument("--fanouts", default=env_default("FANOUTS", None), help="per-hop fanouts (default: the model's)")
    p.add_argument("--out", type=user_path, default=None, help="profile path (default profiles/<dataset>-<model>.json)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "emulate"], default=env_default("DEVICE", "auto"),
                   help="pipelines to profile, as for serve (emulate: the GPU pipeline's code on CPU tensors)")
    p.add_argument("--workers", type=int, default=env_default("WORKERS", CPU_COUNT, int),
                   help="CPU pipeline workers")
    # as `serve` (and from the same HYBRIDGNN_<FLAG> variables): profiled and served workers run alike
    add_worker_processes_flag(p, env_default("WORKER_PROCESSES", "auto", on_off_auto))
    add_cpu_lane_flag(p)  # the CPU lane is profiled as it is served (split: CPU sampling + device time)
    p.add_argument("--other-lane-loaded", action="store_true",
                   help="with a split CPU lane: profile each lane beside the other's work on the GPU (the curves "
                        "then hold the contention); default: each alone, and slo:<ms> queues both lanes on one "
                        "simulated GPU")
    p.add_argument("--gpu-workers", type=int, default=env_default("GPU_WORKERS", PipelineConfig.workers, int),
                   help="GPU pipeline workers")
    p.add_argument("--gpu-cache-bytes", type=flag_parser(parse_bytes),
                   default=env_default("GPU_CACHE_BYTES", DeviceMemoryConfig.cache_bytes, flag_parser(parse_bytes)),
                   help="GPU feature cache, hottest rows by FAP (bytes)")
    p.add_argument("--graph-placement", choices=list(GRAPH_PLACEMENTS),
                   default=env_default("GRAPH_PLACEMENT", DeviceMemoryConfig.graph_placement),
                   help="where the GPU sampler reads the graph: pinned host memory (uva) or device memory")
    p.add_argument("--cpu-compute-device", default=env_default("CPU_COMPUTE_DEVICE", "cpu"),
                   help="where the CPU lane runs the model (as serve's flag)")
    p.add_argument("--bins", type=int, default=12, help="log-spaced PSGS bins")
    p.add_argument("--min-samples", type=int, default=100, help="batches per bin (for a stable p99)")
    p.add_argument("--max-batch", type=int, default=1024, help="largest batch (seeds)")
    p.add_argument("--budget-s", type=float, default=300.0, help="time limit per pipeline")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG/SVG plots")
    p.add_argument("--cache-dir", type=user_path, default=None,
                   help="the demo graph and model live in <this>/demo (default: HYBRIDGNN_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/hybridgnn, else ~/.cache/hybridgnn)")
    p.set_defaults(run=run)


def run(args) -> int:
    from hybridgnn.cli.serve import (
        check_cpu_compute_device,
        check_workers,
        cpu_lane_split,
        gpu_pipeline_config,
        worker_processes,
    )
    from hybridgnn.config import (
        SamplingConfig,
        ServeConfig,
        fanouts_for,
        parse_fanouts,
    )
    from hybridgnn.models.checkpoint import read_config
    from hybridgnn.profiling.profile import build_profile
    from hybridgnn.profiling.runner import ProfileConfig
    from hybridgnn.scheduler.policy import Profile

    if (args.dataset is None) != (args.model is None):
        raise ValueError("give both --dataset and --model, or neither (to profile the demo)")
    # Every flag is checked before the demo is made (its first generation takes ~30 s).
    check_workers(args)
    check_ranges(args)
    gpu = gpu_pipeline_config(args.device, args.gpu_workers)
    check_cpu_compute_device(args.cpu_compute_device)
    split = cpu_lane_split(args.cpu_lane, gpu, args.cpu_compute_device, False)
    cpu = PipelineConfig(name="cpu", device=args.cpu_compute_device, workers=args.workers, split=split,
                         processes=worker_processes(args.worker_processes, args.cpu_compute_device, False, split))
    gpu_memory = DeviceMemoryConfig(cache_bytes=args.gpu_cache_bytes, graph_placement=args.graph_placement)
    cfg = ProfileConfig(bins=args.bins, min_samples=args.min_samples, max_batch=args.max_batch,
                        budget_s=args.budget_s, other_lane_loaded=args.other_lane_loaded)
    if args.fanouts:
        parse_fanouts(args.fanouts)
    _check_outputs(args)
    if args.dataset is None:
        from hybridgnn.demo import ensure_demo

        args.dataset, args.model = ensure_demo(args.cache_dir)
    fanouts = fanouts_for(read_config(args.model), flag=args.fanouts)
    serve_cfg = ServeConfig(dataset_dir=args.dataset, model_dir=args.model, sampling=SamplingConfig(fanouts=fanouts),
                            cpu_pipeline=cpu, gpu_pipeline=gpu, gpu_memory=gpu_memory)
    profile = Profile(build_profile(serve_cfg, cfg))
    out = args.out or DEFAULT_DIR / f"{profile.data['dataset']['name']}-{profile.data['model']['kind']}.json"
    profile.save(out)
    written = [str(out)]
    if not args.no_plot:
        from hybridgnn.profiling.plot import plot_profile

        written += [str(p) for p in plot_profile(profile, out.with_suffix(""))]
    summary = {"written": written, "pipelines": {
        n: {k: p[k] for k in ("device", "workers", "samples", "complete")} for n, p in profile.data["pipelines"].items()}}
    if "points" in profile.data:
        summary["points"] = profile.data["points"]
    print(json.dumps(summary, indent=2))
    return 0


def check_ranges(args) -> None:
    """ProfileConfig's ranges in the flags' words (it named fields and printed itself)."""
    import math

    from hybridgnn.profiling.runner import MAX_BATCH, MAX_BINS

    if not 2 <= args.bins <= MAX_BINS:
        raise ValueError(f"--bins must be within [2, {MAX_BINS}], got {args.bins}")
    if args.min_samples < 1:
        raise ValueError(f"--min-samples must be at least 1, got {args.min_samples}")
    if not 1 <= args.max_batch <= MAX_BATCH:
        raise ValueError(f"--max-batch must be within [1, {MAX_BATCH}], got {args.max_batch}")
    if not 0 < args.budget_s < math.inf:
        raise ValueError(f"--budget-s must be a positive, finite number of seconds, got {args.budget_s}")


def _check_outputs(args) -> None:
    """The profile and its plots' paths, before profiling (minutes): the default's name
    needs the dataset and model, so only its folder is checked then."""
    if args.out is None:
        check_out(DEFAULT_DIR, directory=True)
        return
    check_out(args.out, directory=False)
    if not args.no_plot:
        from hybridgnn.profiling.plot import plot_paths

        for path in plot_paths(args.out.with_suffix("")):
            check_out(path, directory=False)
