"""A mutable graph over the read-only on-disk one: edge and node additions and deletions
and feature updates, applied in atomic batches, compacted into a new base CSR on demand.

Rows are patched whole: a node whose in-neighbours change gets its complete new row in
an append-only pool, and a slot table says which rows live there, so readers (samplers,
gathers, propagation) pay one table lookup per row and untouched rows stay in the mmap'd
base. The reverse adjacency (who reads from a node) is kept the same way, since
propagation walks out-neighbours. Node ids are never reused: new nodes get the next ids,
deleted nodes keep theirs, without edges, marked dead.

Concurrency: `lock` is a readers-writer lock. apply() holds it for writing, so a reader
holding it for reading sees the graph before or after a batch, never inside one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from hybridgnn.errors import (
    RemovedNode,
    UpdateError,  # an update batch that cannot apply; nothing of it was applied
)
from hybridgnn.graph.csr import gather_rows
from hybridgnn.graph.degrees import self_loops
from hybridgnn.graph.idmap import namer
from hybridgnn.graph.journal import Journal, fault_point, maybe
from hybridgnn.graph.rwlock import RWLock
from hybridgnn.graph.store import GraphStore


def _grow(arr: np.ndarray, need: int, fill=None) -> np.ndarray:
    if arr.shape[0] >= need:
        return arr
    out = np.empty((max(need, 2 * arr.shape[0], 16),) + arr.shape[1:], dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    if fill is not None:
        out[arr.shape[0]:] = fill
    return out


class PatchedAdjacency:
    """CSR rows from a read-only base, with whole rows replaced from an append-only pool."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, num_nodes: int):
        self.base_indptr = indptr
        self.base_indices = indices
        self.num_base = indptr.shape[0] - 1
        self.num_nodes = num_nodes
        self.slot = np.full(max(num_nodes, 16), -1, dtype=np.int64)  # node -> patched row, -1: base
        self.row_start = np.empty(16, dtype=np.int64)
        self.row_len = np.empty(16, dtype=np.int64)
        self.pool = np.empty(1024, dtype=indices.dtype)
        self.num_slots = 0
        self.pool_used = 0

    def degree(self, nodes: np.ndarray) -> np.ndarray:
        s = self.slot[nodes]
        in_base = nodes < self.num_base
        base = np.zeros(len(nodes), dtype=np.int64)
        b = nodes[in_base]
        base[in_base] = self.base_indptr[b + 1] - self.base_indptr[b]
        return np.where(s >= 0, self.row_len[np.maximum(s, 0)] if self.num_slots else 0, base)

    def rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, concatenated rows) of `nodes`, in their order."""
        nodes = np.asarray(nodes, dtype=np.int64)
        s = self.slot[nodes]
        patched = s >= 0
        lens = self.degree(nodes)
        out = np.empty(int(lens.sum()), dtype=self.base_indices.dtype)
        pos = np.concatenate([[0], np.cumsum(lens)])[:-1]
        base_nodes = nodes[~patched & (nodes < self.num_base)]
        if len(base_nodes):
            blens, bvals = gather_rows(self.base_indptr, self.base_indices, base_nodes)
            bpos = pos[~patched & (nodes < self.num_base)]
            out[np.repeat(bpos - np.cumsum(blens) + blens, blens) + np.arange(len(bvals))] = bvals
        if patched.any():
            ps = s[patched]
            starts, plens = self.row_start[ps], self.row_len[ps]
            total = int(plens.sum())
            src = np.repeat(starts - np.cumsum(plens) + plens, plens) + np.arange(total)
            ppos = pos[patched]
            out[np.repeat(ppos - np.cumsum(plens) + plens, plens) + np.arange(total)] = self.pool[src]
        return lens, out

    def set_rows(self, nodes: np.ndarray, lens: np.ndarray, values: np.ndarray, journal: Journal | None = None) -> None:
        """Replace the rows of `nodes` (unique) with consecutive slices of `values`."""
        if len(nodes) == 0:
            return
        j = maybe(journal)
        j.attrs(self, "pool", "pool_used", "num_slots", "row_start", "row_len")
        self.pool = _grow(self.pool, self.pool_used + len(values))
        self.pool[self.pool_used:self.pool_used + len(values)] = values
        starts = self.pool_used + np.concatenate([[0], np.cumsum(lens)])[:-1]
        self.pool_used += len(values)
        s = self.slot[nodes]
        fresh = s < 0
        n_new = int(fresh.sum())
        s[fresh] = self.num_slots + np.arange(n_new)
        self.num_slots += n_new
        self.row_start = _grow(self.row_start, self.num_slots)
        self.row_len = _grow(self.row_len, self.num_slots)
        j.rows(self.row_start, s)
        j.rows(self.row_len, s)
        self.row_start[s] = starts
        self.row_len[s] = lens
        j.rows(self.slot, nodes)
        self.slot[nodes] = s

    def add_nodes(self, count: int, journal: Journal | None = None) -> None:
        maybe(journal).attrs(self, "num_nodes", "slot")
        self.num_nodes += count
        self.slot = _grow(self.slot, self.num_nodes, fill=-1)

    def to_csr(self) -> tuple[np.ndarray, np.ndarray]:
        nodes = np.arange(self.num_nodes, dtype=np.int64)
        lens, values = self.rows(nodes)
        indptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(lens, out=indptr[1:])
        return indptr, values


@dataclass
class UpdateBatch:
    """One atomic batch. Edges are (src, dst): dst aggregates from src (dst's row gains src).
    New nodes get ids num_nodes .. num_nodes + len(add_node_features) - 1 and may appear in
    this batch's edges. Applied in the order: remove nodes, add nodes, remove edges, add
    edges, update features."""

    add_edges: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.int64))
    remove_edges: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.int64))
    add_node_features: np.ndarray | None = None  # float32 [a, F]
    remove_nodes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    update_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    update_features: np.ndarray | None = None  # float32 [u, F]

    @property
    def num_updates(self) -> int:
        a = 0 if self.add_node_features is None else len(self.add_node_features)
        return len(self.add_edges) + len(self.remove_edges) + a + len(self.remove_nodes) + len(self.update_ids)

    def arrays(self, feature_dim: int) -> tuple[np.ndarray, ...]:
        """The batch as six arrays (a message's): edges added and removed, new nodes'
        features, removed nodes, updated ids and their features (absent tables [0, f])."""
        none = np.empty((0, feature_dim), dtype=np.float32)
        return (np.asarray(self.add_edges, dtype=np.int64).reshape(-1, 2),
                np.asarray(self.remove_edges, dtype=np.int64).reshape(-1, 2),
                none if self.add_node_features is None else np.asarray(self.add_node_features, dtype=np.float32),
                np.asarray(self.remove_nodes, dtype=np.int64), np.asarray(self.update_ids, dtype=np.int64),
                none if self.update_features is None else np.asarray(self.update_features, dtype=np.float32))

    @classmethod
    def from_arrays(cls, arrays) -> UpdateBatch:
        """The batch arrays() gave; ValueError when the arrays are not its six."""
        if len(arrays) != 6 or any(np.asarray(a).dtype.kind != k for a, k in zip(arrays, "iifiif", strict=True)):
            raise ValueError("a graph-update batch is six arrays: edges, edges, features, ids, ids, features")
        add_edges, remove_edges, add_features, remove_nodes, update_ids, update_features = arrays
        return cls(add_edges=add_edges, remove_edges=remove_edges,
                   add_node_features=add_features if len(add_features) else None, remove_nodes=remove_nodes,
                   update_ids=update_ids, update_features=update_features if len(update_ids) else None)


@dataclass
class AppliedUpdate:
    """What a batch changed, as propagation needs it (all arrays int64 unless noted)."""

    added: np.ndarray  # [m, 2] (src, dst) edges now present that were not
    removed: np.ndarray  # [k, 2] edges no longer present (incl. those of removed nodes)
    new_nodes: np.ndarray
    removed_nodes: np.ndarray
    feature_nodes: np.ndarray  # nodes whose features changed (updated or new)
    old_features: np.ndarray  # float32 [len(feature_nodes), F] (zeros for new nodes)
    rows_changed: np.ndarray  # sorted nodes whose in-neighbour set changed
    old_in_degree: np.ndarray  # their in-degree before the batch

    def old_self_loop(self, nodes: np.ndarray, now: np.ndarray) -> np.ndarray:
        """Whether each node had a self-loop before the batch, given whether it has one now."""
        toggled = np.zeros(len(nodes), dtype=bool)
        for edges in (self.added, self.removed):
            loops = edges[edges[:, 0] == edges[:, 1], 0]
            toggled ^= np.isin(nodes, loops)
        return now ^ toggled


def _pairs_key(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
    return dst.astype(np.int64) * n + src.astype(np.int64)


def check_batch(batch: UpdateBatch, n: int, f: int, alive: np.ndarray, has_edges, label=str) -> int:
    """Raise UpdateError unless `batch` applies to a graph of `n` nodes with `f`-wide
    features, `alive` nodes (a mask of at least n) and the edges has_edges(src, dst) says
    are present; returns the number of new nodes. Deterministic: every holder of the same
    graph refuses the same batch with the same message. label(i): how a message names node
    i (idmap.namer: as the client named it)."""

    def pair(edge) -> str:
        return f"[{label(int(edge[0]))}, {label(int(edge[1]))}]"

    a = 0 if batch.add_node_features is None else len(batch.add_node_features)
    if a and (batch.add_node_features.ndim != 2 or batch.add_node_features.shape[1] != f):
        raise UpdateError(f"new node features must be [count, {f}], got {list(batch.add_node_features.shape)}")
    limit = n + a

    def known(ids: np.ndarray, what: str, allow_new: bool) -> None:
        if len(ids) == 0:
            return
        hi = limit if allow_new else n
        bad = (ids < 0) | (ids >= hi)
        ok_range = ids[~bad]
        bad_dead = ok_range[(ok_range < n) & ~alive[np.minimum(ok_range, n - 1)]] if n else ok_range[:0]
        if bad.any() or len(bad_dead):
            first = int(ids[bad][0]) if bad.any() else int(bad_dead[0])
            if label is not str and not bad.any():  # a name the client knows: say what became of it
                raise UpdateError(f"{what} names node {label(first)}, which an update removed from the graph")
            raise UpdateError(f"{what} names unknown node {first} (nodes are 0..{hi - 1}, "
                              f"removed ones excluded)")

    for name, arr in (("add_edges", batch.add_edges), ("remove_edges", batch.remove_edges)):
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise UpdateError(f"{name} must be [count, 2] (src, dst) pairs, got {list(arr.shape)}")
    known(batch.remove_nodes, "remove_nodes", False)
    if len(np.unique(batch.remove_nodes)) != len(batch.remove_nodes):
        raise UpdateError("remove_nodes names a node twice")
    known(batch.add_edges.ravel(), "add_edges", True)
    known(batch.remove_edges.ravel(), "remove_edges", False)
    known(batch.update_ids, "update_features", True)
    if len(np.unique(batch.update_ids)) != len(batch.update_ids):
        raise UpdateError("update_features names a node twice")
    if len(batch.update_ids):
        uf = batch.update_features
        if uf is None or uf.ndim != 2 or uf.shape != (len(batch.update_ids), f):
            got = None if uf is None else list(uf.shape)
            raise UpdateError(f"update features must be [{len(batch.update_ids)}, {f}], got {got}")
    gone = np.zeros(limit, dtype=bool)
    gone[batch.remove_nodes] = True
    for name, arr in (("add_edges", batch.add_edges), ("remove_edges", batch.remove_edges)):
        if len(arr) and gone[arr].any():
            raise UpdateError(f"{name} names a node this batch removes")
        keys = _pairs_key(arr[:, 0], arr[:, 1], limit)
        if len(np.unique(keys)) != len(keys):
            raise UpdateError(f"{name} lists an edge twice")
    if len(batch.update_ids) and gone[batch.update_ids].any():
        raise UpdateError("update_features names a node this batch removes")
    if len(batch.remove_edges):
        rm = batch.remove_edges
        if not has_edges(rm[:, 0], rm[:, 1]).all():
            i = int(np.flatnonzero(~has_edges(rm[:, 0], rm[:, 1]))[0])
            raise UpdateError(f"remove_edges: edge {pair(rm[i])} is not in the graph")
    if len(batch.add_edges):
        ad = batch.add_edges
        old = ad[(ad[:, 0] < n) & (ad[:, 1] < n)]
        present = has_edges(old[:, 0], old[:, 1])
        if present.any():
            raise UpdateError(f"add_edges: edge {pair(old[present][0])} is already in the graph "
                              "(duplicate edges are not allowed)")
        if len(batch.remove_edges):
            both = np.isin(_pairs_key(ad[:, 0], ad[:, 1], limit),
                           _pairs_key(batch.remove_edges[:, 0], batch.remove_edges[:, 1], limit))
            if both.any():
                raise UpdateError(f"edge {pair(ad[both][0])} is both added and removed")
    return a


class DynamicGraph:
    """The current graph: a GraphStore plus patches. Read it under `lock.read()`."""

    def __init__(self, base: GraphStore):
        self.base = base
        self.feature_dim = base.feature_dim
        n = base.num_nodes
        self.lock = RWLock()
        self.fwd = PatchedAdjacency(np.asarray(base.indptr), np.asarray(base.indices), n)
        rev = sp.csr_matrix((np.ones(base.num_edges, dtype=np.int8), np.asarray(base.indices),
                             np.asarray(base.indptr)), shape=(n, n)).tocsc()
        # Column j of the CSC lists the rows (readers) of j: the reverse adjacency.
        self.rev = PatchedAdjacency(rev.indptr.astype(np.int64), rev.indices.astype(base.indices.dtype), n)
        self.alive = np.ones(max(n, 16), dtype=bool)
        # Which nodes read themselves (GCN's normalisation depends on it), kept per batch.
        self.self_loop = np.zeros(max(n, 16), dtype=bool)
        self.self_loop[:n] = self_loops(np.asarray(base.indptr), np.asarray(base.indices), n)
        self.feat_slot = np.full(max(n, 16), -1, dtype=np.int64)
        self.feat_pool = np.empty((16, base.feature_dim), dtype=np.float32)
        self.feat_used = 0
        self.version = 0
        self.updates_applied = 0
        self.compactions = 0

    def restore(self, indptr: np.ndarray, indices: np.ndarray, features: np.ndarray, alive: np.ndarray,
                version: int) -> None:
        """Become the graph a snapshot holds (before serving, nothing else reading): its CSR,
        the features of every node (only those that differ from the base are kept here),
        which nodes are removed, and how many batches made it."""
        n, base_n = indptr.shape[0] - 1, self.base.num_nodes
        if n < base_n or features.shape != (n, self.feature_dim) or alive.shape != (n,):
            raise ValueError(f"a snapshot of {n} nodes does not extend this {base_n}-node graph")
        self.fwd = PatchedAdjacency(indptr, indices, n)
        rev = sp.csr_matrix((np.ones(len(indices), dtype=np.int8), indices, indptr), shape=(n, n)).tocsc()
        self.rev = PatchedAdjacency(rev.indptr.astype(np.int64), rev.indices.astype(indices.dtype), n)
        size = max(n, 16)
        self.alive = np.ones(size, dtype=bool)
        self.alive[:n] = alive
        self.self_loop = np.zeros(size, dtype=bool)
        self.self_loop[:n] = self_loops(indptr, indices, n)
        changed = [np.arange(base_n, n, dtype=np.int64)]
        for start in range(0, base_n, 1 << 16):  # in chunks: the base features may be larger than memory
            stop = min(base_n, start + (1 << 16))
            differs = (np.asarray(features[start:stop]) != np.asarray(self.base.features[start:stop])).any(axis=1)
            changed.append(start + np.flatnonzero(differs))
        nodes = np.concatenate(changed)
        self.feat_slot = np.full(size, -1, dtype=np.int64)
        self.feat_slot[nodes] = np.arange(len(nodes))
        self.feat_pool = np.array(features[nodes], dtype=np.float32).reshape(len(nodes), self.feature_dim)
        self.feat_pool = _grow(self.feat_pool, max(len(nodes), 16))
        self.feat_used = len(nodes)
        self.version = version

    @property
    def num_nodes(self) -> int:
        return self.fwd.num_nodes

    @property
    def num_edges(self) -> int:
        return int(self.fwd.degree(np.arange(self.num_nodes)).sum())

    # --- reads ----------------------------------------------------------------------------
    def in_neighbours(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.fwd.rows(nodes)

    def out_neighbours(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.rev.rows(nodes)

    def in_degree(self, nodes: np.ndarray) -> np.ndarray:
        return self.fwd.degree(np.asarray(nodes, dtype=np.int64))

    def features(self, nodes: np.ndarray) -> np.ndarray:
        nodes = np.asarray(nodes, dtype=np.int64)
        s = self.feat_slot[nodes]
        out = np.empty((len(nodes), self.feature_dim), dtype=np.float32)
        base = s < 0
        out[base] = self.base.features[nodes[base]]
        out[~base] = self.feat_pool[s[~base]]
        return out

    def check_alive(self, node_ids: np.ndarray) -> None:
        """RemovedNode when node_ids (valid ids) name a node an update removed; read under
        the lock for an answer about one version."""
        dead = node_ids[~self.alive[node_ids]]
        if len(dead):
            raise RemovedNode.among(dead, namer(self.base.id_map))

    def has_edges(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Whether each (src, dst) edge is present now."""
        if len(src) == 0:
            return np.zeros(0, dtype=bool)
        udst, inv = np.unique(dst, return_inverse=True)
        lens, vals = self.fwd.rows(udst)
        row_of = np.repeat(np.arange(len(udst)), lens)
        present = np.sort(_pairs_key(vals, row_of, self.num_nodes))
        want = _pairs_key(src, inv, self.num_nodes)
        pos = np.searchsorted(present, want)
        pos = np.minimum(pos, len(present) - 1) if len(present) else pos
        return (present[pos] == want) if len(present) else np.zeros(len(src), dtype=bool)

    # --- writes ---------------------------------------------------------------------------
    def check(self, batch_for) -> None:
        """Raise UpdateError if the batch would not apply to the graph as it is now;
        batch_for(num_nodes) makes the batch (its new nodes get ids from num_nodes)."""
        with self.lock.read():
            self._check(batch_for(self.num_nodes))

    def _check(self, batch: UpdateBatch) -> int:
        """Validate against the current graph; returns the number of new nodes."""
        return check_batch(batch, self.num_nodes, self.feature_dim, self.alive, self.has_edges,
                           namer(self.base.id_map))

    def apply(self, batch: UpdateBatch, journal: Journal | None = None) -> AppliedUpdate:
        """Apply a batch entirely or, raising UpdateError, not at all. Call with lock.write()
        held. Every write is recorded in `journal` first, so a failure later in the batch
        (here or in what follows it, e.g. embedding propagation) can roll it all back."""
        a = self._check(batch)
        j = maybe(journal)
        j.attrs(self, "version", "updates_applied", "alive", "self_loop", "feat_slot", "feat_pool", "feat_used")
        n0 = self.num_nodes
        new_nodes = np.arange(n0, n0 + a, dtype=np.int64)
        # A node this batch adds may have its features updated too (update features come
        # last): the update is then simply its features.
        update_ids = batch.update_ids.astype(np.int64)
        update_feats, add_feats = batch.update_features, batch.add_node_features
        fresh = update_ids >= n0
        if fresh.any():
            add_feats = np.array(add_feats, dtype=np.float32)
            add_feats[update_ids[fresh] - n0] = update_feats[fresh]
            update_ids, update_feats = update_ids[~fresh], update_feats[~fresh]
        # Edges of removed nodes go too: their rows (in-edges) and their readers (out-edges).
        rn = batch.remove_nodes.astype(np.int64)
        lens_in, srcs = self.fwd.rows(rn)
        lens_out, dsts = self.rev.rows(rn)
        node_edges = np.concatenate([np.stack([srcs.astype(np.int64), np.repeat(rn, lens_in)], 1),
                                     np.stack([np.repeat(rn, lens_out), dsts.astype(np.int64)], 1)])
        removed = np.concatenate([batch.remove_edges.astype(np.int64).reshape(-1, 2), node_edges])
        if len(removed):
            removed = np.unique(removed, axis=0)
        added = batch.add_edges.astype(np.int64).reshape(-1, 2)
        fault_point("graph: before adding nodes")
        if a:
            self.fwd.add_nodes(a, journal)
            self.rev.add_nodes(a, journal)
            self.alive = _grow(self.alive, self.num_nodes, fill=True)
            self.self_loop = _grow(self.self_loop, self.num_nodes, fill=False)
            self.feat_slot = _grow(self.feat_slot, self.num_nodes, fill=-1)
        touched_dst = np.unique(np.concatenate([added[:, 1], removed[:, 1]]))
        old_deg = self.fwd.degree(touched_dst)
        fault_point("graph: before rewriting rows")
        self._rewrite(self.fwd, added[:, 0], added[:, 1], removed[:, 0], removed[:, 1], journal)
        fault_point("graph: between the two adjacencies")
        self._rewrite(self.rev, added[:, 1], added[:, 0], removed[:, 1], removed[:, 0], journal)
        j.rows(self.alive, rn)
        self.alive[rn] = False
        for edges, present in ((removed, False), (added, True)):
            loops = edges[edges[:, 0] == edges[:, 1], 0]
            j.rows(self.self_loop, loops)
            self.self_loop[loops] = present
        feat_nodes = np.concatenate([update_ids, new_nodes])
        old_feats = np.zeros((len(feat_nodes), self.feature_dim), dtype=np.float32)
        k = len(update_ids)
        if k:
            old_feats[:k] = self.features(update_ids)
        new_feats = np.concatenate([
            update_feats if k else np.empty((0, self.feature_dim), np.float32),
            add_feats if a else np.empty((0, self.feature_dim), np.float32)]).astype(np.float32)
        fault_point("graph: before writing features")
        self._write_features(feat_nodes, new_feats, journal)
        fault_point("graph: after writing features")
        self.version += 1
        self.updates_applied += batch.num_updates
        return AppliedUpdate(added=added, removed=removed, new_nodes=new_nodes, removed_nodes=rn,
                             feature_nodes=feat_nodes, old_features=old_feats,
                             rows_changed=touched_dst, old_in_degree=old_deg)

    def _rewrite(self, adj: PatchedAdjacency, add_src, add_row, rm_src, rm_row, journal: Journal | None = None) -> None:
        rows = np.unique(np.concatenate([add_row, rm_row]))
        if len(rows) == 0:
            return
        lens, vals = adj.rows(rows)
        row_idx = np.repeat(np.arange(len(rows)), lens)
        n = adj.num_nodes
        keys = row_idx * n + vals.astype(np.int64)
        if len(rm_row):
            keys = keys[~np.isin(keys, np.searchsorted(rows, rm_row) * n + rm_src)]
        if len(add_row):
            keys = np.concatenate([keys, np.searchsorted(rows, add_row) * n + add_src])
        keys.sort()  # rows stay sorted, as in the base CSR
        new_lens = np.bincount(keys // n, minlength=len(rows))
        adj.set_rows(rows, new_lens, (keys % n).astype(adj.base_indices.dtype), journal)

    def _write_features(self, nodes: np.ndarray, feats: np.ndarray, journal: Journal | None = None) -> None:
        if len(nodes) == 0:
            return
        j = maybe(journal)
        s = self.feat_slot[nodes]
        fresh = s < 0
        j.rows(self.feat_pool, s[~fresh])  # rows rewritten in place (the new ones are beyond feat_used)
        s[fresh] = self.feat_used + np.arange(int(fresh.sum()))
        self.feat_used += int(fresh.sum())
        self.feat_pool = _grow(self.feat_pool, self.feat_used)
        self.feat_pool[s] = feats
        j.rows(self.feat_slot, nodes)
        self.feat_slot[nodes] = s

    def to_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The current graph as CSR arrays (indptr int64, indices as stored)."""
        return self.fwd.to_csr()

    def compact(self) -> bool:
        """Fold the patches into new base arrays (in memory). Built under the read lock, so
        serving goes on meanwhile; swapped in under the write lock unless a batch landed in
        between (then returns False: try again later)."""
        with self.lock.read():
            version = self.version
            fwd = self.fwd.to_csr()
            rev = self.rev.to_csr()
            n = self.num_nodes
        with self.lock.write():
            if self.version != version:
                return False
            self.fwd = PatchedAdjacency(fwd[0], fwd[1], n)  # same rows, so self_loop stays right
            self.rev = PatchedAdjacency(rev[0], rev[1], n)
            self.compactions += 1
        return True

    @property
    def patched_entries(self) -> int:
        """Row entries living in the patch pools (what compaction folds in)."""
        return self.fwd.pool_used + self.rev.pool_used
