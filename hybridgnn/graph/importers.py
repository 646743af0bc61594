"""Import graphs from a PyG `Data` file (loaded with weights_only) or an edge list / .npz / .npy."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.idmap import IdMap
from hybridgnn.graph.store import (
    MASK_NAMES,
    DatasetError,
    check_int64_ids,
    float32_features,
    load_arrays,
    write_dataset,
    written_by_torch_save,
)

log = logging.getLogger(__name__)

_USED_KEYS = {"edge_index", "x", "y", "num_nodes"}
ID_MODES = ("auto", "dense", "map")


def _safe_pyg_globals() -> list:
    """Classes a pickled PyG Data needs; allow-listed for weights_only loading only."""
    from torch_geometric.data import data as data_mod
    from torch_geometric.data import hetero_data as hetero_mod
    from torch_geometric.data import storage as storage_mod

    names = [(data_mod, "Data"), (data_mod, "DataEdgeAttr"), (data_mod, "DataTensorAttr"),
             (storage_mod, "GlobalStorage"), (storage_mod, "NodeStorage"), (storage_mod, "EdgeStorage"),
             (storage_mod, "BaseStorage"), (hetero_mod, "HeteroData")]
    return [getattr(m, n) for m, n in names if hasattr(m, n)]


def _load_pyg(path: Path):
    """A dict of arrays (a Data), or the HeteroData object itself."""
    if not written_by_torch_save(path):
        raise DatasetError(f"cannot load {path} as a PyG Data file: it is not a file torch.save wrote (a text "
                           "file, or a truncated download?)")
    try:
        with torch.serialization.safe_globals(_safe_pyg_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError / RuntimeError variants
        # torch's advice on weights_only runs to a dozen lines: keep the line with the cause
        text = str(exc)
        cause = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        cause = " ".join(cause.split("Check the documentation", 1)[0].split(". Please")[0].split())
        cause = cause or type(exc).__name__
        raise DatasetError(f"cannot load {path} as a PyG Data file (loaded with weights_only=True, so only "
                           f"tensors and PyG's Data classes are accepted): {cause}") from exc
    if type(obj).__name__ == "HeteroData":
        return obj
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], dict):
        obj = obj[0]  # InMemoryDataset.save writes (data_dict, slices)
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    if not isinstance(obj, dict):
        raise DatasetError(f"{path} holds {type(obj).__name__}, expected a PyG Data or a dict of tensors")
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in obj.items()}


def _first_line_columns(path: Path) -> int:
    """Whitespace-separated fields on the file's first line that is not a comment (0: none)."""
    with open(path, errors="replace") as f:
        for line in f:
            fields = line.split("#", 1)[0].split()
            if fields:
                return len(fields)
    return 0


def _ragged_line(path: Path, columns: int, extra_columns: bool) -> str | None:
    """Where the file's lines stop having `columns` fields (extra_columns: fewer than two,
    the rest being unread), by the file's line number; None if no line does. Read only
    once loading failed."""
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            fields = len(line.split("#", 1)[0].split())
            if fields == 0 or (fields >= 2 if extra_columns else fields == columns):
                continue
            if extra_columns:
                return f"line {number} has {fields} column{'' if fields == 1 else 's'}"
            return f"the number of columns changed from {columns} to {fields} at line {number}"
    return None


def _load_edge_file(path: Path) -> dict:
    if path.suffix == ".npz":
        out = load_arrays(path)
        if not isinstance(out, dict):
            raise DatasetError(f"{path}: an .npz of named arrays was expected")
        if "edge_index" not in out and {"src", "dst"} <= out.keys():
            out["edge_index"] = np.stack([out.pop("src"), out.pop("dst")])
        return out
    if path.suffix == ".npy":  # one array: the edge_index (PyG's [2, E])
        edges = load_arrays(path)
        if not isinstance(edges, np.ndarray) or edges.ndim != 2 or edges.shape[0] != 2:
            shape = getattr(edges, "shape", None)
            hint = " (an [E, 2] array: save its transpose)" if shape is not None and len(shape) == 2 \
                and shape[1] == 2 else ""
            raise DatasetError(f"{path}: a .npy edge list must be an edge_index of shape [2, E], got shape "
                               f"{list(shape) if shape is not None else '?'}{hint}")
        return {"edge_index": edges}
    columns = _first_line_columns(path)
    # 'src dst weight' lines: the columns past two are not served (and as one int64 table a
    # weight such as 0.5 failed to parse, which read every id as a name)
    usecols = (0, 1) if columns > 2 else None
    if usecols:
        log.warning("%s: %d columns per line; the first two are the edge (src dst), the rest (weights?) "
                    "are not read", path, columns)
    try:
        with warnings.catch_warnings():  # numpy's note on comment-only lines is not for the user
            warnings.simplefilter("ignore", UserWarning)
            edges = np.loadtxt(path, dtype=np.int64, comments="#", ndmin=2, usecols=usecols)
    except ValueError:
        try:  # node names that are not integers ("alice bob"): mapped to dense ids later
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                edges = np.loadtxt(path, dtype=str, comments="#", ndmin=2, usecols=usecols)
        except ValueError as exc:
            # numpy counts rows of data, not the file's lines (comments and blank lines
            # left out), and its advice names its own keyword, not a flag
            why = _ragged_line(path, columns, usecols is not None) or str(exc).split("; use `usecols`")[0]
            raise DatasetError(f"{path}: an edge list needs two columns 'src dst' per line: {why}") from exc
    if edges.shape[0] == 0:
        raise DatasetError(f"{path} holds no edges (expected 'src dst' lines)")
    if edges.shape[1] < 2:
        raise DatasetError(f"{path}: an edge list needs two columns 'src dst' separated by whitespace, "
                          f"found {edges.shape[1]}")
    return {"edge_index": edges[:, :2].T.copy()}


def import_graph(
    source: str | Path,
    out: str | Path,
    *,
    undirected: bool = False,
    feature_dim: int = 64,
    seed: int = 0,
    name: str | None = None,
    ids: str = "auto",
) -> Path:
    """Convert `source` (.pt/.pth PyG Data or HeteroData, .npz with edge_index [and x, y,
    masks], .npy of an edge_index [2, E], a text edge list, or a directory of edge lists per edge type) into a dataset
    directory. Edges (s, t) mean t aggregates from s, as in PyG.
    Without features, random Gaussian features of `feature_dim` are made (and recorded).

    ids: "dense" keeps integer ids as row numbers; "map" stores every distinct id with a
    map to dense ids (requests then name nodes by the original ids); "auto" maps string
    ids, negative ids and sparse ones (the largest id more than twice the count of
    distinct ids) of a source without features, and keeps the rest."""
    if ids not in ID_MODES:
        raise DatasetError(f"ids must be one of {ID_MODES}, got {ids!r}")
    src = Path(source)
    if src.is_dir():
        from hybridgnn.graph.hetero_import import import_hetero_edge_lists

        return import_hetero_edge_lists(src, out, undirected=undirected, feature_dim=feature_dim, seed=seed,
                                        name=name, ids=ids)
    if not src.is_file():
        raise DatasetError(f"{src} does not exist")
    data = _load_pyg(src) if src.suffix in (".pt", ".pth") else _load_edge_file(src)
    if not isinstance(data, dict):
        from hybridgnn.graph.hetero_import import import_hetero_data

        if ids == "map":
            raise DatasetError(f"{src}: --ids map needs an edge list (a HeteroData's rows are numbered by id)")
        return import_hetero_data(data, src, out, undirected=undirected, feature_dim=feature_dim, seed=seed,
                                  name=name)
    ei = data.get("edge_index")
    if ei is None:
        keys = f" (it holds {sorted(data)})" if src.suffix == ".npz" else ""
        raise DatasetError(f"{src} has no edge_index (or src and dst arrays){keys}")
    ei = np.asarray(ei)
    if ei.ndim != 2 or ei.shape[0] != 2 or ei.dtype.kind not in "iuU":
        raise DatasetError(f"{src}: edge_index must be an integer array [2, E], got {ei.dtype} {list(ei.shape)}")
    check_int64_ids(ei, src)
    x = data.get("x")
    if x is not None:
        x = np.asarray(x)
        if x.ndim != 2 or x.dtype.kind not in "biuf":
            raise DatasetError(f"{src}: x must be a numeric array [num_nodes, F], got {x.dtype} {x.shape}")
    given = data.get("num_nodes")
    if given is not None:
        given = np.asarray(given)
        if given.ndim != 0 or given.dtype.kind not in "iu" or int(given) < 0:
            raise DatasetError(f"{src}: num_nodes must be a whole number >= 0, got {data.get('num_nodes')!r}")
        given = int(given)
    id_map, ei = _map_ids(src, ei, ids, has_rows=x is not None or given is not None)
    num_nodes = given or (x.shape[0] if x is not None else (int(ei.max()) + 1 if ei.size else 0))
    if num_nodes == 0:  # an empty .npy/.npz made a dataset of 0 nodes; an empty text list is refused so
        raise DatasetError(f"{src} holds no edges (and no nodes): there is no graph to import")
    if ei.size and (ei.min() < 0 or ei.max() >= num_nodes):
        raise DatasetError(f"{src}: edge_index ids must lie in [0, {num_nodes}), found [{ei.min()}, {ei.max()}]")
    for k in MASK_NAMES:
        if data.get(k) is not None and np.shape(data[k]) != (num_nodes,):
            raise DatasetError(f"{src}: {k} must have num_nodes={num_nodes} entries, got shape {np.shape(data[k])}")
    s, t = ei[0].astype(np.int64), ei[1].astype(np.int64)
    rows, cols = [t], [s]  # row t lists the sources t aggregates from
    if undirected:
        rows.append(s)
        cols.append(t)
    try:
        indptr, indices = coo_to_csr(rows, cols, num_nodes, dedup=True)
    except MemoryError:  # a row pointer per node: ids up to 10**12 asked for 8 TB (a traceback)
        raise DatasetError(f"{src}: {num_nodes:,} nodes do not fit in memory"
                           + (" (sparse ids: --ids map numbers only the ones used)" if id_map is None else "")) from None
    extra = {"source": str(src), "undirected": undirected}
    merged = _repeated_edges(t, s, num_nodes, len(indices) if not undirected else None)
    if merged:
        # A graph stores each edge once: an aggregation that counts a repeated edge twice
        # (sum, mean, GCN) would otherwise differ from the model on edge_index as given.
        log.warning("%s: %d of %d edges repeat an earlier one and are stored once; a model whose aggregation counts "
                    "repeats (sum, mean, GCN) is served as on the coalesced graph (torch_geometric.utils.coalesce "
                    "gives the same edges in PyG)", src, merged, len(t))
        extra["repeated_edges_merged"] = merged
    if x is None:
        try:
            x = np.random.default_rng(seed).standard_normal((num_nodes, feature_dim), dtype=np.float32)
        except MemoryError:
            raise DatasetError(f"{src}: random features for {num_nodes:,} nodes ({feature_dim} each) do not fit in "
                               "memory") from None
        extra["random_features"] = True
        # said, not only recorded: a model trained on them learns from the graph's structure alone
        log.warning("%s holds no node features: each node gets %d random ones (--feature-dim; recorded as "
                    "random_features in meta.json)", src, feature_dim)
    x = float32_features(x, f"{src}: x")
    if x.ndim != 2 or x.shape[0] != num_nodes:
        raise DatasetError(f"x must be [num_nodes={num_nodes}, F], got {x.shape}")
    labels = data.get("y")
    ignored_extra = []
    if labels is not None and np.ndim(labels) == 2 and np.shape(labels)[1] > 1:
        log.warning("%s: y is multi-label [%d, %d]; not imported (a dataset stores one class per node, and "
                    "serving does not read labels)", src, *np.shape(labels))
        labels, ignored_extra = None, ["y"]
    elif labels is not None and not _class_numbers(np.asarray(labels)):
        # cast to int64, NaN became -2**63 and 0.5 became 0: classes that were never there
        log.warning("%s: y holds %s values that are not class numbers 0..%d (regression targets, ids?); not "
                    "imported (a dataset stores one class per node, and serving does not read labels)", src,
                    np.asarray(labels).dtype, MAX_CLASSES - 1)
        labels, ignored_extra = None, ["y"]
    if labels is not None:
        labels = np.asarray(labels).reshape(-1)
        if labels.shape[0] != num_nodes:
            raise DatasetError(f"y must have num_nodes={num_nodes} entries, got {labels.shape[0]}")
    masks = {k: np.asarray(data[k], dtype=bool) for k in MASK_NAMES if data.get(k) is not None}
    ignored = sorted(ignored_extra + [k for k in data if k not in _USED_KEYS and k not in MASK_NAMES])
    if ignored:
        unread = [k for k in ignored if k not in ignored_extra]  # a multi-label y had its own line
        if unread:  # e.g. edge_attr: the served models read node features and structure only
            log.warning("%s: not imported (the served models do not read them): %s", src, ", ".join(unread))
        extra["ignored_fields"] = ignored
    if id_map is not None:
        extra["id_map"] = id_map.kind
    path = write_dataset(out, indptr=indptr, indices=indices, features=x, labels=labels, masks=masks,
                         name=name or Path(out).name, extra=extra)
    if id_map is not None:
        id_map.save(path)
    return path


MAX_CLASSES = 1 << 20  # labels past this are ids of something else: num_classes would size a model's output


def _class_numbers(y: np.ndarray) -> bool:
    """Whether y holds class numbers: whole numbers in [-1, MAX_CLASSES) (-1 for
    unlabelled). Labels of 2**40 made num_classes 2**40 + 1, which `train` then tried to
    allocate an output layer for."""
    if y.dtype.kind == "b":
        return True
    if y.dtype.kind not in "iuf" or (y.dtype.kind == "f" and not (np.isfinite(y).all()
                                                                   and np.array_equal(y, np.round(y)))):
        return False
    return not y.size or (float(y.min()) >= -1 and float(y.max()) < MAX_CLASSES)


def _map_ids(src: Path, ei: np.ndarray, mode: str, *, has_rows: bool) -> tuple[IdMap | None, np.ndarray]:
    """(the id map, edge_index in dense ids), or (None, ei) when ids stay as they are."""
    if ei.dtype.kind == "U":
        if mode == "dense":
            flat = ei.reshape(-1)
            names = flat[~np.char.isdigit(np.char.lstrip(flat, "+-"))]  # the ids that made the rest text
            example = str(names[0] if names.size else flat[0])
            raise DatasetError(f"{src}: node ids are not integers (e.g. {example!r}); use --ids map")
        why = "are names, not integers"
    elif mode == "dense" or (mode == "auto" and has_rows):
        return None, ei
    else:
        distinct = np.unique(ei)
        lo, hi = (int(distinct[0]), int(distinct[-1])) if distinct.size else (0, -1)
        if mode == "auto" and lo >= 0 and hi + 1 <= 2 * distinct.size:
            return None, ei
        why = f"are sparse ({distinct.size:,} distinct in [{lo}, {hi}])" if mode == "auto" else "were asked to be mapped"
    if mode == "map" and has_rows:
        raise DatasetError(f"{src}: --ids map needs a source without x/num_nodes (its rows are numbered by id)")
    id_map, dense = IdMap.build(ei if ei.dtype.kind == "U" else ei.astype(np.int64))
    log.warning("%s: node ids %s; stored as dense ids 0..%d with a map, and requests name nodes by the original "
                "ids", src, why, len(id_map) - 1)
    return id_map, dense


def _repeated_edges(targets: np.ndarray, sources: np.ndarray, num_nodes: int, stored: int | None) -> int:
    """How many of the given edges repeat an earlier (target, source) pair. stored: the
    edges the CSR kept when it was built from these edges alone (saves a second pass)."""
    if stored is not None:
        return len(targets) - stored
    keys = targets.astype(np.int64) * max(num_nodes, 1) + sources  # one int per pair (n^2 < 2^63 for n < 3e9)
    return len(keys) - len(np.unique(keys))
