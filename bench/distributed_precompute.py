"""Distributed all-node precompute (`hybridgnn precompute --nprocs N`) against one process,
same graph, same model, same run.

1. Exactness: the stores of N = 2, 3 and 4 ranks against one process's (max abs difference).
2. The cost of distribution on this machine: N = 2 ranks of one thread each ÷ one process
   of two threads, seconds per layer (each layer's slowest rank).
3. Bytes sent per layer: METIS ÷ contiguous ranges, and each ÷ the naive exchange (every
   rank sends every row it owns to every other rank), on a products-like power-law graph and
   on a graph with communities (CSBM).
4. A simulated scale-out to a 100M-node, 2B-edge graph: per-layer time from the core-seconds
   per edge measured here, halo rows per rank from a random-cut model scaled by the measured
   METIS reduction, and a stated network bandwidth.

    .venv/bin/python bench/distributed_precompute.py [--nodes 200000] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DATA, emit_report, ensure_graph, machine, progress  # noqa: E402
from hybridgnn.distributed.partition import metis_available  # noqa: E402
from hybridgnn.embeddings.store import EmbeddingStore  # noqa: E402
from hybridgnn.graph.generate import generate_csbm  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.checkpoint import save_checkpoint  # noqa: E402
from hybridgnn.models.gnn import GNN, ModelSpec  # noqa: E402


def run_precompute(dataset: Path, model: Path, *flags: str, threads: int) -> tuple[dict, float]:
    """(store state or distributed report, wall seconds) of one `hybridgnn precompute` run."""
    shutil.rmtree(model / "embeddings", ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "precompute",
                          "--dataset", str(dataset), "--model", str(model), *flags],
                         capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"precompute {' '.join(flags)} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout), wall


def store_of(model: Path, graph: GraphStore) -> list[np.ndarray]:
    return [np.array(a) for a in EmbeddingStore.open(model, graph.fingerprint).layers]


def layer_seconds(model: Path, graph: GraphStore) -> list[float]:
    return EmbeddingStore.open(model, graph.fingerprint).state["layer_s"]


def simulate(core_s_per_edge: list[float], widths: list[int], metis_factor: float, nodes: float, edges: float,
             cores_per_rank: int, gbit_s: float, ranks: list[int]) -> list[dict]:
    """Per-layer time = max(compute, halo transfer) (they overlap), summed over layers.
    Halo rows per rank under a random cut: the distinct remote sources of a rank's E/N
    in-edges among the V(1-1/N) remote nodes; METIS scales them by the measured factor.
    Memory: a rank's input and output rows of the widest layer, halo included."""
    bandwidth = gbit_s * 1e9 / 8
    rows = []
    for n in ranks:
        remote_nodes = nodes * (1 - 1 / n)
        remote_edges = edges / n * (1 - 1 / n)
        halo = remote_nodes * (1 - math.exp(-remote_edges / remote_nodes)) * metis_factor if n > 1 else 0.0
        total = comm_total = compute_total = 0.0
        for c, width in zip(core_s_per_edge, widths, strict=True):
            compute = edges / n * c / cores_per_rank
            comm = halo * width * 4 / bandwidth
            total += max(compute, comm)
            compute_total += compute
            comm_total += comm
        rows.append({"gbit_s": gbit_s, "ranks": n, "halo_rows_per_rank_M": round(halo / 1e6, 1),
                     "rows_memory_per_rank_GB": round((nodes / n + halo) * 2 * max(widths) * 4 / 1e9, 1),
                     "compute_s": round(compute_total, 1), "transfer_s": round(comm_total, 1),
                     "time_s": round(total, 1), "bound": "network" if comm_total > compute_total else "compute"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=200_000)
    ap.add_argument("--avg-degree", type=float, default=25.0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--gbit-s", default="25,100", help="network bandwidths of the simulated cluster (per rank)")
    ap.add_argument("--cores-per-rank", type=int, default=32, help="cores of one simulated rank (machine)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    partitions = ["ranges", "metis"] if metis_available() else ["ranges"]
    products = DATA / f"products-like-{args.nodes}"
    ensure_graph(products, ["--num-nodes", str(args.nodes), "--avg-degree", str(args.avg_degree),
                            "--feature-dim", "100", "--seed", "0"])
    communities = DATA / f"csbm-communities-{args.nodes // 4}"
    if not (communities / "meta.json").is_file():
        generate_csbm(communities, num_nodes=args.nodes // 4, num_classes=16, feature_dim=100, avg_degree=20,
                      feature_signal=0.3, seed=0)
    work = DATA / "distributed-bench"
    shutil.rmtree(work, ignore_errors=True)
    report: dict = {"machine": machine(), "graph": {}, "model": f"GraphSAGE 3 layers, hidden {args.hidden}"}
    graph = GraphStore.open(products)
    report["graph"] = {"nodes": graph.num_nodes, "edges": graph.num_edges, "feature_dim": graph.feature_dim}
    torch.manual_seed(0)
    model_dir = work / "model"
    save_checkpoint(GNN(ModelSpec("sage", 100, args.hidden, 47, num_layers=3)).eval(), model_dir)

    single, single_wall = run_precompute(products, model_dir, threads=2)
    expected, single_layers = store_of(model_dir, graph), layer_seconds(model_dir, graph)
    print(f"one process, 2 threads: layers {single_layers} s", flush=True)
    exact, runs = {}, {}
    for ranks in (2, 3, 4):
        for part in partitions:
            got, wall = run_precompute(products, model_dir, "--nprocs", str(ranks), "--partition", part,
                                       "--threads-per-rank", "1", threads=1)
            runs[(ranks, part)] = got
            diff = max(float(np.abs(a - b).max()) for a, b in zip(store_of(model_dir, graph), expected, strict=True))
            exact[f"{ranks} ranks, {part}"] = diff
            print(f"{ranks} ranks ({part}): layers {[lay['seconds'] for lay in got['layers']]} s, "
                  f"max abs diff {diff:.2e}, cut {got['edge_cut']['fraction']}", flush=True)
    two = runs[(2, partitions[-1])]
    report["exactness_max_abs"] = exact
    report["two_ranks_vs_one_process"] = {
        "partition": partitions[-1],
        "one_process_layer_s": single_layers,
        "two_ranks_layer_s": [lay["seconds"] for lay in two["layers"]],
        "ratio_per_layer": [round(lay["seconds"] / s, 3) for lay, s in zip(two["layers"], single_layers, strict=True)],
        "ratio_total": round(sum(lay["seconds"] for lay in two["layers"]) / sum(single_layers), 3),
        "target": "<= 1.3",
    }

    def bytes_table(runs_of: dict, name: str) -> list[dict]:
        rows = []
        for ranks in (2, 3, 4):
            row = {"graph": name, "ranks": ranks}
            for part in partitions:
                r = runs_of[(ranks, part)]
                sent = [sum(lay["bytes_sent"]) for lay in r["layers"]]
                row[f"{part}_MB"] = [round(b / 1e6, 1) for b in sent]
                row[f"{part}_vs_naive"] = round(sum(sent) / sum(lay["naive_bytes"] for lay in r["layers"]), 3)
                row[f"{part}_cut"] = r["edge_cut"]["fraction"]
            if "metis" in partitions:
                row["metis_vs_ranges"] = round(sum(sum(lay["bytes_sent"]) for lay in runs_of[(ranks, "metis")]["layers"])
                                               / sum(sum(lay["bytes_sent"]) for lay in runs_of[(ranks, "ranges")]["layers"]), 3)
            rows.append(row)
        return rows

    table = bytes_table(runs, "products-like")
    cgraph = GraphStore.open(communities)
    cmodel = work / "model-csbm"
    save_checkpoint(GNN(ModelSpec("sage", 100, args.hidden, 16, num_layers=3)).eval(), cmodel)
    cruns = {}
    for ranks in (2, 3, 4):
        for part in partitions:
            cruns[(ranks, part)], _ = run_precompute(communities, cmodel, "--nprocs", str(ranks), "--partition", part,
                                                     "--threads-per-rank", "1", threads=1)
    table += bytes_table(cruns, f"csbm ({cgraph.num_nodes} nodes, 16 communities)")
    report["bytes_per_layer"] = table
    for row in table:
        progress(row)

    # core-seconds per edge per layer, from the one-process run (2 threads)
    widths = [100, args.hidden, args.hidden]
    core_s = [s * 2 / graph.num_edges for s in single_layers]
    factor = min(1.0, table[2].get("metis_vs_ranges", 1.0))  # products-like, 4 ranks
    report["scale_out"] = {
        "graph": "100M nodes, 2B edges, same model",
        "assumptions": f"{args.cores_per_rank} cores per rank scaling linearly, {args.gbit_s} Gbit/s per rank, "
                       f"halo transfer overlapping compute, METIS halo factor {factor} (measured, 4 ranks)",
        "core_s_per_edge": [float(f"{c:.3g}") for c in core_s],
        "rows": [row for gbit in args.gbit_s.split(",")
                 for row in simulate(core_s, widths, factor, 1e8, 2e9, args.cores_per_rank, float(gbit),
                                     [1, 2, 4, 8, 16, 32, 64, 128, 256])],
    }
    report["single_process_wall_s"] = round(single_wall, 1)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
