"""1-D node partitions of a stored graph, and one rank's view of its part.

A partition gives every node an owner rank. `ranges` splits node ids into contiguous
ranges holding about the same number of edges (found by binary search in indptr, so no
process reads the whole CSR); `metis` asks METIS (pymetis) for parts that cut fewer
edges, which reads the whole adjacency once, on one process, and is cached beside the
embeddings. A rank then reads only its own CSR rows and feature rows (LocalPart).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.capabilities import save_array
from hybridgnn.errors import ConfigError
from hybridgnn.graph.csr import gather_rows

log = logging.getLogger(__name__)

METHODS = ("auto", "metis", "ranges")


def metis_available() -> bool:
    return importlib.util.find_spec("pymetis") is not None


def resolve_method(method: str) -> str:
    """`auto` is METIS when pymetis is installed, ranges otherwise."""
    if method not in METHODS:
        raise ConfigError(f"partition method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return "metis" if metis_available() else "ranges"
    if method == "metis" and not metis_available():
        raise ConfigError("--partition metis needs pymetis (pip install pymetis); "
                          "--partition ranges needs nothing")
    return method


def range_bounds(indptr: np.ndarray, parts: int) -> np.ndarray:
    """parts+1 node-id bounds of contiguous ranges with about equal edge counts (nodes
    when the graph has too few edges to split that way); reads O(parts · log N) of indptr."""
    n = int(indptr.shape[0] - 1)
    if parts < 1 or parts > max(n, 1):
        raise ConfigError(f"cannot split {n} nodes into {parts} parts")
    edges = int(indptr[-1])
    cuts = np.searchsorted(indptr, np.arange(1, parts, dtype=np.int64) * edges / parts, side="left")
    bounds = np.concatenate([[0], np.asarray(cuts, dtype=np.int64), [n]])
    if np.any(np.diff(bounds) <= 0):  # skewed or edgeless: split nodes evenly instead
        bounds = (np.arange(parts + 1, dtype=np.int64) * n) // parts
    return bounds


def metis_parts(indptr: np.ndarray, indices: np.ndarray, parts: int) -> np.ndarray:
    """The owner of every node by METIS on the symmetrised graph without self loops."""
    import pymetis
    import scipy.sparse as sp

    n = int(indptr.shape[0] - 1)
    a = sp.csr_matrix((np.ones(len(indices), dtype=np.int8), np.asarray(indices), np.asarray(indptr)), shape=(n, n))
    sym = (a + a.T).tocsr()
    sym.setdiag(0)
    sym.eliminate_zeros()
    sym.sort_indices()
    xadj, adjncy = sym.indptr.astype(np.int64), sym.indices.astype(np.int64)
    # weigh nodes by their in-edges plus one, so parts balance the work, not only the count
    weights = (np.diff(np.asarray(indptr)) + 1).astype(np.int64)
    if hasattr(pymetis, "CSRAdjacency"):
        graph = {"adjacency": pymetis.CSRAdjacency(xadj, adjncy)}
    else:  # pymetis before 2025
        graph = {"xadj": xadj, "adjncy": adjncy}
    _, membership = pymetis.part_graph(parts, **graph, vweights=weights)
    owner = np.asarray(membership, dtype=np.int32)
    if len(np.unique(owner)) != parts:  # METIS may leave a part empty on tiny graphs
        raise ConfigError(f"METIS left a part empty splitting {n} nodes into {parts}; use --partition ranges")
    return owner


@dataclass(frozen=True)
class Partition:
    """Who owns each node: contiguous `bounds`, or an `owner` array (memory-mapped)."""

    method: str
    parts: int
    bounds: np.ndarray | None = None
    owner: np.ndarray | None = None

    def owner_of(self, nodes: np.ndarray) -> np.ndarray:
        if self.bounds is not None:
            return (np.searchsorted(self.bounds, nodes, side="right") - 1).astype(np.int64)
        return np.asarray(self.owner[nodes], dtype=np.int64)

    def nodes_of(self, rank: int) -> np.ndarray:
        """The nodes `rank` owns, ascending."""
        if self.bounds is not None:
            return np.arange(self.bounds[rank], self.bounds[rank + 1], dtype=np.int64)
        return np.flatnonzero(np.asarray(self.owner) == rank).astype(np.int64)


def partition_file(root: Path, method: str, parts: int) -> Path:
    return Path(root) / f"partition-{method}-{parts}.npy"


def compute_partition(graph, method: str, parts: int, cache_root: Path | None) -> Partition:
    """The partition of `graph` (a GraphStore) by `method` (resolved: metis or ranges); a
    METIS partition is read from cache_root when there, else computed and written there."""
    if method == "ranges":
        return Partition("ranges", parts, bounds=range_bounds(np.asarray(graph.indptr), parts))
    if graph.num_nodes < parts:
        raise ConfigError(f"cannot split {graph.num_nodes} nodes into {parts} parts")
    path = partition_file(cache_root, method, parts) if cache_root is not None else None
    if path is not None and path.is_file():
        owner = _owner_file(path, graph.num_nodes, parts)
        if isinstance(owner, np.ndarray):
            return Partition(method, parts, owner=owner)
        log.warning("partition file %s %s: computing the partition again", path, owner)
    owner = metis_parts(np.asarray(graph.indptr), np.asarray(graph.indices), parts)
    if path is not None:
        save_array(path, owner)  # atomic: a reader sees no file or the whole one
    return Partition(method, parts, owner=owner)


def load_partition(method: str, parts: int, cache_root: Path, graph) -> Partition:
    """The partition another rank computed (compute_partition with the same arguments)."""
    if method == "ranges":
        return Partition("ranges", parts, bounds=range_bounds(np.asarray(graph.indptr), parts))
    path = partition_file(cache_root, method, parts)
    owner = _owner_file(path, graph.num_nodes, parts)
    if not isinstance(owner, np.ndarray):
        raise ConfigError(f"partition file {path} {owner}")
    return Partition(method, parts, owner=owner)


def _owner_file(path: Path, num_nodes: int, parts: int) -> np.ndarray | str:
    """The owner array a partition file holds, mapped, or what is wrong with it: one that
    did not load (empty, cut short) was a traceback, and an owner past the parts left its
    nodes to no rank (never computed, yet the store was marked complete)."""
    try:
        owner = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        return f"does not load ({type(exc).__name__}: {exc})"
    if owner.shape != (num_nodes,) or owner.dtype.kind not in "iu":
        return f"holds {owner.dtype} {owner.shape}, not an integer owner per node ({num_nodes})"
    if num_nodes and (int(owner.min()) < 0 or int(owner.max()) >= parts):
        return f"names owners in [{int(owner.min())}, {int(owner.max())}], not parts 0..{parts - 1}"
    return owner


@dataclass
class LocalPart:
    """One rank's rows: its nodes, their in-edges renumbered locally (0..n-1 its own
    nodes, n.. the halo), the halo grouped by owner, and GCN's degree tables where
    known locally (a halo node's degree comes from its owner)."""

    rank: int
    nodes: np.ndarray         # [n] global ids owned, ascending
    indptr: np.ndarray        # [n+1] local CSR
    indices: np.ndarray       # [nnz] local ids into [own | halo]
    halo: np.ndarray          # [h] global ids, grouped by owner (ascending owner, then id)
    halo_counts: np.ndarray   # [parts] how many halo rows each rank owns (own rank: 0)
    has_loop: np.ndarray      # [n] whether a node lists itself
    remote_edges: int         # in-edges whose source another rank owns (this rank's share of the cut)

    @property
    def num_nodes(self) -> int:
        return int(self.nodes.shape[0])

    @property
    def in_degree(self) -> np.ndarray:
        return np.diff(self.indptr)


def local_part(graph, partition: Partition, rank: int) -> LocalPart:
    """Read `rank`'s CSR rows of `graph` and renumber them; touches only those rows."""
    nodes = partition.nodes_of(rank)
    n = len(nodes)
    degs, cols = gather_rows(np.asarray(graph.indptr), graph.indices, nodes)
    cols = np.asarray(cols, dtype=np.int64)
    pos = np.searchsorted(nodes, cols)
    is_own = (pos < n) & (nodes[np.minimum(pos, max(n - 1, 0))] == cols) if n else np.zeros(len(cols), bool)
    remote = np.unique(cols[~is_own])
    owners = partition.owner_of(remote)
    by_owner = np.lexsort((remote, owners))  # stable groups: owner, then id
    halo = remote[by_owner]
    halo_counts = np.bincount(owners, minlength=partition.parts).astype(np.int64)
    slot = np.empty(len(remote), dtype=np.int64)
    slot[by_owner] = np.arange(len(remote))  # sorted-id index -> position in the grouped halo
    local = np.where(is_own, pos, 0)
    local[~is_own] = n + slot[np.searchsorted(remote, cols[~is_own])]
    indptr = np.concatenate([[0], np.cumsum(degs)]).astype(np.int64)
    rows = np.repeat(np.arange(n), degs)
    has_loop = np.zeros(n, dtype=bool)
    has_loop[rows[local == rows]] = True
    return LocalPart(rank=rank, nodes=nodes, indptr=indptr, indices=local, halo=halo, halo_counts=halo_counts,
                     has_loop=has_loop, remote_edges=int((~is_own).sum()))
