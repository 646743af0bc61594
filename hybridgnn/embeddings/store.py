"""Per-layer embedding arrays beside a checkpoint, memory-mapped.

Layout: <model_dir>/embeddings/<dataset fingerprint>/
    layer_1.npy .. layer_L.npy   [N, d_i] float32 or float16 (layer_L = the model's output)
    output.npy                   [N, d_out]: the output of a jumping-knowledge model, which
                                 mixes every layer's rows (absent otherwise)
    state.json                   progress (for resuming), the weights they are computed with
                                 (model_fingerprint), the features (features_fingerprint) and,
                                 when complete, computed_unix_s
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.config import read_json

log = logging.getLogger(__name__)


def embeddings_dir(model_dir: Path, dataset_fingerprint: str) -> Path:
    return Path(model_dir) / "embeddings" / dataset_fingerprint


def store_lock(root: Path) -> Path:
    """The lock file held by a process writing the store at root (capabilities.exclusive):
    beside it, since a store may be removed whole."""
    return root.parent / f".{root.name}.lock"


@contextlib.contextmanager
def writing_store(root: Path, model_dir: Path) -> Iterator[tuple[str | None, bool]]:
    """Hold the lock of the store at root (one writer at a time) for a run whose model was
    loaded from model_dir just before; yields the fingerprint of model_dir's weights as they
    were before any wait (weights_of), and whether it waited for another writer. A model saved into model_dir while the run waited for
    another writer is not the one it holds: its rows would have been stamped with the new
    weights' fingerprint and served as theirs (a complete store, never computed again).
    ConfigError then, before anything is written."""
    from hybridgnn.capabilities import exclusive

    weights = weights_of(model_dir)
    with exclusive(store_lock(root), f"waiting for another process precomputing {root}") as waited:
        check_weights(model_dir, weights, "waited for another one")
        yield weights, waited


def check_weights(model_dir: Path, weights: str | None, when: str) -> None:
    """ConfigError when model_dir's weights are no longer those a run was loaded with
    (weights): a model saved there since (`when` says while what)."""
    from hybridgnn.errors import ConfigError

    if weights_of(model_dir) != weights:
        raise ConfigError(f"the weights in {model_dir} changed while this precompute {when}: run it again to "
                          "precompute them")


@dataclass
class EmbeddingStore:
    root: Path
    layers: list[np.ndarray]  # layers[i] = output of layer i+1
    state: dict
    output: np.ndarray | None = None  # jumping-knowledge models: their output per node

    @property
    def final(self) -> np.ndarray:
        return self.output if self.output is not None else self.layers[-1]

    @property
    def computed_unix_s(self) -> float:
        return float(self.state["computed_unix_s"])

    @property
    def fingerprint(self) -> str:
        """What the stored rows are: a hash of the fields of their state that say what they
        were computed from and how (layers, widths, dtype, the weights' and the features'
        fingerprints, a readout output), not when or by how many ranks. A copy of the store,
        or one computed again from the same weights and features, has the same."""
        what = {k: self.state.get(k) for k in ("num_layers", "dims", "dtype", "model_fingerprint",
                                               "features_fingerprint")}
        what["output"] = self.output is not None
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def for_graph(cls, model_dir: Path, graph, model=None) -> "EmbeddingStore | None":
        """open() for a dataset opened as `graph` (a GraphStore): its fingerprint, nodes and
        features."""
        return cls.open(model_dir, graph.fingerprint, graph.num_nodes, features=features_fingerprint(graph),
                        model=model)

    @classmethod
    def open(cls, model_dir: Path, dataset_fingerprint: str, num_nodes: int | None = None, *,
             features: str | None = None, model=None) -> "EmbeddingStore | None":
        """The complete store for this model and dataset, or None when absent, unfinished
        or damaged (logged: its rows are then computed or sampled, never misread).
        num_nodes: the dataset's, which every stored layer must have a row for; features:
        its features_fingerprint, which the store's must equal when it records one; model:
        the layer stack loaded from model_dir, whose layers and widths the store's must be."""
        root = embeddings_dir(model_dir, dataset_fingerprint)
        state = read_state(root)
        if state is None:
            return None
        if not isinstance(state, dict) or not state.get("complete"):
            return None
        made_with = state.get("model_fingerprint")  # absent in stores written before it was recorded
        if made_with is not None and made_with != weights_of(model_dir):
            log.warning("precomputed embeddings in %s were computed with other weights than %s has now: not "
                        "served (run `hybridgnn precompute` again)", root, model_dir)
            return None
        made_from = state.get("features_fingerprint")  # absent in stores written before it was recorded
        if features is not None and made_from is not None and made_from != features:
            log.warning("precomputed embeddings in %s were computed from other features than the dataset has now "
                        "(written again in place?): not served (run `hybridgnn precompute` again)", root)
            return None
        try:
            layers, output = _stored_arrays(root, state, num_nodes)
            if model is not None:
                _check_fits_model(layers, output, model)
        except ValueError as exc:
            log.warning("precomputed embeddings in %s are damaged or not this model's (%s): not served (run "
                        "`hybridgnn precompute` again)", root, exc)
            return None
        if not unchanged(root, state):
            return None
        return cls(root=root, layers=layers, state=state, output=output)

    def close(self) -> None:
        """Let go of the memory-mapped rows now: each map holds an open file (and a store
        deleted meanwhile, its disk space) for as long as the store lives, and a stopped
        engine's store lives in its reference cycles until the interpreter's next full
        collection (a model repository retiring versions held every one it retired). The
        store has no rows after; the list of layers is emptied in place, as readers of the
        store's rows (new nodes' StoredGraphView) hold that list."""
        self.layers.clear()
        self.output = None

    def lookup(self, node_ids: np.ndarray) -> np.ndarray:
        """The model's output rows (logits) as float32 (constant time per id)."""
        # indexed as a plain array: a memmap's own indexing makes a memmap of the rows, at
        # several times the cost of the copy for the few rows a request names
        return np.asarray(np.asarray(self.final)[node_ids], dtype=np.float32)


def stored_array(path: Path, rows: int | None = None) -> np.ndarray:
    """A stored embedding array, memory-mapped: ValueError unless it is readable and float
    [rows, width] (rows: when given). Both stores (and the heterogeneous one) read by it."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:  # missing, empty, truncated or overwritten
        raise ValueError(f"{path.parent.name}/{path.name} is not readable: {type(exc).__name__}") from exc
    if a.ndim != 2 or a.dtype.kind != "f" or (rows is not None and a.shape[0] != rows):
        raise ValueError(f"{path.parent.name}/{path.name} holds {a.dtype} {a.shape}, not float "
                         f"[{rows if rows is not None else 'rows'}, width]")
    return a


def _check_fits_model(layers: list[np.ndarray], output: np.ndarray | None, model) -> None:
    """ValueError unless the stored layers are the model's: as many, each as wide as the
    model's layer, and an output as wide as its output exactly when it has a readout. A
    store whose state.json records no weights (written before it did, or edited) was
    served whatever its widths: precomputed answers of 16 logits from an 8-class model."""
    from hybridgnn.embeddings.precompute import layer_dims

    if len(layers) != model.num_layers:
        raise ValueError(f"it holds {len(layers)} layers, the model has {model.num_layers}")
    dims = layer_dims(model, model.in_dim)
    widths = [int(a.shape[1]) for a in layers]
    if widths != dims:
        raise ValueError(f"its layers are {widths} wide, the model's {dims}")
    if (output is not None) != bool(model.readout_needed):
        raise ValueError("it has an output.npy and the model no readout" if output is not None else
                         "it lacks the output.npy of the model's readout")
    if output is not None and int(output.shape[1]) != model.out_dim:
        raise ValueError(f"its output.npy is {int(output.shape[1])} wide, the model's output {model.out_dim}")


def _stored_arrays(root: Path, state: dict, num_nodes: int | None) -> tuple[list[np.ndarray], np.ndarray | None]:
    """(layers, output) a complete state.json names, each checked to be a float [rows, width]
    array with the same rows (num_nodes, when given) and the widths state.json records;
    ValueError naming the first that is not. A damaged store was a traceback at startup,
    or served an IndexError for the nodes past a truncated layer's rows."""
    num_layers, dims = state.get("num_layers"), state.get("dims")
    made = state.get("computed_unix_s")
    if isinstance(made, bool) or not isinstance(made, (int, float)):  # what metadata answers with
        raise ValueError(f"state.json's computed_unix_s is {made!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"state.json's num_layers is {num_layers!r}")
    if dims is not None and (not isinstance(dims, list) or len(dims) != num_layers):
        raise ValueError(f"state.json's dims {dims!r} do not list {num_layers} layers")
    rows = num_nodes
    layers = []
    for i in range(num_layers):
        a = stored_array(root / f"layer_{i + 1}.npy")
        rows = a.shape[0] if rows is None else rows
        if a.shape[0] != rows or (dims is not None and a.shape[1] != dims[i]):
            raise ValueError(f"layer_{i + 1}.npy holds {a.shape}, not [{rows}, "
                             f"{dims[i] if dims is not None else a.shape[1]}]")
        layers.append(a)
    output = None
    if state.get("output"):
        output = stored_array(root / "output.npy")
        if output.shape[0] != rows:
            raise ValueError(f"output.npy holds {output.shape[0]} rows, not {rows}")
    return layers, output


def features_fingerprint(graph) -> str:
    """A fingerprint of a dataset's features (a heterogeneous one's: every node type's, in
    order), which its own fingerprint (the store's directory name) leaves out: a dataset
    written again in place with the same edges and other features must not be served, or
    resumed over, the old features' rows. Hashes every row of a graph up to 32,767 nodes,
    else rows at an even stride: it is computed at every open, so it reads a few MB at
    most (the dataset fingerprint, computed once when the dataset is written, hashes
    every CSR entry)."""
    nodes = getattr(graph, "nodes", None)  # HeteroGraphStore: NodeTypeData per type
    arrays = [n.features for n in nodes.values()] if nodes is not None else [graph.features]
    h = hashlib.sha256()
    for feats in arrays:
        h.update(np.int64(feats.shape).tobytes())
        h.update(np.ascontiguousarray(feats[:: max(1, feats.shape[0] // 16384)]).tobytes())
    return h.hexdigest()[:16]


def weights_of(model_dir: Path) -> str | None:
    """The fingerprint of the weights in model_dir (what embeddings computed now are
    computed with), or None for a directory without weights (a model given in code)."""
    from hybridgnn.models.checkpoint import WEIGHTS, weights_fingerprint

    return weights_fingerprint(model_dir) if (Path(model_dir) / WEIGHTS).is_file() else None


def hidden_rows(model, layers: list[np.ndarray], features, node_ids: np.ndarray) -> np.ndarray:
    """What the model's head reads (its `embedding`) for node_ids, from stored per-layer
    rows: the jumping-knowledge output, else layer L-1's rows, else (one layer) the
    features. features(ids) gives input rows."""
    if model.readout_needed:
        import torch

        rows = [torch.from_numpy(np.asarray(a[node_ids], dtype=np.float32)) for a in layers]
        with torch.inference_mode():
            return model.embedding(rows, None).float().numpy()
    if len(layers) >= 2:
        return np.asarray(layers[-2][node_ids], dtype=np.float32)
    return np.asarray(features(node_ids), dtype=np.float32)


def read_state(root: Path):
    """root/state.json's JSON, or None when it is missing or not JSON (a store not written
    whole, or being removed)."""
    try:
        return read_json(root / "state.json")
    except (OSError, ValueError):
        return None


def unchanged(root: Path, state: dict) -> bool:
    """Whether root/state.json still says `state` once its arrays are mapped; logged when
    not. A run that rewrites a store writes its state before touching any array, so a
    reader that mapped a file of that run (zeros until computed) sees the state change."""
    if read_state(root) == state:
        return True
    log.warning("precomputed embeddings in %s were rewritten while this process opened them: not served "
                "(a precompute is running there)", root)
    return False


def write_state(root: Path, state: dict) -> None:
    tmp = root / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(root / "state.json")  # atomic: a crash leaves the old or the new state


def mark_complete(root: Path, state: dict) -> dict:
    state = {**state, "complete": True, "computed_unix_s": time.time()}
    write_state(root, state)
    return state
