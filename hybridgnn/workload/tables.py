"""PSGS and FAP by sparse matrix–vector chains (docs/architecture.md).

With A the 0/1 sampling adjacency (row i = candidates of i), deg = A·1 and
r_k = min(deg, l_k)/deg (0 where deg = 0), E_k = diag(r_k)·A:

    PSGS: w = 1; for k = K..1: w = 1 + E_k·w                  (expected sampled nodes with
                                                               multiplicity, per seed)
    FAP:  x = a = p0; for k = 1..K: x = E_kᵀ·x; a += x        (expected feature reads of each
                                                               node per request)
K SpMVs each, O(K·|E|), in float64. Tables are float32 .npy files in <dataset>/workload/
(a stored one holding a value that is not finite is computed again).

PSGS counts with multiplicity, so on a dense graph it grows as the product of the
fanouts: 5 per hop passed float32's 3.4e38 at 55 hops (the tables held inf, which the
batcher's running sums turned into NaN). Fanouts that give a seed more than PSGS_LIMIT
are refused in one line while the table is computed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from hybridgnn.capabilities import save_array
from hybridgnn.errors import ConfigError
from hybridgnn.graph.store import DatasetError, GraphStore, load_arrays

log = logging.getLogger(__name__)

SEED_KINDS = ("uniform", "degree")
COUNTS_SUFFIX = ".counts.npy"  # per-node request counts, as a homogeneous `serve --seed-log` writes them
TYPED_COUNTS_SUFFIX = ".counts.npz"  # one counts array per node type, as a heterogeneous server writes them

# The most expected sampled nodes per seed a table holds: a hundred million times below
# float32's 3.4e38, so a float32 sum over any batch stays finite (the router, batcher,
# admission and profiler sum in float64 anyway), and the float64 chain, checked every hop,
# cannot step from under it to inf (one hop multiplies by at most a degree, below 2**63).
# No real sampler comes near it: 1e30 nodes is past any graph's size.
PSGS_LIMIT = 1e30


def check_psgs_limit(w: np.ndarray, fanouts) -> None:
    """ConfigError (one line) when a PSGS chain passed PSGS_LIMIT."""
    if w.size and float(w.max()) > PSGS_LIMIT:
        raise ConfigError(f"fanouts {list(fanouts)} give a seed more than {PSGS_LIMIT:.0e} expected sampled nodes "
                          f"(PSGS, counted with multiplicity) on this graph, past what a workload table holds: "
                          f"sample fewer hops or fewer neighbours per hop")


def fanout_key(fanouts) -> str:
    return "-".join(str(int(f)) for f in fanouts)


def sampling_matrix(graph: GraphStore) -> sp.csr_matrix:
    """A as a scipy CSR over the store's own index arrays (no copy of the indices when the
    edge count fits int32)."""
    indptr = np.asarray(graph.indptr)
    indices = np.asarray(graph.indices)
    if graph.num_edges < 2**31 - 1 and indices.dtype == np.int32:
        indptr = indptr.astype(np.int32)
    data = np.ones(graph.num_edges, dtype=np.float32)
    return sp.csr_matrix((data, indices, indptr), shape=(graph.num_nodes, graph.num_nodes), copy=False)


def hop_ratios(degrees: np.ndarray, fanouts) -> list[np.ndarray]:
    """r_k = min(deg, l_k) / deg per hop, 0 for isolated nodes."""
    deg = degrees.astype(np.float64)
    safe = np.where(deg > 0, deg, 1.0)
    return [np.where(deg > 0, np.minimum(deg, float(l)) / safe, 0.0) for l in fanouts]


def compute_psgs(graph: GraphStore, fanouts, *, matrix: sp.csr_matrix | None = None) -> np.ndarray:
    a = sampling_matrix(graph) if matrix is None else matrix
    ratios = hop_ratios(graph.degrees(), fanouts)
    w = np.ones(graph.num_nodes, dtype=np.float64)
    for r in reversed(ratios):
        w = 1.0 + r * (a @ w)
        check_psgs_limit(w, fanouts)  # every hop: the next cannot reach inf from under the limit
    return w.astype(np.float32)


def compute_fap(graph: GraphStore, fanouts, p0: np.ndarray, *, matrix: sp.csr_matrix | None = None) -> np.ndarray:
    a = sampling_matrix(graph) if matrix is None else matrix
    at = a.T  # CSC view; no copy
    ratios = hop_ratios(graph.degrees(), fanouts)
    x = np.asarray(p0, dtype=np.float64)
    acc = x.copy()
    for r in ratios:
        x = at @ (r * x)
        acc += x
    return acc.astype(np.float32)  # it sums to a seed's expected PSGS, so stays within its limit


def seed_distribution(graph: GraphStore, kind: str | Path) -> tuple[np.ndarray, str]:
    """p0 over nodes and the key it is stored under: 'uniform', 'degree', or a request log
    (a .npy of node ids, a text file of whitespace-separated ids, or a .counts.npy of
    per-node counts) counted per node."""
    n = graph.num_nodes
    if n == 0:  # was a ZeroDivisionError traceback from workload build, place and serve
        raise ValueError(f"dataset {graph.root} has no nodes: there is no seed distribution (nor a workload table) "
                         "to compute")
    if kind == "uniform":
        return np.full(n, 1.0 / n), "uniform"
    if kind == "degree":
        deg = graph.degrees().astype(np.float64)
        total = deg.sum()
        return (deg / total if total > 0 else np.full(n, 1.0 / n)), "degree"
    path = Path(kind)
    if not path.is_file():
        # a mistyped log path was "... or a request-log file; 'requets.txt' is neither"
        why = "no such file" if not path.exists() else "a directory" if path.is_dir() else "not a regular file"
        raise ValueError(f"seed distribution {str(path)!r} is neither one of {SEED_KINDS} nor a request-log file "
                         f"({why})")
    if path.name.endswith(TYPED_COUNTS_SUFFIX):
        raise ValueError(f"seed counts {path} are a heterogeneous server's (one counts array per node type); "
                         f"{graph.root} is homogeneous: give the {COUNTS_SUFFIX} its server's --seed-log wrote")
    if path.name.endswith(COUNTS_SUFFIX):  # per-node request counts, as `serve --seed-log` writes
        counts = np.asarray(_request_log_array(path), dtype=np.float64).reshape(-1)
        p0 = counts_distribution(counts, n, f"seed counts {path}")
        return p0, log_key(counts)
    if path.suffix == ".npy":
        ids = np.asarray(_request_log_array(path)).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"request log {path} must hold integer node ids, got {ids.dtype}")
    else:
        try:
            ids = np.array(path.read_text().split(), dtype=np.int64)
        except ValueError as exc:
            raise ValueError(f"request log {path} must hold whitespace-separated integer node ids: {exc}") from exc
        except OverflowError:  # an id past int64 was this traceback
            raise ValueError(f"request log {path} has ids outside the graph's [0, {n}), some past int64") from None
    if ids.size == 0:
        raise ValueError(f"request log {path} holds no node ids")
    outside = (ids < 0) | (ids >= n)  # in the log's own dtype: a uint64 id past int64 was named as a negative one
    if outside.any():
        raise ValueError(f"request log {path} has {int(outside.sum())} ids outside the graph's [0, {n}), the first "
                         f"{int(ids[np.argmax(outside)])}")
    counts = np.bincount(ids.astype(np.int64, copy=False), minlength=n).astype(np.float64)
    return counts / counts.sum(), log_key(counts)


def counts_distribution(counts: np.ndarray, n: int, what: str) -> np.ndarray:
    """p0 from per-node request counts (float64): each node's share of the requests.
    ValueError (one line, naming `what` and the fault) unless they are n finite
    non-negative counts, not all zero."""
    fault = (f"it holds {counts.shape[0] if counts.ndim == 1 else counts.shape}" if counts.shape != (n,) else
             "some are not finite" if not np.isfinite(counts).all() else
             "some are negative" if (counts < 0).any() else
             "all are zero" if counts.sum() <= 0 else None)
    if fault is not None:
        raise ValueError(f"{what} must hold {n} finite non-negative counts, not all zero: {fault}")
    return counts / counts.sum()


def log_key(*parts: np.ndarray | str) -> str:
    """The key tables from a request log are stored under: a digest of its counts (float64)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part.tobytes())
    return f"log-{h.hexdigest()[:10]}"


def _request_log_array(path: Path) -> np.ndarray:
    """The array of a request-log .npy; DatasetError (one line) for a file that is not one:
    an empty one was an EOFError traceback, noise numpy's advice to load it unsafely."""
    arrays = load_arrays(path)
    if isinstance(arrays, dict):
        raise DatasetError(f"{path}: a .npy array was expected, not an .npz archive")
    if arrays.dtype.kind not in "biuf":
        raise DatasetError(f"{path}: request logs hold numbers, got {arrays.dtype}")
    return arrays


def cached_table(path: Path, num_nodes: int) -> np.ndarray | None:
    """A stored table, memory-mapped, or None (it is then computed again) when the file is
    not one: unreadable (empty, truncated, overwritten), of another shape, not floats, or
    holding a value that is not finite and >= 0. A damaged cache was a traceback or a
    misleading one-line error at startup, or served NaN and negative PSGS to the router."""
    try:
        table = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        log.warning("workload table %s is not readable (%s: %s): computing it again", path, type(exc).__name__, exc)
        return None
    if table.ndim == 1 and table.dtype.kind == "f" and table.shape[0] != num_nodes:
        return None  # a table of an earlier graph size: computed again, as before
    if table.shape != (num_nodes,) or table.dtype.kind != "f":
        log.warning("workload table %s holds %s %s, not float [%d]: computing it again", path, table.dtype,
                    table.shape, num_nodes)
        return None
    if not (bool(np.isfinite(table).all()) and not bool((table < 0).any())):
        log.warning("workload table %s holds values that are not finite and >= 0: computing it again", path)
        return None
    return table


def _read_fingerprint(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@dataclass
class WorkloadTables:
    """PSGS and FAP for one dataset, fanouts and seed distribution."""

    fanouts: tuple[int, ...]
    seed_key: str
    psgs: np.ndarray
    fap: np.ndarray
    build_s: float = 0.0
    graph_fingerprint: str | None = None  # the graph they were computed on (saved beside them)

    def __post_init__(self):
        # Plain ndarray views of the (often memory-mapped) arrays: indexing a np.memmap
        # builds a memmap object every time, a cost the request path pays per request.
        self.psgs = np.asarray(self.psgs)
        self.fap = np.asarray(self.fap)

    def batch_psgs(self, node_ids: np.ndarray) -> float:
        """A batch's PSGS: the sum over its seeds (O(1) per seed, vectorised). Ids past the
        table (nodes added by graph updates) count as the largest single-seed PSGS."""
        n = self.psgs.shape[0]
        if node_ids.size <= 8:  # a reduction's fixed cost dwarfs a few ids (most requests carry few)
            item, top = self.psgs.item, None
            total = 0.0
            for i in node_ids.tolist():
                if i < n:
                    total += item(i)
                else:
                    top = float(self.psgs.max(initial=0.0)) if top is None else top
                    total += top
            return total
        if node_ids.max() >= n:
            inside = node_ids[node_ids < n]
            extra = node_ids.size - inside.size
            return float(self.psgs[inside].sum(dtype=np.float64) + extra * float(self.psgs.max(initial=0.0)))
        return float(self.psgs[node_ids].sum(dtype=np.float64))

    @staticmethod
    def paths(root: Path, fanouts, seed_key: str) -> tuple[Path, Path]:
        d = Path(root) / "workload"
        return d / f"psgs_{fanout_key(fanouts)}.npy", d / f"fap_{fanout_key(fanouts)}_{seed_key}.npy"

    @staticmethod
    def fingerprint_path(table: Path) -> Path:
        """Where the fingerprint of the graph a table was computed on is kept: a dataset
        rewritten in place with as many nodes must not be served its old graph's tables."""
        return table.with_suffix(".graph")

    def save(self, root: Path) -> tuple[Path, Path]:
        psgs_path, fap_path = self.paths(root, self.fanouts, self.seed_key)
        psgs_path.parent.mkdir(parents=True, exist_ok=True)
        for path, table in ((psgs_path, self.psgs), (fap_path, self.fap)):
            self.fingerprint_path(path).unlink(missing_ok=True)  # never a new table beside an old fingerprint
            save_array(path, table)  # a server may map the old one: replaced, never rewritten under it
            if self.graph_fingerprint is not None:
                self.fingerprint_path(path).write_text(self.graph_fingerprint + "\n")
        return psgs_path, fap_path

    @classmethod
    def build(cls, graph: GraphStore, fanouts, seed: str | Path = "uniform") -> "WorkloadTables":
        t0 = time.perf_counter()
        p0, key = seed_distribution(graph, seed)
        a = sampling_matrix(graph)
        psgs = compute_psgs(graph, fanouts, matrix=a)
        fap = compute_fap(graph, fanouts, p0, matrix=a)
        return cls(tuple(fanouts), key, psgs, fap, time.perf_counter() - t0, graph.fingerprint)

    @classmethod
    def load_or_build(cls, graph: GraphStore, fanouts, seed: str | Path = "uniform", *, save: bool = True) -> "WorkloadTables":
        """Load the tables stored beside the dataset, building (and saving) them when absent."""
        _, key = seed_distribution(graph, seed) if seed not in SEED_KINDS else (None, str(seed))
        psgs_path, fap_path = cls.paths(graph.root, fanouts, key)
        if psgs_path.is_file() and fap_path.is_file() and all(
                _read_fingerprint(cls.fingerprint_path(p)) == graph.fingerprint for p in (psgs_path, fap_path)):
            psgs = cached_table(psgs_path, graph.num_nodes)
            fap = cached_table(fap_path, graph.num_nodes) if psgs is not None else None
            if psgs is not None and fap is not None:
                return cls(tuple(fanouts), key, psgs, fap, graph_fingerprint=graph.fingerprint)
        tables = cls.build(graph, fanouts, seed)
        if save:
            try:
                tables.save(graph.root)
            except OSError:
                pass  # a read-only dataset directory still serves, just without the cache
        return tables
