"""One rank of a distributed all-node precompute (Deal's layer-wise inference, 1-D partitioned).

Every rank holds its nodes' CSR rows and, per layer, its nodes' input rows plus the halo
rows its in-edges need; it computes its nodes' outputs and writes them into the same
layer files a single process writes. Layer outputs are exchanged, never recomputed; a
layer is recorded as done (state.json, by rank 0) only after every rank has flushed it,
and the store is marked complete last, so an interrupted run resumes at its first
unfinished layer and is never served as it stands.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from hybridgnn import __version__
from hybridgnn.distributed.agreement import check_agreement
from hybridgnn.distributed.halo import HaloPlan
from hybridgnn.distributed.partition import (
    compute_partition,
    load_partition,
    local_part,
    resolve_method,
)
from hybridgnn.embeddings.precompute import (
    DTYPES,
    BatchSizer,
    PrecomputeConfig,
    layer_batch,
    layer_dims,
    starting_state,
    unlink_mapped,
)
from hybridgnn.embeddings.store import (
    EmbeddingStore,
    embeddings_dir,
    features_fingerprint,
    mark_complete,
    write_state,
)
from hybridgnn.errors import ConfigError
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.decompose import decompose
from hybridgnn.runtime.ranks import join_group
from hybridgnn.updates.snapshot import model_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedConfig:
    partition: str = "auto"          # auto (METIS when pymetis is installed), metis, ranges
    timeout_s: float = 1800.0        # how long a collective waits for a slow rank
    chunk_bytes: int = 4 << 20       # halo rows per message, in bytes

    def __post_init__(self):
        if not (self.timeout_s > 0 and self.chunk_bytes > 0):  # NaN too
            raise ConfigError(f"need timeout_s > 0 and chunk_bytes > 0, got {self.timeout_s}, {self.chunk_bytes}")


@dataclass
class LayerReport:
    layer: int
    seconds: float = 0.0
    comm_wait_s: float = 0.0
    bytes_sent: int = 0
    rows: int = 0
    chunks: int = 0


def environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's (or the launcher's) environment."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"a distributed rank needs RANK and WORLD_SIZE in its environment: {exc}") from exc


def _own_rows(array: np.ndarray, nodes: np.ndarray) -> torch.Tensor:
    # ranges are one slice; scattered METIS parts read row by row through the mmap
    if len(nodes) and nodes[-1] - nodes[0] + 1 == len(nodes):
        rows = array[int(nodes[0]):int(nodes[-1]) + 1]
    else:
        rows = array[nodes]
    return torch.from_numpy(np.array(rows, dtype=np.float32))  # a copy: the mmap is read-only


def _write_rows(out: np.ndarray, nodes: np.ndarray, rows: np.ndarray) -> None:
    if len(nodes) and nodes[-1] - nodes[0] + 1 == len(nodes):
        out[int(nodes[0]):int(nodes[-1]) + 1] = rows
    else:
        out[nodes] = rows


def _rounded(y: torch.Tensor, dtype) -> torch.Tensor:
    """y as the layer file stores it, back in float32: what a single process reads next."""
    return y.float() if dtype == np.float32 else y.to(torch.float16).float()


def _open_layer(path: Path, rank: int, n: int, width: int, dtype) -> np.ndarray:
    """The layer file, created anew by rank 0 and opened by the others after a barrier."""
    if rank == 0:
        unlink_mapped(path)  # a server may map the old one: rewritten in place, its pages went (SIGBUS)
        np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(n, width)).flush()
    dist.barrier()
    return np.lib.format.open_memmap(path, mode="r+")


def run_rank(dataset: Path, model_dir: Path, cfg: PrecomputeConfig, dcfg: DistributedConfig,
             *, progress: bool = True) -> dict | None:
    """Run this process's rank to the end; rank 0 returns the run's report."""
    from hybridgnn.models.checkpoint import load_checkpoint

    rank, world, local_rank = environment()
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if local_rank >= (visible := torch.cuda.device_count()):
            raise ConfigError(f"--device cuda needs one GPU per rank on a machine: local rank {local_rank}, "
                              f"{visible} GPU(s) visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    join_group("nccl" if device.type == "cuda" else "gloo", rank, world, timedelta(seconds=dcfg.timeout_s))
    try:
        return _run(rank, world, device, dataset, model_dir, cfg, dcfg, progress, load_checkpoint)
    finally:
        dist.destroy_process_group()


def _run(rank, world, device, dataset, model_dir, cfg, dcfg, progress, load_checkpoint) -> dict | None:
    t_start = time.perf_counter()
    graph = GraphStore.open(dataset)
    model, _ = load_checkpoint(model_dir)
    if model.in_dim != graph.feature_dim:
        raise ConfigError(f"model expects {model.in_dim}-dim features, dataset has {graph.feature_dim}")
    method = resolve_method(dcfg.partition)
    features = features_fingerprint(graph)
    # the group's first collective, before rank 0 touches the store: ranks that differ here
    # would write other rows, or go out of step and wait out the timeout
    check_agreement({"hybridgnn": __version__, "ranks": world, "partition": method, "dataset": graph.fingerprint,
                     "features": features, "model": model_fingerprint(model_dir), "dtype": cfg.dtype,
                     "chunk_bytes": dcfg.chunk_bytes},
                    "precompute ranks", "give every rank the same --dataset, --model, --partition, --dtype and "
                    "--chunk-mb, with the same files on every machine, and the same hybridgnn")
    model = decompose(model).eval().to(device)
    root = embeddings_dir(model_dir, graph.fingerprint)
    dims = layer_dims(model, graph.feature_dim, device)
    plan_msg: list = [None]
    if rank == 0:  # one rank decides where to start and makes the partition; the rest follow
        root.mkdir(parents=True, exist_ok=True)
        state = starting_state(root, model.num_layers, dims, cfg, model_dir, features)
        if state.get("complete") and EmbeddingStore.for_graph(model_dir, graph) is None:
            (root / "state.json").unlink()  # complete but damaged (logged): computed again from scratch
            state = starting_state(root, model.num_layers, dims, cfg, model_dir, features)
        partition = None if state.get("complete") else compute_partition(graph, method, world, root)
        if not state.get("complete"):
            # before any layer file is rewritten: a complete store made with other settings
            # is no longer served, and a run that fails leaves no store marked complete
            write_state(root, state)
        plan_msg = [{"state": state}]
    dist.broadcast_object_list(plan_msg, src=0)
    state = plan_msg[0]["state"]
    if state.get("complete"):
        return {"embeddings": str(root), "already_complete": True} if rank == 0 else None
    if rank != 0:
        partition = load_partition(method, world, root, graph)
    part = local_part(graph, partition, rank)
    plan = HaloPlan(part, device)
    n, dtype = part.num_nodes, DTYPES[cfg.dtype]
    norm_degree = has_loop = None
    if model.gcn_normalised:  # whole-graph degrees: the halo's come from their owners
        own = torch.from_numpy((part.in_degree + ~part.has_loop).astype(np.int64)).unsqueeze(1).to(device)
        norm_degree = plan.gather(own).squeeze(1).cpu().numpy()
        has_loop = np.concatenate([part.has_loop, np.zeros(plan.halo_rows, dtype=bool)])
    # on the backend's device: an NCCL group has no backend for host tensors (a CPU tensor
    # here failed every `--device cuda` run with 'No backend type associated with device type cpu')
    totals = torch.tensor([part.remote_edges, n], dtype=torch.int64, device=device)
    dist.all_reduce(totals)
    first = state["layer"]
    source = graph.features if first == 0 else np.load(root / f"layer_{first}.npy", mmap_mode="r")
    rows = torch.empty(n + plan.halo_rows, source.shape[1], dtype=torch.float32, device=device)
    rows[:n] = _own_rows(source, part.nodes).to(device)
    scratch = np.full(n + plan.halo_rows, -1, dtype=np.int64)
    sizer = BatchSizer(cfg, device)
    reports = []
    for layer in range(first, model.num_layers):
        report = LayerReport(layer + 1)
        t_layer = time.perf_counter()
        out = _open_layer(root / f"layer_{layer + 1}.npy", rank, graph.num_nodes, dims[layer], dtype)
        nxt = torch.empty(n + plan.halo_rows, dims[layer], dtype=torch.float32, device=device)
        chunk_rows = max(1, dcfg.chunk_bytes // (rows.shape[1] * 4))
        transfer = plan.start(rows, chunk_rows)
        groups = plan.target_groups(transfer.chunks)

        def step(targets, layer=layer, rows=rows, out=out, nxt=nxt):
            y, num_sources, num_edges = layer_batch(model, layer, part, targets, rows, device, None, scratch,
                                                     norm_degree, has_loop)
            y = _rounded(y, dtype)
            nxt[torch.from_numpy(targets).to(device)] = y
            _write_rows(out, part.nodes[targets], y.cpu().numpy().astype(dtype, copy=False))
            return num_sources, num_edges

        with tqdm(total=n, desc=f"precompute layer {layer + 1}/{model.num_layers} (rank 0 of {world})",
                  unit="node", unit_scale=True, disable=not (progress and rank == 0)) as bar:
            for j, targets in enumerate(groups):
                if j > 0:  # chunk j-1 arrived (and those before it, awaited in order)
                    t_wait = time.perf_counter()
                    transfer.wait_chunk(j - 1)
                    report.comm_wait_s += time.perf_counter() - t_wait
                if len(targets):
                    # within a group, ascending ids keep a batch's rows close together
                    sizer.run(np.sort(targets), step, rows.shape[1], dims[layer],
                              lambda done, count, bar=bar: bar.update(count), label=f"layer {layer + 1}")
            t_wait = time.perf_counter()
            transfer.finish()
            report.comm_wait_s += time.perf_counter() - t_wait
        out.flush()
        del out
        report.seconds = time.perf_counter() - t_layer
        report.bytes_sent, report.rows, report.chunks = transfer.bytes_sent, plan.halo_rows, len(transfer.chunks)
        per_rank: list = [None] * world  # also a barrier: every rank's rows are in the file
        dist.all_gather_object(per_rank, report.__dict__)
        if rank == 0:  # only now does the layer count as done
            state = {**state, "layer": layer + 1, "done": 0,
                     "layer_s": [*state.get("layer_s", []), round(max(r["seconds"] for r in per_rank), 3)]}
            write_state(root, state)
            reports.append(per_rank)
            if progress:
                tqdm.write(_layer_line(per_rank), file=sys.stderr)
        rows = nxt
    if model.readout_needed:
        _readout(model, root, rank, part.nodes, graph.num_nodes, device, dtype)
        state = {**state, "output": True}
    if rank != 0:
        dist.barrier()
        return None
    state = mark_complete(root, {**state, "precompute_s": time.perf_counter() - t_start,
                                 "distributed": {"ranks": world, "partition": method}})
    dist.barrier()
    return _summary(root, graph, dims, state, method, world, int(totals[0]), reports)


def _readout(model, root: Path, rank: int, nodes: np.ndarray, n: int, device, dtype) -> None:
    """output.npy rows of this rank's nodes (jumping knowledge mixes every layer's rows)."""
    layers = [np.load(root / f"layer_{i + 1}.npy", mmap_mode="r") for i in range(model.num_layers)]
    with torch.inference_mode():
        width = model.readout([torch.zeros(1, a.shape[1], device=device) for a in layers]).shape[1]
    out = _open_layer(root / "output.npy", rank, n, width, dtype)
    with torch.inference_mode():
        y = model.readout([_own_rows(a, nodes).to(device) for a in layers])
    _write_rows(out, nodes, y.float().cpu().numpy().astype(dtype, copy=False))
    out.flush()
    dist.barrier()


def _layer_line(per_rank: list[dict]) -> str:
    sent = [r["bytes_sent"] for r in per_rank]
    return (f"layer {per_rank[0]['layer']}: {max(r['seconds'] for r in per_rank):.2f} s, "
            f"halo wait up to {max(r['comm_wait_s'] for r in per_rank):.2f} s, "
            f"sent {sum(sent) / 1e6:.1f} MB (per rank: {', '.join(f'{b / 1e6:.1f}' for b in sent)} MB)")


def _summary(root, graph, dims, state, method, world, cut_edges, reports) -> dict:
    layers = []
    for per_rank in reports:
        i = per_rank[0]["layer"]
        width_in = graph.feature_dim if i == 1 else dims[i - 2]
        layers.append({
            "layer": i,
            "seconds": round(max(r["seconds"] for r in per_rank), 3),
            "compute_s": [round(r["seconds"] - r["comm_wait_s"], 3) for r in per_rank],
            "comm_wait_s": [round(r["comm_wait_s"], 3) for r in per_rank],
            "bytes_sent": [r["bytes_sent"] for r in per_rank],
            "halo_rows": [r["rows"] for r in per_rank],
            # every rank sending every row it owns to every other rank
            "naive_bytes": (world - 1) * graph.num_nodes * width_in * 4,
        })
    return {"embeddings": str(root), "ranks": world, "partition": method,
            "edge_cut": {"edges": cut_edges, "fraction": round(cut_edges / max(graph.num_edges, 1), 4)},
            "layers": layers, "dims": dims, "precompute_s": round(state["precompute_s"], 2),
            "computed_unix_s": state["computed_unix_s"]}
