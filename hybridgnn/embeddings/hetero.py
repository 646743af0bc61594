"""Layer-wise full-graph inference of a HeteroGNN (DGI per node type): layer by layer,
every target type in batches of rows, each batch reading its rows' in-edges of every edge
type into that type and the previous layer's rows of the source types; and the store its
per-type, per-layer outputs are written to (precomputed embeddings of a heterogeneous
graph), memory-mapped when served.

Equals the model's forward over the whole graph (a test checks it to 1e-5): every
convolution takes the (all sources, batch targets) pair, so nothing depends on which
other rows share the batch. Memory: two layers' rows of every type.

Store layout: <model_dir>/embeddings/<dataset fingerprint>/
    types/<i>/layer_<l>.npy   [N_t, d] rows of node type i (the dataset's order) after
                              layer l and its activation (what layer l+1 reads); a type
                              no edge type of layer l reaches has none
    types/<i>/output.npy      [N_t, d_out] after the type's head (absent without a head:
                              the output is layer_L)
    state.json                written last (complete: true); without it nothing is served
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from hybridgnn.capabilities import save_array
from hybridgnn.config import read_json
from hybridgnn.embeddings.store import (
    check_weights,
    embeddings_dir,
    features_fingerprint,
    mark_complete,
    stored_array,
    unchanged,
    writing_store,
)
from hybridgnn.graph.csr import gather_rows
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.models.checkpoint import weights_fingerprint, weights_match
from hybridgnn.models.hetero import HeteroGNN

log = logging.getLogger(__name__)
STORE_KIND = "hetero"
MAX_BATCH_EDGES = 1 << 20  # in-edges per batch of target rows: bounds a block's messages
DTYPES = {"float32": np.float32, "float16": np.float16}


def _block(edge, lo: int, hi: int) -> torch.Tensor:
    """The in-edges of target rows [lo, hi) of one edge type as (global source, local
    target) pairs, vectorised over the CSR."""
    rows = np.arange(lo, hi)
    lens, sources = gather_rows(np.asarray(edge.indptr), np.asarray(edge.indices), rows)
    targets = np.repeat(np.arange(hi - lo), lens)
    return torch.from_numpy(np.stack([sources.astype(np.int64), targets]))


def _check_types(model: HeteroGNN, graph: HeteroGraphStore) -> None:
    missing = [t for t in model.node_types if t not in graph.nodes]
    if missing or [tuple(e) for e in model.edge_types if e not in graph.edges]:
        raise ValueError(f"the model's types do not match the graph's: model {model.node_types} / "
                         f"{model.edge_types}, graph {graph.node_types} / {graph.edge_types}")


def row_batches(degrees: np.ndarray, batch_size: int, max_edges: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of target rows: at most batch_size rows and, where rows have many
    in-edges, at most max_edges edges (one row whatever its degree)."""
    cum = np.concatenate([[0], np.cumsum(degrees, dtype=np.int64)])
    n, lo = len(degrees), 0
    while lo < n:
        by_edges = int(np.searchsorted(cum, cum[lo] + max_edges, side="right")) - 1
        hi = max(lo + 1, min(n, lo + batch_size, by_edges))
        yield lo, hi
        lo = hi


def layer_outputs(model: HeteroGNN, graph: HeteroGraphStore, *, batch_size: int = 16384,
                  max_edges: int = MAX_BATCH_EDGES, progress: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Every node's rows per node type after each layer (and the activation between
    layers), in order (layer 1 first). A batch holds at most batch_size target rows and
    max_edges in-edges, so a type of popular nodes (millions of ratings) does not take a
    block whose messages outgrow memory."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    _check_types(model, graph)
    with warnings.catch_warnings():  # read-only memory-mapped features, read only
        warnings.simplefilter("ignore", UserWarning)
        x = {t: torch.from_numpy(np.asarray(n.features)) for t, n in graph.nodes.items()}
    total = model.num_layers * sum(graph.num_nodes(t) for t in graph.node_types)
    bar = tqdm(total=total, unit="rows", desc="hetero layer-wise", disable=not progress)
    try:
        with torch.inference_mode():
            for i in range(model.num_layers):
                into = {t: [e for e in model.layer_edges[i] if e[2] == t] for t in graph.node_types}
                nxt = {}
                for t, edge_types in into.items():
                    n = graph.num_nodes(t)
                    if not edge_types:
                        bar.update(n)
                        continue  # a type no edge type of this layer reaches has no output (as in PyG)
                    parts = []
                    degrees = sum(np.diff(np.asarray(graph.edges[e].indptr)) for e in edge_types)
                    for lo, hi in row_batches(degrees, batch_size, max_edges):
                        blocks = {e: _block(graph.edges[e], lo, hi) for e in edge_types}
                        parts.append(model.layer(i, x, blocks, x_dst={t: x[t][lo:hi]})[t])
                        bar.update(hi - lo)
                    nxt[t] = torch.cat(parts) if parts else torch.empty(0)
                x = nxt
                yield x
    finally:
        bar.close()


def hetero_layerwise(model: HeteroGNN, graph: HeteroGraphStore, *, batch_size: int = 16384,
                     max_edges: int = MAX_BATCH_EDGES, progress: bool = False) -> dict[str, np.ndarray]:
    """Every node's output per node type (after the heads), float32 arrays [N_t, out_t]."""
    x: dict[str, torch.Tensor] = {}
    for x in layer_outputs(model, graph, batch_size=batch_size, max_edges=max_edges, progress=progress):
        pass
    with torch.inference_mode():
        out = model.head(x)
    return {t: v.float().numpy() for t, v in out.items()}


def _save(path: Path, rows: torch.Tensor, dtype) -> None:
    save_array(path, rows.float().numpy().astype(dtype, copy=False))


def hetero_precompute(model: HeteroGNN, graph: HeteroGraphStore, model_dir: str | Path, *,
                      batch_size: int = 16384, dtype: str = "float32", progress: bool = True) -> HeteroEmbeddingStore:
    """Run layer-wise inference and write every layer's rows of every type (and the heads'
    outputs) as the store the server reads (module docstring). An existing store for this
    model and dataset is replaced; an interrupted run leaves no state.json, so nothing
    half-written is ever served, and a rerun starts over."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    root = embeddings_dir(Path(model_dir), graph.fingerprint)
    # one writer of a store at a time (precompute.py's precompute says why)
    with writing_store(root, Path(model_dir)) as (weights, _):
        return _write_store(model, graph, Path(model_dir), root, batch_size, dtype, progress, weights)


def _write_store(model: HeteroGNN, graph: HeteroGraphStore, model_dir: Path, root: Path, batch_size: int,
                 dtype: str, progress: bool, weights: str | None) -> HeteroEmbeddingStore:
    if root.exists():
        shutil.rmtree(root)
    dirs = {t: root / "types" / str(i) for i, t in enumerate(graph.node_types)}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layers: dict[str, list[int]] = {t: [] for t in graph.node_types}
    x: dict[str, torch.Tensor] = {}
    for i, x in enumerate(layer_outputs(model, graph, batch_size=batch_size, progress=progress), start=1):
        for t, rows in x.items():
            _save(dirs[t] / f"layer_{i}.npy", rows, DTYPES[dtype])
            layers[t].append(i)
    heads = [t for t in x if t in model.heads]
    with torch.inference_mode():
        for t in heads:
            _save(dirs[t] / "output.npy", model.heads[t](x[t]), DTYPES[dtype])
    # the weights `model` was loaded with, not model_dir's now: a model saved there
    # meanwhile stamped these rows as its own
    check_weights(model_dir, weights, "ran")
    state = {"kind": STORE_KIND, "model_fingerprint": weights if weights is not None else weights_fingerprint(model_dir),
             "num_layers": model.num_layers, "node_types": list(graph.node_types),
             "layers": layers, "heads": heads, "dtype": dtype, "dataset_fingerprint": graph.fingerprint,
             "features_fingerprint": features_fingerprint(graph), "precompute_s": time.perf_counter() - t0}
    mark_complete(root, state)
    store = HeteroEmbeddingStore.for_graph(model_dir, graph)
    assert store is not None
    return store


def _stored_arrays(root: Path, state: dict, num_nodes: dict[str, int] | None):
    """(layers, output) of a complete store's state.json, every array checked to be float
    [rows, width] with one row per node of its type (num_nodes, else as its type's others)."""
    made = state.get("computed_unix_s")
    if isinstance(made, bool) or not isinstance(made, (int, float)):
        raise ValueError(f"state.json's computed_unix_s is {made!r}")
    num_layers = state["num_layers"]
    layers, output = {}, {}
    for i, t in enumerate(state["node_types"]):
        d = root / "types" / str(i)
        rows = num_nodes.get(t) if num_nodes is not None else None
        layers[t] = {}
        for layer in state["layers"][t]:
            a = stored_array(d / f"layer_{int(layer)}.npy", rows)
            rows = a.shape[0]
            layers[t][int(layer)] = a
        if t in state["heads"]:
            output[t] = stored_array(d / "output.npy", rows)
        elif num_layers in layers[t]:
            output[t] = layers[t][num_layers]
    return layers, output


@dataclass
class HeteroEmbeddingStore:
    """A complete store (module docstring), memory-mapped. layers[t][l] is node type t's
    rows after layer l (1-based), for the layers that reach t; output[t] what a request
    for t's outputs reads (after its head)."""

    root: Path
    state: dict
    layers: dict[str, dict[int, np.ndarray]]
    output: dict[str, np.ndarray]

    @property
    def num_layers(self) -> int:
        return int(self.state["num_layers"])

    @property
    def computed_unix_s(self) -> float:
        return float(self.state["computed_unix_s"])

    @classmethod
    def for_graph(cls, model_dir: str | Path, graph: HeteroGraphStore) -> HeteroEmbeddingStore | None:
        """open() for a dataset opened as `graph`: its fingerprint, rows per type and features."""
        return cls.open(model_dir, graph.fingerprint, {t: graph.num_nodes(t) for t in graph.node_types},
                        features=features_fingerprint(graph))

    @classmethod
    def open(cls, model_dir: str | Path, dataset_fingerprint: str,
             num_nodes: dict[str, int] | None = None, *, features: str | None = None) -> HeteroEmbeddingStore | None:
        """The complete store for this model and dataset; None when absent, unfinished,
        written for a homogeneous graph, computed with other weights than the model's
        now (a model saved again into the same directory: its rows are stale), from other
        features than `features` (features_fingerprint; stores without one are not
        checked), or damaged (logged). num_nodes: rows per node type, which every stored
        array must have."""
        root = embeddings_dir(Path(model_dir), dataset_fingerprint)
        try:
            state = read_json(root / "state.json")
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict) or not state.get("complete") or state.get("kind") != STORE_KIND:
            return None
        if not weights_match(state.get("model_fingerprint"), model_dir):
            log.warning("precomputed embeddings in %s were computed with other weights than %s has now: not "
                        "served (run `hybridgnn precompute` again)", root, model_dir)
            return None
        made_from = state.get("features_fingerprint")
        if features is not None and made_from is not None and made_from != features:
            log.warning("precomputed embeddings in %s were computed from other features than the dataset has now "
                        "(written again in place?): not served (run `hybridgnn precompute` again)", root)
            return None
        try:
            layers, output = _stored_arrays(root, state, num_nodes)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # a traceback at startup (a missing or truncated file, a state.json edited) or
            # an IndexError for the nodes past a truncated file's rows, before
            log.warning("precomputed embeddings in %s are damaged (%s: %s): not served (run `hybridgnn precompute` "
                        "again)", root, type(exc).__name__, exc)
            return None
        if not unchanged(root, state):  # a rerun removed the store and wrote arrays meanwhile
            return None
        return cls(root=root, state=state, layers=layers, output=output)

    def last(self, node_type: str) -> np.ndarray:
        """Node type's rows after the last layer (what its head reads)."""
        return self.layers[node_type][self.num_layers]
