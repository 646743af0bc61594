"""Each lane's fixed cost per batch, as served: the time of a batch of one seed (and a
few other small sizes) through the GPU lane (sample, gather and model on the device),
the split CPU lane (sample on a CPU worker, then gather and model on the device: Quiver's)
and the CPU-model lane (everything on the CPU), with the ratio of each to the GPU lane.
On a GPU the GPU lane runs three times: without and with CUDA graphs for the model's
forward (gpu, gpu_graphs: pipelines/graphed.py), whatever HYBRIDGNN_CUDA_GRAPHS says, and
with graphs but small batches sampled by the batch kernels instead of one launch
(gpu_graphs_batch_kernels: HYBRIDGNN_CUDA_SMALL=0); the split lane runs as the environment
sets it. Target on a GPU: the GPU lane's one-seed batch of
three hops <= 0.5 ms (gpu_lane_one_seed_ms: the faster of the two GPU-lane runs). Each
size also reports the median of each stage as the executor timed it (sample, gather,
compute: the model and the copy of the results to the host), which says where it goes.

Without CUDA the device lanes run their code on CPU tensors (--device emulate) and the
report says so: the ratios then measure code paths, not a GPU.

    .venv/bin/python bench/lane_cost.py [--heavy] [--sizes 1,4,16] [--batches 200] [--out F]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, heavy_setup, machine  # noqa: E402
from hybridgnn.capabilities import HAS_CUDA  # noqa: E402
from hybridgnn.config import PipelineConfig, SamplingConfig, ServeConfig, fanouts_for  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.models.checkpoint import read_config  # noqa: E402
from hybridgnn.runtime.resources import Resources  # noqa: E402

# Each GPU-lane run sets these (the others keep the environment's): gpu_graphs_batch_kernels
# samples small batches with the batch kernels instead of one launch (sampling/cuda_small.py).
LANE_SWITCHES = {
    "gpu": {"HYBRIDGNN_CUDA_GRAPHS": "0"},
    "gpu_graphs": {"HYBRIDGNN_CUDA_GRAPHS": "1"},
    "gpu_graphs_batch_kernels": {"HYBRIDGNN_CUDA_GRAPHS": "1", "HYBRIDGNN_CUDA_SMALL": "0"},
}
_ENVIRONMENT = {name: os.environ.get(name) for switches in LANE_SWITCHES.values() for name in switches}


def set_switches(switches: dict[str, str]) -> None:
    for name, original in _ENVIRONMENT.items():
        value = switches.get(name, original)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def per_batch_ms(executor, batches: list[np.ndarray], sync) -> tuple[list[float], dict[str, list[float]]]:
    """Each batch's wall time, and its stages as the executor timed them (ms)."""
    times, stages = [], {"sample": [], "gather": [], "compute": []}
    for seeds in batches:
        t0 = time.perf_counter()
        t = executor.run(seeds).timings
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        for name in stages:
            stages[name].append(getattr(t, f"{name}_s") * 1e3)
    return times, stages


def _over(lanes: dict, lane: str, peer: str) -> dict | None:
    """Median of `lane` ÷ median of `peer`, per size (None unless both ran)."""
    if lane not in lanes or peer not in lanes:
        return None
    return {size: round(lanes[lane][size]["median_ms"] / lanes[peer][size]["median_ms"], 3) for size in lanes[lane]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heavy", action="store_true", help="products-scale graph, 3-layer SAGE of width 256")
    ap.add_argument("--sizes", default="1,4,16", help="seeds per batch")
    ap.add_argument("--batches", type=int, default=200, help="timed batches per size and lane (after 20 warm-up)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dataset, model_dir = heavy_setup() if args.heavy else ensure_demo()
    fanouts = fanouts_for(read_config(model_dir))
    device = "cuda" if HAS_CUDA else "cpu"
    sync = torch.cuda.synchronize if HAS_CUDA else (lambda: None)
    lanes, captured = {}, None
    runs = [("gpu", False), ("split_cpu", True), ("cpu_model", False)]
    if HAS_CUDA:
        runs[1:1] = [("gpu_graphs", False), ("gpu_graphs_batch_kernels", False)]
    for lane, split in runs:
        set_switches(LANE_SWITCHES.get(lane, {}))  # executors and samplers read them when they are made
        cfg = ServeConfig(dataset_dir=dataset, model_dir=model_dir, sampling=SamplingConfig(fanouts),
                          cpu_pipeline=PipelineConfig(workers=1, split=split),
                          gpu_pipeline=PipelineConfig(name="gpu", device=device, workers=1))
        resources = Resources.open(cfg)
        executor = resources.make_executor("gpu" if lane.startswith("gpu") else "cpu", 0, in_process=True)
        rng = np.random.default_rng(0)
        rows = {}
        try:
            for size in (int(s) for s in args.sizes.split(",")):
                batches = [rng.integers(0, resources.graph.num_nodes, size, dtype=np.int64)
                           for _ in range(args.batches + 20)]
                per_batch_ms(executor, batches[:20], sync)
                times, stages = per_batch_ms(executor, batches[20:], sync)
                rows[str(size)] = {"median_ms": round(float(np.median(times)), 4),
                                   "p99_ms": round(float(np.quantile(times, 0.99)), 4),
                                   "stage_median_ms": {k: round(float(np.median(v)), 4) for k, v in stages.items()}}
                print(lane, size, rows[str(size)], flush=True)
            if lane == "gpu_graphs":
                captured = getattr(executor.forward, "captured", None)
        finally:
            if hasattr(executor, "close"):
                executor.close()
            resources.close()
        lanes[lane] = rows
    ratios = {lane: {size: round(lanes[lane][size]["median_ms"] / lanes["gpu"][size]["median_ms"], 3)
                     for size in lanes["gpu"]} for lane in lanes if lane != "gpu"}
    one = min((lanes[lane].get("1", {}).get("median_ms") for lane in ("gpu", "gpu_graphs") if lane in lanes),
              key=lambda v: float("inf") if v is None else v)
    emit_report({"machine": machine(), "device": device if HAS_CUDA else "emulate (no GPU: device code on CPU tensors)",
                 "dataset": str(dataset), "fanouts": list(fanouts), "lanes_ms_per_batch": lanes,
                 "vs_gpu_lane_median": ratios, "gpu_lane_one_seed_ms": one,
                 "graphs_over_eager_median": ratios.get("gpu_graphs"), "graph_buckets_captured": captured,
                 "one_launch_over_batch_kernels_median": _over(lanes, "gpu_graphs", "gpu_graphs_batch_kernels"),
                 "gpu_lane_one_seed_within_0_5_ms": (one is not None and one <= 0.5) if HAS_CUDA else None}, args.out)


if __name__ == "__main__":
    main()
