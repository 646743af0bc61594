"""Heterogeneous datasets: several node types, one CSR per edge type, opened with mmap.

Layout (all arrays little-endian .npy):
    meta.json               kind "hetero", name, node_types [{name, num_nodes, feature_dim,
                            ...}], edge_types [{type: [src, rel, dst], num_edges}], fingerprint
    nodes/<i>/features.npy  float32 [N_t, F_t]   node type i (widths may differ per type)
    nodes/<i>/labels.npy    int64 [N_t]          optional
    nodes/<i>/node_ids.npy  external ids         optional (hybridgnn.graph.idmap)
    edges/<j>/indptr.npy    int64 [N_dst + 1]    edge type j = (src, rel, dst): row v of the
    edges/<j>/indices.npy   int32/int64 [E_j]    dst type lists the src-type nodes v
                                                 aggregates from (PyG's edge (s, v)), sorted
                                                 and unique per row
    workload/               typed PSGS and FAP tables (hybridgnn.workload.typed)

Types live in directories numbered by their position in meta.json, so any names PyG
accepts (spaces, double underscores) are stored as they are. Node ids are per type:
node v of type t is row v of t's arrays.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.graph.idmap import ID_MAP_FILE, IdMap
from hybridgnn.graph.store import (
    DatasetError,
    check_csr,
    check_index_dtypes,
    dataset_kind,
    hash_csr,
    load_npy,
    read_meta,
)
from hybridgnn.types import EdgeType

FORMAT_VERSION = 1
MAX_TYPE_NAME = 128


def edge_type_key(edge_type: EdgeType) -> str:
    """PyG's string form of an edge type, 'src__rel__dst' (JSON keys, fanout dicts)."""
    return "__".join(edge_type)


def check_type_name(name, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_TYPE_NAME:
        raise DatasetError(f"a {what} name must be a non-empty string of at most {MAX_TYPE_NAME} "
                           f"characters, got {name!r}")
    return name


@dataclass(frozen=True)
class NodeTypeData:
    """One node type's rows: features (mmap), labels and external ids when stored."""

    name: str
    features: np.ndarray
    labels: np.ndarray | None
    id_map: IdMap | None

    @property
    def num_nodes(self) -> int:
        return int(self.features.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])


@dataclass(frozen=True)
class EdgeTypeData:
    """One edge type's CSR: row v (a dst-type node) lists its src-type neighbours."""

    edge_type: EdgeType
    indptr: np.ndarray
    indices: np.ndarray

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    def degrees(self) -> np.ndarray:
        return np.diff(self.indptr)


def write_hetero_dataset(
    path: str | Path,
    *,
    nodes: dict[str, dict],
    edges: dict[EdgeType, tuple[np.ndarray, np.ndarray]],
    name: str | None = None,
    extra: dict | None = None,
) -> Path:
    """Write a heterogeneous dataset. nodes: type -> {"features": [N, F] float32, optionally
    "labels": [N] and "id_map": IdMap}; edges: (src, rel, dst) -> (indptr over dst nodes,
    indices of src nodes), as graph.csr.coo_to_csr builds them."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    node_meta, edge_meta = [], []
    for i, (ntype, rows) in enumerate(nodes.items()):
        check_type_name(ntype, "node type")
        d = root / "nodes" / str(i)
        d.mkdir(parents=True, exist_ok=True)
        x = np.ascontiguousarray(rows["features"], dtype=np.float32)
        if x.ndim != 2:
            raise DatasetError(f"features of node type {ntype!r} must be 2-D [N, F], got shape {x.shape}")
        np.save(d / "features.npy", x)
        entry = {"name": ntype, "num_nodes": int(x.shape[0]), "feature_dim": int(x.shape[1]), "num_classes": 0}
        if rows.get("labels") is not None:
            y = np.ascontiguousarray(rows["labels"], dtype=np.int64).reshape(-1)
            np.save(d / "labels.npy", y)
            entry["num_classes"] = int(y.max()) + 1 if y.size else 0
        if rows.get("id_map") is not None:
            rows["id_map"].save(d)
            entry["id_map"] = rows["id_map"].kind
        node_meta.append(entry)
    h = hashlib.sha256()
    for j, (etype, (indptr, indices)) in enumerate(edges.items()):
        etype = tuple(check_type_name(t, "edge type part") for t in etype)
        if len(etype) != 3 or etype[0] not in nodes or etype[2] not in nodes:
            raise DatasetError(f"edge type {etype!r} must be (src, rel, dst) with node types among {list(nodes)}")
        d = root / "edges" / str(j)
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "indptr.npy", np.ascontiguousarray(indptr, dtype=np.int64))
        np.save(d / "indices.npy", np.ascontiguousarray(indices))
        edge_meta.append({"type": list(etype), "num_edges": int(indices.shape[0]), "index_dtype": str(indices.dtype)})
        h.update(json.dumps(list(etype)).encode())
        hash_csr(h, indptr, indices)
    for entry in node_meta:  # types by name and in order: rows are numbered per type
        h.update(json.dumps(entry["name"]).encode())
        h.update(np.int64([entry["num_nodes"], entry["feature_dim"]]).tobytes())
    meta = {
        "kind": "hetero",
        "format_version": FORMAT_VERSION,
        "name": name or root.name,
        "node_types": node_meta,
        "edge_types": edge_meta,
        "fingerprint": h.hexdigest()[:16],
        "created_unix_s": time.time(),
    }
    meta.update(extra or {})
    (root / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return root


def _load(path: Path, required: bool = True):
    return load_npy(path, f"heterogeneous dataset lacks {path}" if required else None)


class HeteroGraphStore:
    """A heterogeneous dataset opened read-only with mmap; one instance serves every worker."""

    def __init__(self, root: Path, meta: dict, nodes: dict[str, NodeTypeData],
                 edges: dict[EdgeType, EdgeTypeData]):
        self.root = root
        self.meta = meta
        self.nodes = nodes
        self.edges = edges

    @classmethod
    def open(cls, path: str | Path, *, validate: str = "quick") -> HeteroGraphStore:
        """Open a heterogeneous dataset directory. validate: 'none', 'quick' (shapes,
        dtypes, endpoints, every index in range, indptr monotone) or 'full' (the same)."""
        root = Path(path)
        meta = read_meta(root)
        if meta.get("kind") != "hetero":
            raise DatasetError(f"{root} holds a homogeneous dataset; open it with GraphStore")
        nodes: dict[str, NodeTypeData] = {}
        try:
            for i, entry in enumerate(meta["node_types"]):
                d = root / "nodes" / str(i)
                try:
                    id_map = IdMap.load(d)
                except ValueError as exc:
                    raise DatasetError(f"{d / ID_MAP_FILE} is not a readable id map: {exc}") from exc
                nodes[check_type_name(entry["name"], "node type")] = NodeTypeData(
                    entry["name"], _load(d / "features.npy"), _load(d / "labels.npy", False), id_map)
            edges: dict[EdgeType, EdgeTypeData] = {}
            for j, entry in enumerate(meta["edge_types"]):
                etype = tuple(entry["type"])
                d = root / "edges" / str(j)
                edges[etype] = EdgeTypeData(etype, _load(d / "indptr.npy"), _load(d / "indices.npy"))
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{root / 'meta.json'} does not describe a heterogeneous dataset: "
                               f"missing or malformed {exc}") from exc
        store = cls(root, meta, nodes, edges)
        if validate != "none":
            store.validate(full=validate == "full")
        return store

    def validate(self, *, full: bool = False) -> None:
        if not self.nodes:
            raise DatasetError(f"{self.root}: a heterogeneous dataset needs at least one node type")
        if len(self.meta["node_types"]) != len(self.nodes):
            raise DatasetError(f"{self.root / 'meta.json'} names a node type twice")
        for entry, (ntype, node) in zip(self.meta["node_types"], self.nodes.items(), strict=True):
            x = node.features
            if x.ndim != 2 or x.dtype != np.float32:
                raise DatasetError(f"features of node type {ntype!r} must be float32 [N, F], got {x.dtype} {x.shape}")
            if entry.get("num_nodes", x.shape[0]) != x.shape[0]:
                raise DatasetError(f"meta.json says node type {ntype!r} has {entry['num_nodes']} nodes "
                                   f"but its features hold {x.shape[0]}")
            if node.labels is not None and node.labels.shape != (x.shape[0],):
                raise DatasetError(f"labels of node type {ntype!r} must be [{x.shape[0]}], got {node.labels.shape}")
            if node.id_map is not None and len(node.id_map) != x.shape[0]:
                raise DatasetError(f"the id map of node type {ntype!r} names {len(node.id_map)} nodes, "
                                   f"not {x.shape[0]}")
        for (src, rel, dst), edge in self.edges.items():
            what = f"edge type {edge_type_key((src, rel, dst))!r}"
            if src not in self.nodes or dst not in self.nodes:
                raise DatasetError(f"{what} joins node types that are not in the dataset")
            ip, ix = edge.indptr, edge.indices
            if ip.ndim != 1 or ip.shape[0] != self.nodes[dst].num_nodes + 1 or ip.dtype.kind != "i":
                raise DatasetError(f"{what}: indptr must be signed integer [num {dst} nodes + 1 = "
                                   f"{self.nodes[dst].num_nodes + 1}], got {ip.dtype} {ip.shape}")
            if ix.ndim != 1 or ix.dtype.kind not in "iu":
                raise DatasetError(f"{what}: indices must be a 1-D integer array, got {ix.dtype} {ix.shape}")
            check_index_dtypes(ip, ix, f"{what}: ")
            if int(ip[0]) != 0 or int(ip[-1]) != ix.shape[0]:
                raise DatasetError(f"{what}: indptr must run from 0 to len(indices)={ix.shape[0]}, "
                                   f"got {int(ip[0])}..{int(ip[-1])}")
            # quick too: the typed sampler reads rows without bounds checks
            check_csr(ip, ix, self.nodes[src].num_nodes, f"{what}: ")

    @property
    def node_types(self) -> list[str]:
        return list(self.nodes)

    @property
    def edge_types(self) -> list[EdgeType]:
        return list(self.edges)

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """(node types, edge types), as PyG's HeteroData.metadata() gives them."""
        return self.node_types, self.edge_types

    def edge_types_into(self, node_type: str) -> list[EdgeType]:
        """The edge types whose messages node_type receives (its dst), in stored order."""
        return [e for e in self.edges if e[2] == node_type]

    def num_nodes(self, node_type: str) -> int:
        return self.nodes[node_type].num_nodes

    def symmetric(self, edge_type: EdgeType) -> bool:
        """Whether a relation of a node type to itself holds every edge both ways (as
        PyG's ToUndirected leaves one without a rev_ type); computed once per relation."""
        cache = self.__dict__.setdefault("_symmetric", {})
        if edge_type not in cache:
            s, _, t = edge_type
            edge = self.edges[edge_type]
            if s != t:
                cache[edge_type] = False
            else:
                n = self.num_nodes(t)
                src = np.asarray(edge.indices, dtype=np.int64)
                dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(np.asarray(edge.indptr)))
                cache[edge_type] = bool(np.array_equal(np.sort(src * n + dst), np.sort(dst * n + src)))
        return cache[edge_type]

    @property
    def fingerprint(self) -> str:
        return str(self.meta.get("fingerprint", ""))

    @property
    def name(self) -> str:
        return str(self.meta.get("name", self.root.name))

    def describe(self) -> dict:
        def degree_summary(edge: EdgeTypeData) -> dict:
            deg = edge.degrees()
            return {"degree_mean": float(deg.mean()) if deg.size else 0.0,
                    "degree_max": int(deg.max()) if deg.size else 0}

        return {
            "path": str(self.root),
            "name": self.name,
            "kind": "hetero",
            "node_types": {t: {"num_nodes": n.num_nodes, "feature_dim": n.feature_dim,
                               "labelled": n.labels is not None,
                               **({"id_map": n.id_map.kind} if n.id_map is not None else {})}
                           for t, n in self.nodes.items()},
            "edge_types": {edge_type_key(e): {"num_edges": d.num_edges, **degree_summary(d)}
                           for e, d in self.edges.items()},
            "num_nodes": sum(n.num_nodes for n in self.nodes.values()),
            "num_edges": sum(d.num_edges for d in self.edges.values()),
            "fingerprint": self.fingerprint,
        }


def reverse_edge_type(edge_types: list[EdgeType], e: EdgeType) -> EdgeType | None:
    """The edge type that reverses e as PyG's ToUndirected names it (rel <-> rev_rel), or
    None."""
    s, rel, t = e
    for f in edge_types:
        if f != e and f[0] == t and f[2] == s and (f[1] == f"rev_{rel}" or rel == f"rev_{f[1]}"):
            return f
    return None


def open_any(path: str | Path, *, validate: str = "quick"):
    """A GraphStore or a HeteroGraphStore, whichever the directory holds."""
    from hybridgnn.graph.store import GraphStore

    if dataset_kind(path) == "hetero":
        return HeteroGraphStore.open(path, validate=validate)
    return GraphStore.open(path, validate=validate)
