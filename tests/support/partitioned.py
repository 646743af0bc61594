"""Real partition ranks for tests: spawned processes on gloo that serve a list of
requests with computation graph parallelism and write rank 0's answers to a file."""

from __future__ import annotations

import datetime
import os
import pickle
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridgnn.distributed.partition import compute_partition
from hybridgnn.distributed.serving_part import open_serving_part
from hybridgnn.embeddings.store import EmbeddingStore
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import load_checkpoint


def _rank(rank: int, world: int, init: str, dataset: str, model_dir: str, method: str, requests: list[dict],
          out: str, backend: str = "gloo") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hang fails, never stalls
    try:
        from hybridgnn.distributed.cgp import PartitionedEvaluator
        from hybridgnn.distributed.fetch import fetch_and_infer
        from hybridgnn.distributed.part_updates import PartUpdater
        from hybridgnn.errors import ServingError

        graph = GraphStore.open(dataset)
        model = load_checkpoint(Path(model_dir))[0]
        store = EmbeddingStore.open(Path(model_dir), graph.fingerprint)
        partition = compute_partition(graph, method, world, None)
        part = open_serving_part(graph, partition, rank, store.layers if store is not None else None,
                                 store.output if store is not None else None)
        ev = PartitionedEvaluator(part, model)
        updater = PartUpdater(ev)
        answers = []
        for req in requests:
            if "update" in req:
                try:
                    res = updater.apply(req["update"])
                except ServingError as exc:  # a refused batch: every rank refuses it alike
                    res = exc
            elif "lookup" in req:
                res = ev.lookup(req["lookup"])
            elif "ids" in req:
                res = ev.infer_existing(req["ids"], count_bytes=True)
            else:
                res = ev.infer_new(req["features"], req["edge_index"], mode=req["mode"], gamma=req.get("gamma", 0.1),
                                   fanouts=req.get("fanouts"), count_bytes=True)
                if req.get("fetch"):
                    res = (res, *fetch_and_infer(part, model, ev.coll, req["features"], req["edge_index"],
                                                 mode=req["mode"], gamma=req.get("gamma", 0.1),
                                                 fanouts=req.get("fanouts")))
            answers.append(res)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(answers))
    finally:
        dist.destroy_process_group()


def serve_partitioned(tmp: Path, dataset: Path, model_dir: Path, world: int, requests: list[dict],
                      method: str = "ranges", backend: str = "gloo") -> list:
    """Rank 0's PartitionedResult for each request, from `world` spawned ranks; with
    "fetch" in a request, (that, the fetching baseline's NewNodeResult, its bytes); with
    "update" (an UpdateBatch), PartUpdater's report or the error refusing it; with
    "lookup" (ids), the precomputed rows. backend nccl: one GPU per rank."""
    init = f"file://{tmp / f'rendezvous-{os.getpid()}-{world}-{method}-{backend}'}"
    out = tmp / f"answers-{world}-{method}-{backend}.pkl"
    mp.start_processes(_rank, args=(world, init, str(dataset), str(model_dir), method, requests, str(out), backend),
                       nprocs=world, join=True, start_method="spawn")
    return pickle.loads(out.read_bytes())


def random_query(num_nodes: int, feature_dim: int, q: int, edges_per_query: int, seed: int):
    """q query nodes, each linked to distinct existing nodes, plus one edge between queries."""
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((q, feature_dim)).astype(np.float32)
    edges = [(num_nodes + i, int(j)) for i in range(q)
             for j in rng.choice(num_nodes, size=edges_per_query, replace=False)]
    if q > 1:
        edges.append((num_nodes, num_nodes + 1))
    return feats, np.array(edges, dtype=np.int64).T


def torchrun_ranks(dataset: Path, model_dir: Path, *extra: str):
    """Two `hybridgnn rank` processes under torchrun, rank 0 listening on a free local port
    (its own session, so a test can stop the group whole): (torchrun's Popen, the address
    for `serve --ranks`). extra: more torchrun flags (--max-restarts 2)."""
    import subprocess
    import sys

    from tests.support.server import free_port

    listen = f"127.0.0.1:{free_port()}"
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *extra,
         "--master-port", str(free_port()), "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "rank",
         "--dataset", str(dataset), "--model", str(model_dir), "--listen", listen, "--partition", "ranges"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return torchrun, listen
