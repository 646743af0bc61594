"""Layer-wise full-graph inference (DGI): layer by layer, all nodes in large batches, each
batch needing only its targets' 1-hop inputs and the previous layer's outputs.

Equals node-wise inference over full neighbourhoods: SAGE and GAT layers take the
(source, target) block directly; GCN gets its normalisation from whole-graph degrees
(PyG's gcn_norm: deg = in-degree + 1) instead of the block's. Outputs go to memory-mapped
arrays; progress is checkpointed after each batch, so an interrupted run resumes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from hybridgnn.config import read_json
from hybridgnn.embeddings.store import (
    EmbeddingStore,
    check_weights,
    embeddings_dir,
    features_fingerprint,
    mark_complete,
    stored_array,
    weights_of,
    write_state,
    writing_store,
)
from hybridgnn.graph.csr import gather_rows
from hybridgnn.graph.degrees import self_loops
from hybridgnn.graph.host import host_tensor
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.decompose import decompose
from hybridgnn.models.gnn import GNN, gcn_edge_weights

log = logging.getLogger(__name__)
DTYPES = {"float32": np.float32, "float16": np.float16}
ORDERS = ("natural", "rcm")
BLOCKS = ("auto", "host", "device")


@dataclass(frozen=True)
class PrecomputeConfig:
    batch_size: int = 16384  # targets per batch to start with; adapts
    max_batch_size: int = 1 << 20
    dtype: str = "float32"
    device: str = "cpu"
    order: str = "natural"  # "rcm": reverse Cuthill-McKee, so a batch's targets share inputs
    memory_budget_bytes: int = 0  # 0: a quarter of available memory (host) or of free GPU memory
    # Where 1-hop blocks are built and inputs gathered: "host" (numpy, then copied),
    # "device" (torch ops on `device`, the CSR and the previous layer held there), or
    # "auto" (device on a GPU when the CSR and the widest layer fit in half its free memory).
    blocks: str = "auto"

    def __post_init__(self):
        if self.batch_size < 1 or self.max_batch_size < self.batch_size:
            raise ValueError(f"need 1 <= batch_size <= max_batch_size, got {self.batch_size}, {self.max_batch_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.blocks not in BLOCKS:
            raise ValueError(f"blocks must be one of {BLOCKS}, got {self.blocks!r}")


def block_inputs(graph: GraphStore, targets: np.ndarray, scratch: np.ndarray):
    """The 1-hop block of `targets`: (sources, edge_index) with sources[:T] == targets and
    edge_index local (row 0 source, row 1 target). `scratch` is an all -1 int64 [N] array,
    restored before returning."""
    degs, cols = gather_rows(np.asarray(graph.indptr), np.asarray(graph.indices), targets)
    return block_from_rows(targets, degs, cols, scratch)


def block_from_rows(targets: np.ndarray, degs: np.ndarray, cols: np.ndarray, scratch: np.ndarray):
    """block_inputs given the targets' rows (lengths and concatenated neighbour ids)."""
    cols = cols.astype(np.int64, copy=False)
    t = len(targets)
    scratch[targets] = np.arange(t)
    try:
        uniq = np.unique(cols)
        extra = uniq[scratch[uniq] < 0]
        scratch[extra] = t + np.arange(len(extra))
        src_local = scratch[cols]
    except BaseException:
        # an out-of-memory error here is retried on a smaller batch (BatchSizer): a map left
        # numbered would give that batch's edges other nodes' rows
        scratch.fill(-1)
        raise
    dst_local = np.repeat(np.arange(t), degs)
    scratch[targets] = -1
    scratch[extra] = -1
    return np.concatenate([targets, extra]), np.stack([src_local, dst_local])


class DeviceBlocks:
    """block_inputs with torch ops where the model runs: the CSR, the GCN degree tables
    and the scratch map live on `device`, so a GPU builds its own blocks and no host
    round trip sits between batches. Same blocks as block_inputs, in the same order."""

    def __init__(self, graph: GraphStore, device: torch.device, gcn: bool):
        self.device = device
        self.indptr = host_tensor(np.asarray(graph.indptr)).to(device, torch.int64)
        self.indices = host_tensor(np.asarray(graph.indices)).to(device)
        self.scratch = torch.full((graph.num_nodes,), -1, dtype=torch.int64, device=device)
        self.norm_degree = self.has_loop = None
        if gcn:
            norm_degree, has_loop = gcn_degrees(graph)
            self.norm_degree = torch.from_numpy(norm_degree).to(device)
            self.has_loop = torch.from_numpy(has_loop).to(device)

    @staticmethod
    def nbytes(graph: GraphStore) -> int:
        return (graph.num_nodes + 1) * 8 + np.asarray(graph.indices).nbytes + graph.num_nodes * 8 * 3

    def block(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.indptr[targets]
        degs = self.indptr[targets + 1] - starts
        t = targets.shape[0]
        total = int(degs.sum())
        first = torch.cumsum(degs, 0) - degs
        offsets = (torch.repeat_interleave(starts - first, degs, output_size=total)
                   + torch.arange(total, device=self.device))
        cols = self.indices[offsets].to(torch.int64)
        local = torch.arange(t, device=self.device)
        scratch = self.scratch
        scratch[targets] = local
        try:
            uniq = torch.unique(cols)
            extra = uniq[scratch[uniq] < 0]
            scratch[extra] = t + torch.arange(extra.shape[0], device=self.device)
            src_local = scratch[cols]
        except BaseException:  # as block_from_rows: out of memory is retried on a smaller batch
            scratch.fill_(-1)
            raise
        scratch[targets] = -1
        scratch[extra] = -1
        dst_local = torch.repeat_interleave(local, degs, output_size=total)
        return torch.cat([targets, extra]), torch.stack([src_local, dst_local])

    def gcn_block(self, edge_index: torch.Tensor, sources: torch.Tensor, num_targets: int):
        """gcn_edge_weights' result for a block built here."""
        loops = torch.nonzero(~self.has_loop[sources[:num_targets]]).squeeze(1)
        ei = torch.cat([edge_index, torch.stack([loops, loops])], dim=1)
        inv_sqrt = 1.0 / torch.sqrt(self.norm_degree[sources].to(torch.float64))
        return ei, (inv_sqrt[ei[0]] * inv_sqrt[ei[1]]).to(torch.float32)


def gcn_degrees(graph: GraphStore) -> tuple[np.ndarray, np.ndarray]:
    """gcn_norm_degrees of a stored graph, from its CSR (rows are targets)."""
    indptr = np.asarray(graph.indptr)
    has_loop = self_loops(indptr, np.asarray(graph.indices), graph.num_nodes)
    return np.diff(indptr) + (~has_loop), has_loop


def layer_dims(model, in_dim: int, device: torch.device | str = "cpu") -> list[int]:
    """Each layer's output width, by running the stack once on a single edgeless node."""
    dims, x = [], torch.zeros(1, in_dim, device=device)
    empty = torch.zeros(2, 0, dtype=torch.long, device=device)
    with torch.inference_mode():
        for i in range(model.num_layers):
            x = model.layer(i, x, empty, 1)
            dims.append(int(x.shape[1]))
    return dims


def _memory_budget(cfg: PrecomputeConfig) -> int:
    """Bytes this process's batches may aim for: a quarter of the device's free memory, and
    on the host that quarter shared by the ranks on this machine (LOCAL_WORLD_SIZE, as
    torchrun and --nprocs set it), which each took a quarter of the whole before (N ranks
    aimed for N/4 of it). A rank on a GPU has the GPU to itself."""
    if cfg.memory_budget_bytes:
        return cfg.memory_budget_bytes
    if cfg.device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(cfg.device))
        return free // 4
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local = 1
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4 // max(1, local)
    except (ValueError, OSError):
        return (2 << 30) // max(1, local)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or "out of memory" in str(exc).lower()


class BatchSizer:
    """DGI's batch size: it doubles while a batch's working set stays within a quarter of
    the memory budget, and halves (lowering the ceiling for good) when a batch runs out
    of memory; one sizer carries what it learnt from layer to layer."""

    def __init__(self, cfg: PrecomputeConfig, device: torch.device):
        self.batch = cfg.batch_size
        self.ceiling = cfg.max_batch_size
        self.budget = _memory_budget(cfg)
        self.device = device

    def run(self, targets: np.ndarray, step, in_dim: int, out_dim: int, on_done, *, done: int = 0,
            label: str = "") -> None:
        """step(batch of targets) -> (sources, edges) for every batch of targets[done:];
        on_done(done, count) after each."""
        while done < len(targets):
            batch = targets[done:done + self.batch]
            try:
                num_sources, num_edges = step(batch)
            except Exception as exc:
                if not _is_oom(exc) or self.batch == 1:
                    raise
                self.batch = self.ceiling = max(1, self.batch // 2)
                log.warning("out of memory at %s; batch size now %d", label, self.batch)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            done += len(batch)
            on_done(done, len(batch))
            # Message passing materialises one message per edge (x_j gathered, and for
            # attention a transformed copy too), so edges weigh in_dim + out_dim floats each.
            used = ((num_sources * in_dim + len(batch) * out_dim) * 4
                    + num_edges * (16 + 4 * (in_dim + out_dim)))
            if used * 4 < self.budget and self.batch < self.ceiling:
                self.batch = min(self.ceiling, self.batch * 2)


def node_order(graph: GraphStore, order: str) -> np.ndarray:
    if order == "natural":
        return np.arange(graph.num_nodes, dtype=np.int64)
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    from hybridgnn.workload.tables import sampling_matrix

    return reverse_cuthill_mckee(sampling_matrix(graph), symmetric_mode=False).astype(np.int64)


def _device_blocks(graph: GraphStore, device: torch.device, cfg: PrecomputeConfig, widest: int,
                   gcn: bool) -> DeviceBlocks | None:
    """DeviceBlocks when blocks are built on the device (cfg.blocks), else None."""
    if cfg.blocks == "host" or (cfg.blocks == "auto" and device.type != "cuda"):
        return None
    if cfg.blocks == "auto":
        free, _ = torch.cuda.mem_get_info(device)
        if DeviceBlocks.nbytes(graph) + graph.num_nodes * widest * 4 > free // 2:
            log.info("precompute: the graph and a layer do not fit in half the GPU's free memory; "
                     "building blocks on the host")
            return None
    return DeviceBlocks(graph, device, gcn)


def layer_batch(model, layer: int, graph, targets: np.ndarray, prev: torch.Tensor, device,
                 blocks: DeviceBlocks | None, scratch, norm_degree, has_loop) -> tuple[torch.Tensor, int, int]:
    """Layer `layer`'s outputs for `targets`, with the block's source and edge counts. `graph` has
    the CSR rows the block is built from (a GraphStore, or one rank's LocalPart in its own ids);
    prev, the input layer, may be float16 (a stored layer): the gathered rows are widened."""
    with torch.inference_mode():
        if blocks is not None:  # everything on the device; prev is there too
            sources, ei = blocks.block(torch.from_numpy(targets).to(device))
            weight = None
            if model.gcn_normalised:
                ei, weight = blocks.gcn_block(ei, sources, len(targets))
            y = model.layer(layer, prev[sources].float(), ei, len(targets), gcn_weight=weight)
            return y, int(sources.shape[0]), int(ei.shape[1])
        sources, ei = block_inputs(graph, targets, scratch)
        x = prev[torch.from_numpy(sources)].to(device, torch.float32)
        weight = None
        if model.gcn_normalised:
            ei, w = gcn_edge_weights(ei, sources, len(targets), norm_degree, has_loop)
            weight = torch.from_numpy(w).to(device)
        y = model.layer(layer, x, torch.from_numpy(ei).to(device), len(targets), gcn_weight=weight)
        return y, len(sources), int(ei.shape[1])


def starting_state(root: Path, num_layers: int, dims: list[int], cfg: PrecomputeConfig, model_dir: Path,
                   features: str | None = None, num_nodes: int | None = None) -> dict:
    """Where a run starts: the saved progress in root/state.json when it was made by the
    same model shape, weights, features (features_fingerprint) and settings (complete, or
    layer and nodes done), else from scratch (a model saved again into model_dir, or a
    dataset written again with other features, makes its stored rows stale). num_nodes:
    an unfinished run's files are checked to hold its rows (lost_rows), else from scratch."""
    fresh = {"num_layers": num_layers, "dims": dims, "dtype": cfg.dtype, "order": cfg.order,
             "model_fingerprint": weights_of(model_dir), "features_fingerprint": features,
             "layer": 0, "done": 0, "complete": False}
    state_path = root / "state.json"
    if not state_path.is_file():
        return fresh
    try:
        old = read_json(state_path)
    except ValueError:  # not a state this build wrote whole: start afresh
        return fresh
    if not isinstance(old, dict) or not all(old.get(k) == fresh[k] for k in ("num_layers", "dims", "dtype", "order",
                                                                          "model_fingerprint", "features_fingerprint")):
        return fresh
    if not old.get("complete"):
        lost = lost_rows(root, old, num_nodes, dims, DTYPES[cfg.dtype]) if num_nodes is not None else None
        if lost is not None:
            log.warning("precompute cannot resume in %s (%s): computing it again from scratch", root, lost)
            return fresh
        log.info("resuming precompute at layer %d, %d nodes done", old["layer"] + 1, old["done"])
    return old


def lost_rows(root: Path, state: dict, num_nodes: int, dims: list[int], dtype) -> str | None:
    """Why an unfinished run's rows cannot be resumed (None when they can): every layer it
    finished, and the one it is in when it has rows of it, must be a whole [num_nodes,
    width] array of the run's dtype. A missing file would be made anew, and a truncated
    one extended, with zeros in place of the rows done."""
    upto = state["layer"] + (1 if state["done"] > 0 else 0)
    for i in range(1, min(upto, len(dims)) + 1):
        try:
            a = stored_array(root / f"layer_{i}.npy", num_nodes)
        except ValueError as exc:
            return str(exc)
        if a.shape[1] != dims[i - 1] or a.dtype != dtype:
            return f"layer_{i}.npy holds {a.dtype} {a.shape}, not {np.dtype(dtype)} [{num_nodes}, {dims[i - 1]}]"
    return None


def precompute(graph: GraphStore, model: GNN, model_dir: Path, cfg: PrecomputeConfig = PrecomputeConfig(),
               *, progress: bool = True) -> EmbeddingStore:
    """Run every layer over every node; resume from state.json when a previous run stopped.
    `model` is a GNN or anything hybridgnn.models.decompose accepts (e.g. a PyG BasicGNN)."""
    model = decompose(model)
    model.eval()
    device = torch.device(cfg.device)
    model.to(device)
    root = embeddings_dir(model_dir, graph.fingerprint)
    # one writer of a store at a time: replicas sharing a model repository, or `hybridgnn
    # precompute` beside a server, would otherwise unlink and rewrite each other's layer
    # files and mark a store complete that holds another run's rows; the one that waited
    # finds the store complete and returns it
    with writing_store(root, model_dir) as (_, waited):
        done = EmbeddingStore.for_graph(model_dir, graph) if waited else None
        if done is not None:
            # the writer it waited for made a complete store of these weights: a server's
            # precompute of missing embeddings, or a second run, rewrote one made with other
            # settings (an operator's --dtype float16) only because it had waited for it
            if any(done.state.get(k) != v for k, v in (("dtype", cfg.dtype), ("order", cfg.order))):
                log.warning("another process precomputed %s while this one waited (dtype %s, order %s): kept; run "
                            "precompute again to compute it with these settings", root, done.state.get("dtype"),
                            done.state.get("order"))
            return done
        return _precompute_locked(graph, model, model_dir, root, cfg, device, progress)


def _precompute_locked(graph: GraphStore, model: GNN, model_dir: Path, root: Path, cfg: PrecomputeConfig,
                       device: torch.device, progress: bool) -> EmbeddingStore:
    root.mkdir(parents=True, exist_ok=True)
    dims = layer_dims(model, graph.feature_dim, device)
    features = features_fingerprint(graph)
    state = starting_state(root, model.num_layers, dims, cfg, model_dir, features, graph.num_nodes)
    if state.get("complete"):
        store = EmbeddingStore.for_graph(model_dir, graph)
        if store is not None:
            return store
        (root / "state.json").unlink()  # complete but damaged (logged): computed again from scratch
        state = starting_state(root, model.num_layers, dims, cfg, model_dir, features)

    write_state(root, state)  # before a layer file is rewritten: an old complete store is no longer served
    order = node_order(graph, cfg.order)
    norm_degree, has_loop = gcn_degrees(graph) if model.gcn_normalised else (None, None)
    scratch = np.full(graph.num_nodes, -1, dtype=np.int64)
    blocks = _device_blocks(graph, device, cfg, max([graph.feature_dim, *dims]), model.gcn_normalised)
    sizer = BatchSizer(cfg, device)
    n = graph.num_nodes
    t_start = time.perf_counter()
    for layer in range(state["layer"], model.num_layers):
        t_layer = time.perf_counter()
        path = root / f"layer_{layer + 1}.npy"
        mode = "r+" if (path.is_file() and state["done"] > 0) else "w+"
        if mode == "w+":
            unlink_mapped(path)
        out = np.lib.format.open_memmap(path, mode=mode, dtype=DTYPES[cfg.dtype], shape=(n, dims[layer]))
        # mapped as stored: a float16 layer widened whole would sit in memory as twice its
        # file; layer_batch widens the rows each batch gathers
        prev = host_tensor(graph.features if layer == 0 else np.load(root / f"layer_{layer}.npy", mmap_mode="r"))
        if blocks is not None:
            prev = prev.to(device)  # the whole input layer, once: batches gather from it in place

        def step(targets, layer=layer, prev=prev, out=out):
            y, num_sources, num_edges = layer_batch(model, layer, graph, targets, prev, device, blocks,
                                                     scratch, norm_degree, has_loop)
            out[targets] = y.float().cpu().numpy().astype(out.dtype, copy=False)
            return num_sources, num_edges

        with tqdm(total=n, initial=state["done"], desc=f"precompute layer {layer + 1}/{model.num_layers}",
                  unit="node", unit_scale=True, disable=not progress) as bar:
            def done_with(done, count, layer=layer, bar=bar):
                nonlocal state
                bar.update(count)
                state = {**state, "layer": layer, "done": done}
                write_state(root, state)

            sizer.run(order, step, prev.shape[1], dims[layer], done_with, done=state["done"], label=f"layer {layer + 1}")
        out.flush()
        del out
        # seconds per layer (of this run: a resumed layer counts only what it did after resuming)
        state = {**state, "layer": layer + 1, "done": 0,
                 "layer_s": [*state.get("layer_s", []), round(time.perf_counter() - t_layer, 3)]}
        write_state(root, state)
    if model.readout_needed:
        _readout_pass(model, root, n, device, DTYPES[cfg.dtype], progress)
        state = {**state, "output": True}
    # a model saved into model_dir meanwhile: these rows are not its (never served, as
    # stamped), and said in one line rather than an AttributeError on no store
    check_weights(model_dir, state["model_fingerprint"], "ran")
    state = mark_complete(root, {**state, "precompute_s": time.perf_counter() - t_start})
    return EmbeddingStore.for_graph(model_dir, graph)


def unlink_mapped(path: Path) -> None:
    """Remove a store file before it is written anew: a serving engine may map it (a model
    repository restarts a version whose weights changed while the old engine serves), and
    a rewrite in place would truncate the pages under that map (SIGBUS, the server gone).
    The old engine keeps the old file's pages until it stops."""
    path.unlink(missing_ok=True)


def _readout_pass(model, root: Path, n: int, device, dtype, progress: bool, chunk: int = 65536) -> None:
    """output.npy: the model's output per node from its rows of every layer (jumping
    knowledge models), in chunks of nodes."""
    layers = [np.load(root / f"layer_{i + 1}.npy", mmap_mode="r") for i in range(model.num_layers)]
    with torch.inference_mode():
        width = model.readout([torch.zeros(1, a.shape[1], device=device) for a in layers]).shape[1]
    unlink_mapped(root / "output.npy")
    out = np.lib.format.open_memmap(root / "output.npy", mode="w+", dtype=dtype, shape=(n, width))
    with tqdm(total=n, desc="precompute output (jumping knowledge)", unit="node", unit_scale=True,
              disable=not progress) as bar:
        for lo in range(0, n, chunk):
            rows = [torch.from_numpy(np.asarray(a[lo:lo + chunk], dtype=np.float32)).to(device) for a in layers]
            with torch.inference_mode():
                out[lo:lo + chunk] = model.readout(rows).float().cpu().numpy().astype(dtype, copy=False)
            bar.update(min(chunk, n - lo))
    out.flush()
