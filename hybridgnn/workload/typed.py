"""PSGS and FAP of heterogeneous graphs, over fanouts per edge type.

Edge type e = (s, rel, t) has its 0/1 adjacency A_e (row v of type t lists its s-type
candidates), deg_e = A_e·1 and r_{k,e} = min(deg_e, l_{k,e}) / deg_e (0 where deg_e = 0).
A sample rooted at a node of type t expands, at hop k, every frontier node v of type t
through every edge type into t, drawing min(deg_e(v), l_{k,e}) neighbours of each.

    PSGS: w_t = 1 for every type; for k = K..1: w_t = 1 + Σ_{e=(s,·,t)} r_{k,e} ⊙ (A_e·w_s)
          (then w_t[v] = expected sampled nodes, with multiplicity, rooted at v of type t)
    FAP:  x_{t0} = p0 (the seed distribution over seed type t0), x_t = 0 otherwise;
          for k = 1..K: x'_s = Σ_{e=(s,·,t)} A_eᵀ·(r_{k,e} ⊙ x_t); acc_s += x'_s
          (acc_t[u] = expected feature reads of node u of type t per request)

K SpMVs per edge type each. One chain gives PSGS for every seed type at once; FAP is per
seed type, p0 uniform, degree-weighted or from a server's seed log (a .counts.npz of request
counts per node type, normalised per type as a homogeneous log). The homogeneous tables
(tables.py) are the one-type, one-edge-type case.
"""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from hybridgnn.capabilities import save_array, write_replacing
from hybridgnn.errors import ConfigError
from hybridgnn.graph.hetero import HeteroGraphStore, edge_type_key
from hybridgnn.graph.store import load_arrays
from hybridgnn.types import EdgeType
from hybridgnn.workload.tables import (
    COUNTS_SUFFIX,
    PSGS_LIMIT,
    TYPED_COUNTS_SUFFIX,
    cached_table,
    counts_distribution,
    hop_ratios,
    log_key,
)

TypedFanouts = dict[EdgeType, tuple[int, ...]]
TYPED_SEED_KINDS = ("uniform", "degree")
MAX_FANOUT = 1 << 20


def _graph_file(seed_key: str) -> str:
    """The file naming the graph that the PSGS and seed_key's FAP tables beside it were
    computed on (one per seed kind: saving one kind's tables rewrites the PSGS, not the
    other kinds' FAP)."""
    return f"graph-{seed_key}"


def resolve_edge_type(edge_types: list[EdgeType], key) -> EdgeType:
    """An edge type named as (src, rel, dst), 'src__rel__dst', or a relation name that only
    one edge type has."""
    if isinstance(key, (tuple, list)) and tuple(key) in edge_types:
        return tuple(key)  # type: ignore[return-value]
    if isinstance(key, str):
        by_key = [e for e in edge_types if edge_type_key(e) == key]
        if by_key:
            return by_key[0]
        by_rel = [e for e in edge_types if e[1] == key]
        if len(by_rel) == 1:
            return by_rel[0]
        if len(by_rel) > 1:
            raise ValueError(f"relation {key!r} names {len(by_rel)} edge types; name one as 'src__rel__dst': "
                             f"{[edge_type_key(e) for e in by_rel]}")
    raise ValueError(f"unknown edge type {key!r}; the graph has {[edge_type_key(e) for e in edge_types]}")


def _hops(values, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"fanouts of {what} must be a list of integers per hop, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) <= MAX_FANOUT:
            raise ValueError(f"fanouts of {what} must be integers in [0, {MAX_FANOUT}], got {v!r}")
        out.append(int(v))
    if not out:
        raise ValueError(f"fanouts of {what} must name at least one hop")
    return tuple(out)


def typed_fanouts(edge_types: list[EdgeType], fanouts) -> TypedFanouts:
    """Fanouts per edge type, as PyG's NeighborLoader takes them: one list per hop for
    every edge type, or a dict {edge type: list} naming every edge type (0: not sampled
    at that hop). Every list has the same number of hops."""
    if isinstance(fanouts, Mapping):
        out: TypedFanouts = {}
        for key, values in fanouts.items():
            etype = resolve_edge_type(edge_types, key)
            if etype in out:
                raise ValueError(f"fanouts name edge type {edge_type_key(etype)!r} twice")
            out[etype] = _hops(values, edge_type_key(etype))
        missing = [edge_type_key(e) for e in edge_types if e not in out]
        if missing:
            raise ValueError(f"fanouts must name every edge type (0 leaves one unsampled); missing {missing}")
        out = {e: out[e] for e in edge_types}
    else:
        hops = _hops(fanouts, "every edge type")
        out = {e: hops for e in edge_types}
    if len({len(v) for v in out.values()}) > 1:
        raise ValueError(f"fanouts must have one number of hops for every edge type, got "
                         f"{ {edge_type_key(e): list(v) for e, v in out.items()} }")
    return out


def num_hops(fanouts: TypedFanouts) -> int:
    return len(next(iter(fanouts.values()))) if fanouts else 0


def typed_fanout_key(fanouts: TypedFanouts) -> str:
    """A file-name-safe key: '15-10' when every edge type has the same fanouts, else a hash."""
    distinct = set(fanouts.values())
    if len(distinct) == 1:
        return "-".join(str(v) for v in next(iter(distinct)))
    canon = json.dumps(sorted([list(e), list(v)] for e, v in fanouts.items()))
    return "t" + hashlib.sha256(canon.encode()).hexdigest()[:12]


def adjacency(graph: HeteroGraphStore, edge_type: EdgeType) -> sp.csr_matrix:
    """A_e over the store's own arrays: [num dst nodes, num src nodes]."""
    edge = graph.edges[edge_type]
    src, _, dst = edge_type
    indptr, indices = np.asarray(edge.indptr), np.asarray(edge.indices)
    if edge.num_edges < 2**31 - 1 and indices.dtype == np.int32:
        indptr = indptr.astype(np.int32)
    data = np.ones(edge.num_edges, dtype=np.float32)
    return sp.csr_matrix((data, indices, indptr), shape=(graph.num_nodes(dst), graph.num_nodes(src)), copy=False)


def _chain(graph: HeteroGraphStore, fanouts: TypedFanouts):
    """(A_e, r_{k,e} per hop) per edge type."""
    return {e: (adjacency(graph, e), hop_ratios(graph.edges[e].degrees(), fanouts[e])) for e in graph.edges}


def compute_typed_psgs(graph: HeteroGraphStore, fanouts: TypedFanouts, *, chain=None) -> dict[str, np.ndarray]:
    chain = _chain(graph, fanouts) if chain is None else chain
    w = {t: np.ones(graph.num_nodes(t)) for t in graph.nodes}
    for k in reversed(range(num_hops(fanouts))):
        nxt = {t: np.ones(graph.num_nodes(t)) for t in graph.nodes}
        for (s, _, t), (a, ratios) in chain.items():
            nxt[t] += ratios[k] * (a @ w[s])
        w = nxt
        _check_limit(w, fanouts)
    return {t: v.astype(np.float32) for t, v in w.items()}  # within tables.py's PSGS_LIMIT


def _check_limit(w: dict[str, np.ndarray], fanouts: TypedFanouts) -> None:
    for t, v in w.items():
        if v.size and float(v.max()) > PSGS_LIMIT:
            raise ConfigError(
                f"fanouts { {edge_type_key(e): list(f) for e, f in fanouts.items()} } give a seed of type {t!r} more "
                f"than {PSGS_LIMIT:.0e} expected sampled nodes (PSGS, counted with multiplicity) on this graph, past "
                f"what a workload table holds: sample fewer hops or fewer neighbours per hop")


def compute_typed_fap(graph: HeteroGraphStore, fanouts: TypedFanouts, seed_type: str, p0: np.ndarray, *,
                      chain=None) -> dict[str, np.ndarray]:
    chain = _chain(graph, fanouts) if chain is None else chain
    x = {t: np.zeros(graph.num_nodes(t)) for t in graph.nodes}
    x[seed_type] = np.asarray(p0, dtype=np.float64)
    acc = {t: v.copy() for t, v in x.items()}
    for k in range(num_hops(fanouts)):
        nxt = {t: np.zeros(graph.num_nodes(t)) for t in graph.nodes}
        for (s, _, t), (a, ratios) in chain.items():
            nxt[s] += a.T @ (ratios[k] * x[t])
        x = nxt
        for t in acc:
            acc[t] += x[t]
    return {t: v.astype(np.float32) for t, v in acc.items()}


def typed_seed_distribution(graph: HeteroGraphStore, seed_type: str, kind: str) -> np.ndarray:
    """p0 over the nodes of seed_type: 'uniform', or 'degree' (in-edges of every edge type)."""
    n = graph.num_nodes(seed_type)
    if kind == "uniform" or n == 0:
        return np.full(n, 1.0 / max(n, 1))
    if kind == "degree":
        deg = sum((graph.edges[e].degrees().astype(np.float64) for e in graph.edge_types_into(seed_type)),
                  np.zeros(n))
        return deg / deg.sum() if deg.sum() > 0 else np.full(n, 1.0 / n)
    raise ValueError(f"the seed distribution of a heterogeneous graph must be one of {TYPED_SEED_KINDS} or a seed "
                     f"log ({TYPED_COUNTS_SUFFIX}, as serve --seed-log writes), got {kind!r}")


def write_typed_counts(path: Path, counts: Mapping[str, np.ndarray]) -> None:
    """A heterogeneous server's seed log: an uncompressed .npz holding one array of per-node
    request counts per node type, named by it (np.savez's layout, written entry by entry:
    savez takes names as keywords, and a node type may be named `file`), replacing `path`
    whole (temporary, fsync, rename)."""
    def write(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for node_type, values in counts.items():
                with archive.open(f"{node_type}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asarray(values), allow_pickle=False)

    write_replacing(Path(path), write)


def read_typed_counts(graph: HeteroGraphStore, path: str | Path) -> dict[str, np.ndarray]:
    """The request counts (float64) per node type of a heterogeneous server's seed log, in
    the graph's type order; ValueError in one line for a file that is not one of this graph's
    (values are checked by counts_distribution)."""
    path = Path(path)
    if path.name.endswith(COUNTS_SUFFIX):
        raise ValueError(f"seed counts {path} are a homogeneous server's (one counts array); {graph.root} is "
                         f"heterogeneous: give the {TYPED_COUNTS_SUFFIX} (one counts array per node type) its "
                         "server's --seed-log wrote")
    if path.name.endswith(TYPED_COUNTS_SUFFIX) and not path.exists():
        raise ValueError(f"no seed log {str(path)!r} (the seed distribution of a heterogeneous graph is one of "
                         f"{TYPED_SEED_KINDS} or the {TYPED_COUNTS_SUFFIX} serve --seed-log writes)")
    if not path.name.endswith(TYPED_COUNTS_SUFFIX) or not path.is_file():
        raise ValueError(f"the seed distribution of a heterogeneous graph must be one of {TYPED_SEED_KINDS} or a "
                         f"seed log ({TYPED_COUNTS_SUFFIX}, as serve --seed-log writes); {str(path)!r} is neither")
    arrays = load_arrays(path)  # without pickle; DatasetError (one line) for a file that is not an archive
    if not isinstance(arrays, dict):
        raise ValueError(f"seed counts {path}: an .npz archive of one counts array per node type was expected, not "
                         "a .npy array")
    if not arrays:
        raise ValueError(f"seed counts {path} name no node type: the server counted no request")
    unknown = [t for t in arrays if t not in graph.nodes]
    if unknown:
        raise ValueError(f"seed counts {path} name node type {unknown[0]!r}, which {graph.root} does not have (its "
                         f"node types are {graph.node_types})")
    out = {}
    for t in graph.node_types:
        if t in arrays:
            if arrays[t].dtype.kind not in "biuf":
                raise ValueError(f"seed counts of node type {t!r} in {path} must be numbers, got {arrays[t].dtype}")
            out[t] = arrays[t].astype(np.float64)
    return out


def typed_seed_distributions(graph: HeteroGraphStore, seed: str | Path) -> tuple[dict[str, np.ndarray], str]:
    """p0 per seed type and the key its FAP tables are stored under: 'uniform', 'degree', or
    a seed log (.counts.npz): each logged type's counts normalised as a homogeneous log's,
    a type the log does not name (no request was rooted there) uniform."""
    if seed in TYPED_SEED_KINDS:
        return {t: typed_seed_distribution(graph, t, str(seed)) for t in graph.node_types}, str(seed)
    counts = read_typed_counts(graph, seed)
    p0 = {t: (counts_distribution(counts[t], graph.num_nodes(t), f"seed counts of node type {t!r} in {seed}")
              if t in counts else typed_seed_distribution(graph, t, "uniform")) for t in graph.node_types}
    return p0, log_key(*(part for t, v in counts.items() for part in (t, v)))


@dataclass
class TypedWorkloadTables:
    """PSGS per node type (as the seed type) and FAP per seed type, for one dataset,
    typed fanouts and seed distribution."""

    fanouts: TypedFanouts
    seed_key: str
    psgs: dict[str, np.ndarray]
    fap: dict[str, dict[str, np.ndarray]]  # seed type -> node type -> expected reads
    build_s: float = 0.0

    def batch_psgs(self, node_type: str, node_ids: np.ndarray) -> float:
        """The summed PSGS of seeds of one type (a pair request sums both ends')."""
        return float(np.asarray(self.psgs[node_type])[node_ids].sum(dtype=np.float64))

    @staticmethod
    def directory(root: Path, fanouts: TypedFanouts) -> Path:
        return Path(root) / "workload" / f"typed-{typed_fanout_key(fanouts)}"

    def save(self, graph: HeteroGraphStore) -> Path:
        """The tables beside the dataset, then (last) the fingerprint of the graph they were
        computed on: a dataset rewritten in place never finds another graph's tables."""
        d = self.directory(graph.root, self.fanouts)
        d.mkdir(parents=True, exist_ok=True)
        (d / _graph_file(self.seed_key)).unlink(missing_ok=True)
        index = {t: i for i, t in enumerate(graph.node_types)}
        for t, v in self.psgs.items():
            save_array(d / f"psgs-{index[t]}.npy", v)  # a server may map the old one
        for seed_type, per_type in self.fap.items():
            for t, v in per_type.items():
                save_array(d / f"fap-{self.seed_key}-{index[seed_type]}-{index[t]}.npy", v)
        (d / _graph_file(self.seed_key)).write_text(graph.fingerprint + "\n")
        return d

    @classmethod
    def build(cls, graph: HeteroGraphStore, fanouts, seed: str | Path = "uniform") -> TypedWorkloadTables:
        t0 = time.perf_counter()
        tf = typed_fanouts(graph.edge_types, fanouts)
        p0, key = typed_seed_distributions(graph, seed)
        chain = _chain(graph, tf)
        psgs = compute_typed_psgs(graph, tf, chain=chain)
        fap = {t: compute_typed_fap(graph, tf, t, p0[t], chain=chain) for t in graph.node_types}
        return cls(tf, key, psgs, fap, time.perf_counter() - t0)

    @classmethod
    def load_or_build(cls, graph: HeteroGraphStore, fanouts, seed: str | Path = "uniform", *,
                      save: bool = True) -> TypedWorkloadTables:
        """The tables stored beside the dataset, built (and saved) when absent or stale."""
        tf = typed_fanouts(graph.edge_types, fanouts)
        d = cls.directory(graph.root, tf)
        types = graph.node_types
        key = str(seed) if seed in TYPED_SEED_KINDS else typed_seed_distributions(graph, seed)[1]
        try:
            if (d / _graph_file(key)).read_text().strip() != graph.fingerprint:
                raise ValueError("computed on another graph")
            # each table as the homogeneous ones are read: of its type's size, and finite and
            # >= 0 (float32 tables of an earlier version held inf past 55 hops of 5)
            psgs = {t: cached_table(d / f"psgs-{i}.npy", graph.num_nodes(t)) for i, t in enumerate(types)}
            fap = {s: {t: cached_table(d / f"fap-{key}-{si}-{i}.npy", graph.num_nodes(t)) for i, t in enumerate(types)}
                   for si, s in enumerate(types)}
            if all(v is not None for v in (*psgs.values(), *(v for f in fap.values() for v in f.values()))):
                return cls(tf, key, psgs, fap)
        except (OSError, ValueError):
            pass
        tables = cls.build(graph, tf, seed)
        if save:
            try:
                tables.save(graph)
            except OSError:
                pass  # a read-only dataset directory still serves, just without the cache
        return tables
