"""CPU sampler throughput (sampled edges/s) at batch 1024 on the products-scale graph,
per core and with threads, against PyG's torch-sparse sampler when it is installed.

    .venv/bin/python bench/sampler.py [--batches 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PRODUCTS, ensure_products, machine, strict_json  # noqa: E402
from hybridgnn.capabilities import CPU_COUNT  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402


def ours(graph, fanouts, batches, batch_size, threads):
    samplers = [CPUSampler(graph, fanouts, seed=i) for i in range(threads)]
    rng = np.random.default_rng(0)
    work = [rng.integers(0, graph.num_nodes, size=batch_size) for _ in range(batches)]
    samplers[0].sample(work[0])  # compile outside the timing

    def run(k):
        return sum(samplers[k].sample(seeds).num_edges for seeds in work[k::threads])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        edges = sum(pool.map(run, range(threads)))
    return edges / (time.perf_counter() - t0)


def pyg_torch_sparse(graph, fanouts, batches, batch_size):
    try:
        import torch_sparse  # noqa: F401
    except ImportError:
        return None
    torch.set_num_threads(1)
    rowptr = torch.from_numpy(np.asarray(graph.indptr, dtype=np.int64))
    col = torch.from_numpy(np.asarray(graph.indices, dtype=np.int64))
    rng = np.random.default_rng(0)
    work = [torch.from_numpy(rng.integers(0, graph.num_nodes, size=batch_size)) for _ in range(batches)]
    sample = torch.ops.torch_sparse.neighbor_sample
    sample(rowptr, col, work[0], list(fanouts), False, True)
    t0 = time.perf_counter()
    edges = 0
    for seeds in work:
        node, row, colv, edge = sample(rowptr, col, seeds, list(fanouts), False, True)
        edges += int(row.numel())
    return edges / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", type=Path, default=PRODUCTS)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=1024)
    args = ap.parse_args()
    if args.dataset == PRODUCTS:
        ensure_products(args.dataset)
    graph = GraphStore.open(args.dataset)
    report = {"machine": machine(), "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges},
              "batch_size": args.batch_size, "results": []}
    for fanouts in ((15, 10, 5), (25, 10)):
        row = {"fanouts": list(fanouts)}
        ours(graph, fanouts, args.batches, args.batch_size, 1)  # warm the page cache first
        one = ours(graph, fanouts, args.batches, args.batch_size, 1)
        row["ours_edges_per_s_1_thread"] = round(one)
        for t in sorted({2, CPU_COUNT}):
            if t > 1:
                rate = ours(graph, fanouts, args.batches, args.batch_size, t)
                row[f"ours_edges_per_s_{t}_threads"] = round(rate)
                row[f"thread_scaling_{t}"] = round(rate / one, 2)
        pyg = pyg_torch_sparse(graph, fanouts, args.batches, args.batch_size)
        if pyg is not None:
            row["pyg_torch_sparse_edges_per_s_1_thread"] = round(pyg)
            row["ratio_ours_vs_pyg_per_core"] = round(one / pyg, 2)
        else:
            row["pyg_torch_sparse"] = "not installed (pip install --no-build-isolation torch-scatter torch-sparse)"
        report["results"].append(row)
    print(strict_json(report))


if __name__ == "__main__":
    main()
