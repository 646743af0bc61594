"""Import heterogeneous graphs: a torch-saved PyG `HeteroData` (loaded with weights_only),
or a directory with one edge list per edge type.

Edge-list layout: `<src>__<rel>__<dst>.txt` (or .npz with edge_index, or src and dst)
per edge type, two whitespace-separated columns "src dst" per line, ids per node type;
optional `<type>.x.npy` features and `<type>.y.npy` labels per node type. A PyG edge
(s, t) means t aggregates from s, so row t of the edge type's CSR lists s.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.hetero import check_type_name, edge_type_key, write_hetero_dataset
from hybridgnn.graph.idmap import IdMap
from hybridgnn.graph.store import (
    DatasetError,
    check_int64_ids,
    float32_features,
    load_arrays,
)
from hybridgnn.types import EdgeType

log = logging.getLogger(__name__)

EDGE_FILE_SUFFIXES = (".txt", ".tsv", ".edges", ".npz")
_NODE_KEYS = {"x", "y", "num_nodes"}
_EDGE_KEYS = {"edge_index"}


def reverse_edge_types(edges: dict[EdgeType, np.ndarray]) -> dict[EdgeType, np.ndarray]:
    """PyG's ToUndirected: (s, rel, d) with s != d gains (d, 'rev_' + rel, s) unless that
    type is present (or it is itself the reverse of a present type); (t, rel, t) gets
    every edge in both directions."""
    out = dict(edges)
    for (s, rel, d), ei in edges.items():
        if s == d:
            out[(s, rel, d)] = np.concatenate([ei, ei[::-1]], axis=1)
        elif (d, f"rev_{rel}", s) not in out and not (rel.startswith("rev_") and (d, rel[4:], s) in edges):
            out[(d, f"rev_{rel}", s)] = ei[::-1].copy()
    return out


def write_hetero_edges(out, node_rows: dict[str, dict], edges: dict[EdgeType, np.ndarray], *,
                       undirected: bool = False, name: str | None = None, extra: dict | None = None) -> Path:
    """Write a heterogeneous dataset from PyG-style edge_index arrays [2, E] per edge type
    (row 0 source ids, row 1 target ids) and node rows per type (write_hetero_dataset's)."""
    if undirected:
        edges = reverse_edge_types(edges)
    csrs = {}
    for etype, ei in edges.items():
        src, _, dst = etype
        n_src, n_dst = node_rows[src]["features"].shape[0], node_rows[dst]["features"].shape[0]
        for row, n, end in ((ei[0], n_src, src), (ei[1], n_dst, dst)):
            if row.size and (int(row.min()) < 0 or int(row.max()) >= n):
                raise DatasetError(f"edge type {edge_type_key(etype)!r}: {end} ids must lie in [0, {n}), "
                                   f"found [{int(row.min())}, {int(row.max())}]")
        csrs[etype] = coo_to_csr([ei[1].astype(np.int64)], [ei[0].astype(np.int64)], n_dst, dedup=True,
                                 num_cols=n_src)
    extra = {**(extra or {}), "undirected": undirected}
    return write_hetero_dataset(out, nodes=node_rows, edges=csrs, name=name or Path(out).name, extra=extra)


def _random_features(num_nodes: int, feature_dim: int, seed: int, index: int) -> np.ndarray:
    if num_nodes < 0:
        raise DatasetError(f"num_nodes must be >= 0, got {num_nodes}")
    try:
        return np.random.default_rng([seed, index]).standard_normal((num_nodes, feature_dim), dtype=np.float32)
    except MemoryError:  # num_nodes 10**12 asked for terabytes (a traceback)
        raise DatasetError(f"random features for {num_nodes:,} nodes ({feature_dim} each) do not fit in memory; "
                           "with sparse ids, --ids map numbers only the ones used") from None


def import_hetero_data(data, source: Path, out, *, undirected: bool = False, feature_dim: int = 64,
                       seed: int = 0, name: str | None = None) -> Path:
    """A loaded `HeteroData` as a dataset directory. Node types without x get random
    Gaussian features of feature_dim (recorded in meta.json)."""
    node_types, edge_types = data.metadata()
    if not node_types or not edge_types:
        raise DatasetError(f"{source} holds a HeteroData with no {'node' if not node_types else 'edge'} types")
    edges: dict[EdgeType, np.ndarray] = {}
    ignored: list[str] = []
    for etype in edge_types:
        store = data[etype]
        if "edge_index" not in store:
            raise DatasetError(f"{source}: edge type {edge_type_key(etype)!r} has no edge_index")
        ei = store["edge_index"].numpy()
        if ei.ndim != 2 or ei.shape[0] != 2 or ei.dtype.kind not in "iu":
            raise DatasetError(f"{source}: edge_index of {edge_type_key(etype)!r} must be an integer array "
                               f"[2, E], got {ei.dtype} {ei.shape}")
        check_int64_ids(ei, f"{source}: edge type {edge_type_key(etype)!r}")
        edges[tuple(check_type_name(p, "edge type part") for p in etype)] = ei
        ignored += [f"{edge_type_key(etype)}.{k}" for k in store.keys() if k not in _EDGE_KEYS]
    node_rows: dict[str, dict] = {}
    random_types = []
    for i, ntype in enumerate(node_types):
        check_type_name(ntype, "node type")
        store = data[ntype]
        x = np.asarray(store["x"]) if "x" in store else None
        if x is not None and x.dtype.kind not in "biuf":
            raise DatasetError(f"{source}: x of node type {ntype!r} must be a numeric array, got {x.dtype}")
        if x is not None and x.ndim != 2:  # a 0-d x was an IndexError traceback
            raise DatasetError(f"{source}: x of node type {ntype!r} must be 2-D [N, F], got shape {tuple(x.shape)}")
        counted = [int(ei[0].max()) + 1 for (s, _, _), ei in edges.items() if s == ntype and ei.size]
        counted += [int(ei[1].max()) + 1 for (_, _, d), ei in edges.items() if d == ntype and ei.size]
        num_nodes = (x.shape[0] if x is not None else
                     int(store["num_nodes"]) if "num_nodes" in store else max(counted, default=0))
        if x is None:
            x = _random_features(num_nodes, feature_dim, seed, i)
            random_types.append(ntype)
        rows = {"features": float32_features(x, f"{source}: x of node type {ntype!r}")}
        if "y" in store:
            y = store["y"].numpy()
            if y.ndim == 1 and y.shape[0] == num_nodes and y.dtype.kind in "iu":
                rows["labels"] = y
            else:
                ignored.append(f"{ntype}.y")  # multi-label or float targets: serving does not read labels
        node_rows[ntype] = rows
        ignored += [f"{ntype}.{k}" for k in store.keys() if k not in _NODE_KEYS]
    extra: dict = {"source": str(source)}
    if random_types:
        extra["random_features"] = random_types
        log.warning("%s: node types %s have no features: each node gets %d random ones (--feature-dim; recorded "
                    "as random_features in meta.json)", source, random_types, feature_dim)
    if ignored:
        log.warning("%s: not imported (the served models read node features and structure only): %s",
                    source, ", ".join(sorted(ignored)))
        extra["ignored_fields"] = sorted(ignored)
    return write_hetero_edges(out, node_rows, edges, undirected=undirected, name=name, extra=extra)


def _parse_edge_file_name(path: Path) -> EdgeType:
    stem = path.name[: -len(path.suffix)]
    parts = stem.split("__")
    if len(parts) != 3 or not all(parts):
        raise DatasetError(f"{path.name}: an edge file is named <src>__<rel>__<dst>{path.suffix}, "
                           "with no double underscore inside a name")
    return tuple(parts)  # type: ignore[return-value]


def import_hetero_edge_lists(source: Path, out, *, undirected: bool = False, feature_dim: int = 64,
                             seed: int = 0, name: str | None = None, ids: str = "auto") -> Path:
    """A directory of per-edge-type edge lists (module docstring) as a dataset directory."""
    from hybridgnn.graph.importers import _class_numbers, _load_edge_file

    files = sorted(p for p in source.iterdir() if p.suffix in EDGE_FILE_SUFFIXES and "__" in p.name)
    if not files:
        raise DatasetError(f"{source} holds no edge files named <src>__<rel>__<dst>"
                           f"{{{','.join(EDGE_FILE_SUFFIXES)}}}")
    raw: dict[EdgeType, np.ndarray] = {}
    for f in files:
        etype = _parse_edge_file_name(f)
        if etype in raw:
            raise DatasetError(f"{source}: edge type {edge_type_key(etype)!r} is given by more than one file")
        ei = np.asarray(_load_edge_file(f)["edge_index"])
        if ei.ndim != 2 or ei.shape[0] != 2 or ei.dtype.kind not in "iuU":
            raise DatasetError(f"{f.name}: edges must be two columns of ids, got {ei.dtype} {ei.shape}")
        check_int64_ids(ei, f.name)
        raw[etype] = ei
    node_types = list(dict.fromkeys(t for (s, _, d) in raw for t in (s, d)))
    node_rows: dict[str, dict] = {}
    edges = {e: np.empty_like(ei, dtype=np.int64) for e, ei in raw.items()}
    random_types, mapped, ignored = [], [], []
    for i, ntype in enumerate(node_types):
        x_path, y_path = source / f"{ntype}.x.npy", source / f"{ntype}.y.npy"
        x = _one_array(x_path) if x_path.is_file() else None
        if x is not None and x.ndim != 2:  # a 0-d array was an IndexError traceback
            raise DatasetError(f"{x_path}: features must be 2-D [N, F], got shape {x.shape}")
        ends = [(e, side) for e in raw for side in (0, 1) if e[2 * side] == ntype]
        columns = [_as_ids(raw[e][side]) for e, side in ends]
        if any(c.dtype.kind == "U" for c in columns):  # names in one file: every id of the type is a name
            columns = [c.astype(np.str_) for c in columns]
        values = np.concatenate(columns)
        id_map = _type_id_map(ntype, values, ids, has_rows=x is not None, source=source)
        for (e, side), column in zip(ends, columns, strict=True):
            edges[e][side] = id_map.to_internal(column)[0] if id_map is not None else column
        num_nodes = (x.shape[0] if x is not None else len(id_map) if id_map is not None else
                     int(values.astype(np.int64).max()) + 1 if values.size else 0)
        if x is None:
            x = _random_features(num_nodes, feature_dim, seed, i)
            random_types.append(ntype)
        rows = {"features": float32_features(x, f"{x_path}" if x_path.is_file() else f"{ntype} features")}
        if y_path.is_file():
            y = _one_array(y_path).reshape(-1)
            if y.shape[0] != num_nodes:
                raise DatasetError(f"{y_path.name} must hold {num_nodes} labels, got {y.shape[0]}")
            if _class_numbers(y):
                rows["labels"] = y
            else:  # cast to int64, NaN became -2**63 and 0.5 became 0: classes that were never there
                log.warning("%s holds %s values that are not class numbers (regression targets?); not imported "
                            "(serving does not read labels)", y_path, y.dtype)
                ignored.append(f"{ntype}.y")
        if id_map is not None:
            rows["id_map"] = id_map
            mapped.append(ntype)
        node_rows[ntype] = rows
    extra: dict = {"source": str(source)}
    if random_types:
        extra["random_features"] = random_types
        log.warning("%s: node types %s have no features: each node gets %d random ones (--feature-dim; recorded "
                    "as random_features in meta.json)", source, random_types, feature_dim)
    if mapped:
        extra["id_maps"] = mapped
    if ignored:
        extra["ignored_fields"] = ignored
    return write_hetero_edges(out, node_rows, edges, undirected=undirected, name=name, extra=extra)


def _as_ids(column: np.ndarray) -> np.ndarray:
    """A column read as text (another column of its file held names) as integers when
    every entry is one."""
    if column.dtype.kind != "U":
        return column
    try:
        return column.astype(np.int64)
    except (ValueError, OverflowError):  # OverflowError: an integer past int64's range, kept as a name
        return column


def _type_id_map(ntype: str, values: np.ndarray, mode: str, *, has_rows: bool, source: Path) -> IdMap | None:
    """The id map of one node type's ids, or None when they stay as they are (as the
    homogeneous importer decides: names and sparse ids are mapped under 'auto')."""
    if values.dtype.kind == "U":
        example = str(values.flat[0])
        if has_rows:  # row i of <type>.x.npy is node i: names cannot say which row is theirs
            raise DatasetError(f"{source}: ids of node type {ntype!r} are not integers (e.g. {example!r}), so "
                               f"the rows of {ntype}.x.npy cannot be matched to them: number the nodes 0..n-1 "
                               f"(row i is node i) or drop {ntype}.x.npy")
        if mode == "dense":
            raise DatasetError(f"{source}: ids of node type {ntype!r} are not integers (e.g. {example!r}); "
                               "--ids dense keeps integer ids as row numbers: use --ids auto or map")
    elif mode == "dense" or (mode == "auto" and has_rows):
        return None
    else:
        distinct = np.unique(values)
        if mode == "auto" and (not distinct.size or (distinct[0] >= 0 and distinct[-1] + 1 <= 2 * distinct.size)):
            return None
        if has_rows:
            raise DatasetError(f"{source}: --ids map needs node type {ntype!r} without {ntype}.x.npy "
                               "(its rows are numbered by id)")
    id_map, _ = IdMap.build(values if values.dtype.kind == "U" else values.astype(np.int64))
    log.warning("%s: ids of node type %r stored as dense ids 0..%d with a map; requests name them by the "
                "original ids", source, ntype, len(id_map) - 1)
    return id_map


def _one_array(path: Path) -> np.ndarray:
    arr = load_arrays(path)
    if isinstance(arr, dict):
        raise DatasetError(f"{path}: one .npy array was expected")
    return arr
