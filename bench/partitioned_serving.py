"""Serving a partitioned graph: computation graph parallelism (CGP) against rank 0 fetching
every edge list, degree and row it reads from the owners (the baseline Reforge compares
with), on the same ranks, the same requests, in one run.

For N = 2 and 3 ranks (METIS when pymetis is installed): per new-node mode (srpe with
γ = 0.1, pe, full, sampled with fanouts 10,10,10), the bytes all ranks send per request and p50/p99 latency of both
ways, each request served both ways back to back; and the memory a rank holds (its edges,
feature rows, precomputed rows) ÷ one process holding the whole graph and embeddings.
A request is one new node linked to a random node and up to 9 of its neighbours, as a
new member joins friends of friends.

    .venv/bin/python bench/partitioned_serving.py [--nodes 50000] [--requests 60] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DATA, emit_report, machine  # noqa: E402
from hybridgnn.distributed.partition import metis_available  # noqa: E402
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute  # noqa: E402
from hybridgnn.embeddings.store import EmbeddingStore  # noqa: E402
from hybridgnn.graph.generate import generate_csbm  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.checkpoint import save_checkpoint  # noqa: E402
from hybridgnn.models.gnn import GNN, ModelSpec  # noqa: E402

MODES = (("srpe", {"gamma": 0.1}), ("pe", {"gamma": 0.0}), ("full", {}), ("sampled", {"fanouts": (10, 10, 10)}))
WARMUP = 3  # the first requests of each mode warm caches and allocators: not measured


def make_requests(graph: GraphStore, count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    n = graph.num_nodes
    out = []
    for _ in range(count):
        v = int(rng.integers(n))
        friends = indices[indptr[v]:indptr[v + 1]]
        friends = rng.choice(friends, size=min(9, len(friends)), replace=False) if len(friends) else friends
        targets = np.unique(np.concatenate([[v], friends]))
        feats = rng.standard_normal((1, graph.feature_dim)).astype(np.float32)
        out.append((feats, np.stack([np.full(len(targets), n), targets]).astype(np.int64)))
    return out


def _rank(rank, world, init, dataset, model_dir, method, requests, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hybridgnn.distributed.cgp import PartitionedEvaluator
    from hybridgnn.distributed.fetch import fetch_and_infer
    from hybridgnn.distributed.partition import compute_partition
    from hybridgnn.distributed.serving_part import open_serving_part
    from hybridgnn.models.checkpoint import load_checkpoint

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hang fails, never stalls
    graph = GraphStore.open(dataset)
    model = load_checkpoint(Path(model_dir))[0]
    store = EmbeddingStore.open(Path(model_dir), graph.fingerprint)
    partition = compute_partition(graph, method, world, Path(model_dir))
    part = open_serving_part(graph, partition, rank, store.layers)
    ev = PartitionedEvaluator(part, model)
    memory = [None] * world
    dist.all_gather_object(memory, part.memory_bytes())
    rows = []
    for mode, kw in MODES:
        for i, (feats, ei) in enumerate(requests):
            dist.barrier()
            t0 = time.perf_counter()
            cgp = ev.infer_new(feats, ei, mode=mode, count_bytes=True, **kw)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            fetched, fetched_bytes = fetch_and_infer(part, model, ev.coll, feats, ei, mode=mode, **kw)
            t3 = time.perf_counter()
            if rank == 0 and i >= WARMUP:
                diff = float(np.abs(cgp.logits - fetched.logits).max())
                rows.append({"mode": mode, "cgp_s": t1 - t0, "fetch_s": t3 - t2, "cgp_bytes": cgp.bytes_moved,
                             "fetch_bytes": fetched_bytes, "diff": diff})
    if rank == 0:
        Path(out).write_bytes(pickle.dumps({"rows": rows, "memory": memory}))
    dist.destroy_process_group()


def summarise(rows: list[dict], mode: str) -> dict:
    mine = [r for r in rows if r["mode"] == mode]
    cgp = np.array([r["cgp_s"] for r in mine]) * 1e3
    fetch = np.array([r["fetch_s"] for r in mine]) * 1e3
    cb = np.array([r["cgp_bytes"] for r in mine], dtype=np.float64)
    fb = np.array([r["fetch_bytes"] for r in mine], dtype=np.float64)
    return {
        "mode": mode, "requests": len(mine),
        "cgp_ms": {"p50": round(float(np.percentile(cgp, 50)), 2), "p99": round(float(np.percentile(cgp, 99)), 2)},
        "fetch_ms": {"p50": round(float(np.percentile(fetch, 50)), 2),
                     "p99": round(float(np.percentile(fetch, 99)), 2)},
        "latency_cgp_vs_fetch": {"p50": round(float(np.percentile(cgp, 50) / np.percentile(fetch, 50)), 3),
                                 "p99": round(float(np.percentile(cgp, 99) / np.percentile(fetch, 99)), 3)},
        "kB_per_request": {"cgp": round(float(cb.mean()) / 1e3, 1), "fetch": round(float(fb.mean()) / 1e3, 1)},
        "bytes_cgp_vs_fetch": round(float(cb.sum() / fb.sum()), 3),
        "max_abs_diff_cgp_vs_fetch": float(max(r["diff"] for r in mine)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=50_000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.requests <= WARMUP:  # else no request is measured and the summary fails at the end
        ap.error(f"--requests {args.requests}: the first {WARMUP} of each mode only warm up; give more")
    import torch.multiprocessing as mp

    dataset = DATA / f"csbm-communities-{args.nodes}"
    if not (dataset / "meta.json").is_file():
        generate_csbm(dataset, num_nodes=args.nodes, num_classes=16, feature_dim=100, avg_degree=20,
                      feature_signal=0.3, seed=0)
    graph = GraphStore.open(dataset)
    work = DATA / "partitioned-bench"
    model_dir = work / "model"
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", graph.feature_dim, args.hidden, 16, num_layers=3)).eval()
    save_checkpoint(model, model_dir)
    store = precompute(graph, model, model_dir, PrecomputeConfig(), progress=False)
    whole = (np.asarray(graph.indptr).nbytes + np.asarray(graph.indices).nbytes
             + np.asarray(graph.features).nbytes + sum(np.asarray(a).nbytes for a in store.layers))
    method = "metis" if metis_available() else "ranges"
    requests = make_requests(graph, args.requests, seed=1)
    report: dict = {"machine": machine(), "graph": {"name": dataset.name, "nodes": graph.num_nodes,
                                                    "edges": graph.num_edges, "feature_dim": graph.feature_dim},
                    "model": f"GraphSAGE 3 layers, hidden {args.hidden}", "partition": method, "runs": []}
    for world in (int(w) for w in args.ranks.split(",")):
        out = work / f"answers-{world}.pkl"
        init = f"file://{work / f'rendezvous-{world}-{time.time_ns()}'}"
        mp.start_processes(_rank, args=(world, init, str(dataset), str(model_dir), method, requests, str(out)),
                           nprocs=world, join=True, start_method="spawn")
        got = pickle.loads(out.read_bytes())
        run = {"ranks": world, "modes": [summarise(got["rows"], mode) for mode, _ in MODES],
               "memory_per_rank_vs_one_process": [round(m / whole, 3) for m in got["memory"]],
               "one_process_MB": round(whole / 1e6, 1)}
        report["runs"].append(run)
        for row in run["modes"]:
            print(f"{world} ranks {row['mode']}: bytes CGP/fetch {row['bytes_cgp_vs_fetch']}, "
                  f"p50 {row['cgp_ms']['p50']} vs {row['fetch_ms']['p50']} ms, "
                  f"p99 {row['cgp_ms']['p99']} vs {row['fetch_ms']['p99']} ms", flush=True)
        print(f"{world} ranks: memory per rank / one process {run['memory_per_rank_vs_one_process']}", flush=True)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
