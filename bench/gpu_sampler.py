"""GPU sampler against the CPU sampler, and feature-gather bandwidth per tier.

Sampler: sampled edges/s of the device sampler (TorchSampler with its CUDA kernels, over
the UVA-pinned graph and over a device-memory copy; and, as references over the device
copy, the per-hop kernel with host-side numbering and the torch-op hop; and, for batches
small enough, the one-launch sampler from seeds on the host against the batch kernels
from the same) against the compiled CPU sampler on one thread and on all
cores, for batch sizes 1 .. 4096 and fanouts 15,10,5 and 25,10 on the products-scale
graph, with the crossover batch size (the smallest batch where the device beats all
CPU cores). Gather: GB/s of the served feature-cache gather on all-hit ids (device
memory) and on all-miss ids (zero-copy reads of pinned host memory over UVA), plain
index_select on the same data, and, as the references they are compared with, a pinned
host→device memcpy and a device→device copy of the same bytes.

Without CUDA the device rows run the same code on CPU tensors and say so; the ratios
then compare two CPU implementations, not a GPU.

    .venv/bin/python bench/gpu_sampler.py [--seconds 1.5] [--batch-sizes 1,8,64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PRODUCTS, emit_report, ensure_products, machine, progress  # noqa: E402
from hybridgnn.capabilities import CPU_COUNT, HAS_CUDA  # noqa: E402
from hybridgnn.features.store import CachedFeatureStore  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.graph.uva import DeviceGraph  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402
from hybridgnn.sampling.gpu import TorchSampler  # noqa: E402


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(run, seconds: float) -> float:
    """Edges (or bytes) per second of `run()` (returns that count), repeated for ~seconds."""
    run()  # warm: compiled kernels, caches
    total, t0 = 0, time.perf_counter()
    while True:
        total += run()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return total / elapsed


def cpu_rate(graph, fanouts, batch, threads, seconds, rng) -> float:
    samplers = [CPUSampler(graph, fanouts, seed=i) for i in range(threads)]
    work = [rng.integers(0, graph.num_nodes, size=batch) for _ in range(64)]

    def one(k):
        return sum(samplers[k].sample(s).num_edges for s in work[k::threads])

    if threads == 1:
        return rate(lambda: one(0), seconds)
    pool = ThreadPoolExecutor(threads)
    try:
        return rate(lambda: sum(pool.map(one, range(threads))), seconds)
    finally:
        pool.shutdown()


def device_rate(dg: DeviceGraph, fanouts, batch, seconds, rng, kernel: bool | None = None,
                whole_batch: bool | None = None, host_seeds: bool = False) -> float:
    """whole_batch: force the all-kernel batch path on or off (None: as the environment says).
    host_seeds: seeds start on the host, as a served request's do (the one-launch sampler
    for small batches takes only those); otherwise they are on the device already."""
    if whole_batch is not None:
        saved = os.environ.get("HYBRIDGNN_CUDA_BATCH")
        os.environ["HYBRIDGNN_CUDA_BATCH"] = "1" if whole_batch else "0"
        try:
            return device_rate(dg, fanouts, batch, seconds, rng, kernel, host_seeds=host_seeds)
        finally:
            if saved is None:
                del os.environ["HYBRIDGNN_CUDA_BATCH"]
            else:
                os.environ["HYBRIDGNN_CUDA_BATCH"] = saved
    sampler = TorchSampler(dg.indptr, dg.indices, fanouts, kernel=kernel)
    work = [torch.from_numpy(rng.integers(0, dg.indptr.shape[0] - 1, size=batch)) for _ in range(16)]
    if not host_seeds:
        work = [w.to(dg.device) for w in work]

    def run():
        edges = sum(sampler.sample(s).num_edges for s in work)
        sync(dg.device)
        return edges

    return rate(run, seconds)


def gather_bandwidth(graph, dg: DeviceGraph, seconds: float) -> dict:
    """GB/s of the served gather paths (CachedFeatureStore.gather: one kernel on a GPU with
    CuPy) on all-hit and all-miss id sets, of plain index_select on the same data, and of
    the copies they are held against; bytes counted once (the rows delivered)."""
    feats = np.asarray(graph.features)
    device = dg.device
    row_bytes = feats.shape[1] * feats.itemsize
    # 2M rows (~800 MB at 100 floats): far past L2 and launch overhead
    n = min(2_000_000, graph.num_nodes)
    ids = torch.from_numpy(np.sort(np.random.default_rng(0).integers(0, graph.num_nodes, n))).to(device)
    out = {}
    host = dg.host_visible(feats) if device.type == "cuda" else torch.from_numpy(feats)
    cache = CachedFeatureStore(feats, device, n * row_bytes, host_table=host)  # nodes 0..n-1 cached
    no_cache = CachedFeatureStore(feats, device, 0, host_table=host)
    hot = torch.from_numpy(np.sort(np.random.default_rng(1).integers(0, n, n))).to(device)  # cached nodes

    def timed(fn, nbytes):
        def run():
            fn()
            sync(device)
            return nbytes
        return rate(run, seconds) / 1e9

    out["device_cache_gather_GBps"] = timed(lambda: cache.gather(hot), n * row_bytes)
    out["device_cache_index_select_GBps"] = timed(lambda: torch.index_select(cache.cache, 0, hot), n * row_bytes)
    out["zero_copy_gather_GBps"] = timed(lambda: no_cache.gather(ids), n * row_bytes)
    out["zero_copy_index_select_GBps"] = timed(lambda: torch.index_select(host, 0, ids), n * row_bytes)
    out["gather_kernel"] = bool(getattr(cache, "_one_kernel", False))
    block = torch.from_numpy(feats[:n].copy())
    if device.type == "cuda":
        pinned = block.pin_memory()
        dst = torch.empty_like(pinned, device=device)
        out["pinned_memcpy_GBps"] = timed(lambda: dst.copy_(pinned, non_blocking=True), n * row_bytes)
        src = pinned.to(device)
        out["device_copy_GBps"] = timed(lambda: dst.copy_(src), n * row_bytes)
        out["zero_copy_vs_pinned_memcpy"] = out["zero_copy_gather_GBps"] / out["pinned_memcpy_GBps"]
        out["cache_gather_vs_device_copy"] = out["device_cache_gather_GBps"] / out["device_copy_GBps"]
    else:
        dst = torch.empty_like(block)
        out["host_memcpy_GBps"] = timed(lambda: dst.copy_(block), n * row_bytes)
        out["zero_copy_vs_pinned_memcpy"] = out["zero_copy_gather_GBps"] / out["host_memcpy_GBps"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path, default=PRODUCTS)
    ap.add_argument("--seconds", type=float, default=1.5, help="timing window per measurement")
    ap.add_argument("--batch-sizes", default="1,8,64,256,1024,4096")
    ap.add_argument("--device", default="cuda" if HAS_CUDA else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not HAS_CUDA:
        sys.exit(f"{ap.prog}: --device {args.device}: CUDA is not available here (without it the device rows run on "
                 "CPU tensors: --device cpu, the default)")
    if args.dataset == PRODUCTS:
        ensure_products(args.dataset)
    graph = GraphStore.open(args.dataset)
    torch.set_num_threads(1 if device.type == "cpu" else CPU_COUNT)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    placements = {"uva": DeviceGraph(graph, device, "uva")}
    if device.type == "cuda":
        placements["gpu"] = DeviceGraph(graph, device, "gpu")
    report = {"machine": machine(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu (the GPU sampler's code on CPU tensors; no GPU in this run)",
              "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges}, "sampler": []}
    rng = np.random.default_rng(0)
    for fanouts in ((15, 10, 5), (25, 10)):
        crossover = None
        for b in batches:
            row = {"fanouts": list(fanouts), "batch": b,
                   "cpu_1_thread": cpu_rate(graph, fanouts, b, 1, args.seconds, rng),
                   f"cpu_{CPU_COUNT}_threads": cpu_rate(graph, fanouts, b, CPU_COUNT, args.seconds, rng)}
            for name, dg in placements.items():
                row[f"device_{name}"] = device_rate(dg, fanouts, b, args.seconds, rng)
            if "gpu" in placements:  # the paths the kernels replaced, as references
                row["device_gpu_torch_ops"] = device_rate(placements["gpu"], fanouts, b, args.seconds, rng, kernel=False)
                row["device_gpu_per_hop_kernel"] = device_rate(placements["gpu"], fanouts, b, args.seconds, rng,
                                                               whole_batch=False)
                small = TorchSampler(placements["gpu"].indptr, placements["gpu"].indices, fanouts)._small
                if small is not None and small.fits(b):  # from host seeds: one launch against the batch kernels
                    row["device_gpu_host_seeds_one_launch"] = device_rate(placements["gpu"], fanouts, b, args.seconds,
                                                                          rng, host_seeds=True)
                    saved = os.environ.get("HYBRIDGNN_CUDA_SMALL")
                    os.environ["HYBRIDGNN_CUDA_SMALL"] = "0"  # read when the sampler is made
                    try:
                        row["device_gpu_host_seeds_batch_kernels"] = device_rate(
                            placements["gpu"], fanouts, b, args.seconds, rng, host_seeds=True)
                    finally:
                        os.environ.pop("HYBRIDGNN_CUDA_SMALL")
                        if saved is not None:
                            os.environ["HYBRIDGNN_CUDA_SMALL"] = saved
                    row["device_one_launch_vs_batch_kernels"] = round(
                        row["device_gpu_host_seeds_one_launch"] / row["device_gpu_host_seeds_batch_kernels"], 2)
            best = max(row[f"device_{n}"] for n in placements)
            row["device_vs_cpu_1_thread"] = round(best / row["cpu_1_thread"], 2)
            row["device_vs_cpu_all"] = round(best / row[f"cpu_{CPU_COUNT}_threads"], 2)
            if crossover is None and row["device_vs_cpu_all"] > 1:
                crossover = b
            row = {k: (round(v / 1e6, 3) if isinstance(v, float) and "_vs_" not in k else v)
                   for k, v in row.items()}  # rates in M sampled edges/s
            progress(row)
            report["sampler"].append(row)
        report[f"crossover_batch_{'-'.join(map(str, fanouts))}"] = crossover
    report["gather"] = gather_bandwidth(graph, placements["uva"], args.seconds)
    for dg in placements.values():
        dg.close()
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
