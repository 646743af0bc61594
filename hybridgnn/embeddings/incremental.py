"""Keep every layer's precomputed embeddings equal to a full re-precompute as the graph
changes (RIPPLE++-style incremental propagation).

After a batch of updates, layer l (1..L) changes only for the nodes that read something
that changed at layer l-1: out-neighbours of changed nodes, ends of added or removed
edges, nodes whose own previous-layer row changed, and new nodes. Per layer, by kind:

- delta layers (sum, mean, GCN's weighted sum, GIN): each node keeps its aggregate
  A_v = sum of messages m_u over in-neighbours u (m_u = h_u, or h_u / sqrt(d_u) for GCN).
  A change applies as deltas: + (m_new - m_old) to each out-neighbour of a changed node,
  + m_old over added edges, - m_old over removed ones. Then only the combine step
  (linear maps, root term, normalisation, activation) runs on the affected nodes.
- recompute layers (max/min, attention, anything else): the affected nodes' layer is
  recomputed from their current 1-hop block.
Either way a node whose new row equals its old one stops the propagation there.

Everything runs under the graph's write lock, so readers see the embeddings and the graph
before or after a batch, never in between.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCNConv, GINConv, SAGEConv

from hybridgnn.embeddings.kernels import mark_unique, spread_rows
from hybridgnn.embeddings.precompute import block_from_rows, layer_dims
from hybridgnn.embeddings.store import hidden_rows
from hybridgnn.errors import UpdateError
from hybridgnn.graph.dynamic import AppliedUpdate, DynamicGraph, UpdateBatch
from hybridgnn.graph.journal import Journal, fault_point, maybe
from hybridgnn.models.decompose import decompose

log = logging.getLogger(__name__)
MODES = ("auto", "recompute")


@dataclass(frozen=True)
class IncrementalConfig:
    mode: str = "auto"  # "recompute": every layer recomputes its affected region (the baseline)
    aggregate_dtype: str = "float64"  # aggregates absorb many deltas; float64 keeps the drift far below 1e-6
    prune: bool = True  # stop where a node's new row equals its old row
    max_block_edges: int = 2_000_000  # recompute layers run in chunks of at most this many edges

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_block_edges < 1:
            raise ValueError(f"max_block_edges must be >= 1, got {self.max_block_edges}")
        if self.aggregate_dtype not in ("float32", "float64"):
            raise ValueError(f"aggregate_dtype must be float32 or float64, got {self.aggregate_dtype!r}")


@dataclass
class UpdateReport:
    version: int
    num_updates: int
    new_nodes: list[int]
    affected_per_layer: list[int]
    changed_per_layer: list[int]
    apply_s: float
    propagate_s: float

    @property
    def affected_nodes(self) -> int:
        return int(sum(self.affected_per_layer))


def _aggr_name(conv) -> str:
    a = getattr(conv, "aggr", None)
    return {"add": "sum"}.get(a, a) if isinstance(a, str) else "other"


def layer_kind(conv) -> str:
    """How layer `conv` is kept fresh: sum | mean | gcn | gin (deltas) or recompute."""
    if isinstance(conv, GCNConv) and conv.normalize and conv.add_self_loops:
        return "gcn"
    if isinstance(conv, GINConv) and _aggr_name(conv) == "sum":
        return "gin"
    if isinstance(conv, SAGEConv) and _aggr_name(conv) in ("sum", "mean"):
        return _aggr_name(conv)
    return "recompute"


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b).all(axis=1) if a.size else np.ones(len(a), dtype=bool)


class IncrementalEmbeddings:
    """Per-layer embeddings (in memory, float32) kept in step with a DynamicGraph.

    layers[i] holds layer i+1's output for every node id (rows of removed nodes are 0) in
    its first num_nodes rows; it is the array served, so it grows (by reallocation, with
    room to spare) as nodes are added."""

    def __init__(self, graph: DynamicGraph, model, layers: list[np.ndarray], cfg: IncrementalConfig | None = None,
                 *, output: np.ndarray | None = None, aggregates: list[np.ndarray | None] | None = None):
        self.graph = graph
        model = decompose(model)
        self.model = model.eval()
        self.cfg = cfg or IncrementalConfig()
        self.layers = [np.array(a, dtype=np.float32) for a in layers]  # private copies, written in place
        # Jumping-knowledge models serve `output` (every layer's rows mixed per node); a row
        # is recomputed wherever any layer's row changed.
        self.output: np.ndarray | None = None
        if model.readout_needed:
            self.output = (np.array(output, dtype=np.float32) if output is not None
                           else self._readout(np.arange(graph.num_nodes)))
        if len(self.layers) != model.num_layers:
            raise ValueError(f"{len(self.layers)} embedding layers for a {model.num_layers}-layer model")
        for a in self.layers:
            if a.shape[0] != graph.num_nodes:
                raise ValueError(f"embeddings have {a.shape[0]} rows, the graph {graph.num_nodes} nodes")
        self.kinds = [layer_kind(c) if self.cfg.mode == "auto" else "recompute" for c in model.convs]
        self._agg_dtype = np.dtype(self.cfg.aggregate_dtype)
        self.aggregates: list[np.ndarray | None] = [None] * model.num_layers
        self._scratch = np.full(graph.num_nodes, -1, dtype=np.int64)
        self._mark = np.zeros(graph.num_nodes, dtype=bool)  # _unique's marks (all False between calls)
        self._journal = maybe(None)  # the running batch's undo records (see apply)
        self.last_update_unix_s: float | None = None
        t0 = time.perf_counter()
        with graph.lock.read():
            for i, kind in enumerate(self.kinds):
                if kind == "recompute":
                    continue
                # Given (a snapshot's): the aggregates exactly as the deltas left them, so
                # a replica started from it prunes and rounds as one that replayed the log.
                given = aggregates[i] if aggregates is not None and i < len(aggregates) else None
                if given is not None and given.shape[0] == graph.num_nodes:
                    self.aggregates[i] = np.array(given, dtype=self._agg_dtype)
                else:
                    self.aggregates[i] = self._full_aggregate(i)
        self.init_s = time.perf_counter() - t0

    # --- helpers over the current graph ----------------------------------------------------
    def _prev(self, i: int, nodes: np.ndarray) -> np.ndarray:
        """Layer i's input rows (features for the first layer) as they are now."""
        return self.graph.features(nodes) if i == 0 else self.layers[i - 1][nodes]

    def _unique(self, ids: np.ndarray, *, sort: bool = True) -> np.ndarray:
        """np.unique(ids) by marking (linear; ids repeat a lot here, e.g. hubs' readers)."""
        if self._mark.shape[0] < self.graph.num_nodes:
            self._mark = np.zeros(max(self.graph.num_nodes, 2 * self._mark.shape[0]), dtype=bool)
        out = mark_unique(np.ascontiguousarray(ids, dtype=np.int64), self._mark)
        if sort:
            out.sort()
        return out

    def _has_loop(self, nodes: np.ndarray) -> np.ndarray:
        return self.graph.self_loop[nodes]

    def _gcn_degree(self, i: int, nodes: np.ndarray) -> np.ndarray:
        """PyG gcn_norm's degree: in-degree plus the fill weight of an added self-loop."""
        fill = 2.0 if self.model.convs[i].improved else 1.0
        return self.graph.in_degree(nodes) + fill * (~self._has_loop(nodes))

    def _messages(self, i: int, h: np.ndarray, nodes: np.ndarray, degree: np.ndarray | None = None) -> torch.Tensor:
        """m_u for rows h of `nodes` (float64 or float32 per config)."""
        conv = self.model.convs[i]
        x = torch.from_numpy(np.ascontiguousarray(h, dtype=np.float32))
        with torch.inference_mode():
            if self.kinds[i] in ("sum", "mean") and conv.project:
                x = F.relu(conv.lin(x))
            m = x.to(torch.float64 if self._agg_dtype == np.float64 else torch.float32)
            if self.kinds[i] == "gcn":
                d = self._gcn_degree(i, nodes) if degree is None else degree
                m = m * torch.from_numpy(1.0 / np.sqrt(d.astype(np.float64))).to(m.dtype)[:, None]
        return m

    def _full_aggregate(self, i: int) -> np.ndarray:
        n = self.graph.num_nodes
        nodes = np.arange(n, dtype=np.int64)
        m = self._messages(i, self._prev(i, nodes), nodes).numpy()
        lens, cols = self.graph.in_neighbours(nodes)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=indptr[1:])
        # torch's CSR product runs on all cores (scipy's on one); ~2x faster here.
        with warnings.catch_warnings():  # "sparse CSR is beta": the product used here is long stable
            warnings.simplefilter("ignore", UserWarning)
            adj = torch.sparse_csr_tensor(torch.from_numpy(indptr), torch.from_numpy(cols.astype(np.int64)),
                                          torch.ones(len(cols), dtype=torch.from_numpy(m[:0]).dtype), size=(n, n),
                                          check_invariants=False)
        with torch.inference_mode():
            return np.ascontiguousarray((adj @ torch.from_numpy(m)).numpy(), dtype=self._agg_dtype)

    def _combine(self, i: int, nodes: np.ndarray) -> np.ndarray:
        """Layer i's output rows for `nodes` from their aggregates and own inputs."""
        conv, kind = self.model.convs[i], self.kinds[i]
        x = torch.from_numpy(np.ascontiguousarray(self._prev(i, nodes), dtype=np.float32))
        agg = torch.from_numpy(np.ascontiguousarray(self.aggregates[i][nodes]))
        with torch.inference_mode():
            if kind == "mean":
                deg = torch.from_numpy(self.graph.in_degree(nodes).astype(np.float64)).clamp_(min=1)
                agg = agg / deg.to(agg.dtype)[:, None]
            if kind in ("sum", "mean"):
                out = conv.lin_l(agg.float())
                if conv.root_weight:
                    out = out + conv.lin_r(x)
                if conv.normalize:
                    out = F.normalize(out, p=2.0, dim=-1)
            elif kind == "gin":
                out = conv.nn((1 + conv.eps) * x + agg.float())
            else:  # gcn: lin(sum_u w_uv h_u + fill * h_v / d_v) + bias, with w_uv = (d_u d_v)^-1/2
                fill = 2.0 if conv.improved else 1.0
                d = torch.from_numpy(self._gcn_degree(i, nodes).astype(np.float64))
                loop = torch.from_numpy((~self._has_loop(nodes)).astype(np.float64)) * fill
                total = agg.double() + (loop / d.sqrt())[:, None] * x.double()
                out = conv.lin((total / d.sqrt()[:, None]).float())
                if conv.bias is not None:
                    out = out + conv.bias
            out = self.model.between_layers(i, out)
        return out.float().numpy()

    def _recompute(self, i: int, nodes: np.ndarray) -> np.ndarray:
        """Layer i for `nodes` from their current 1-hop blocks (exact for any layer), in
        chunks of at most cfg.max_block_edges edges so hubs cannot exhaust memory."""
        degs = self.graph.in_degree(nodes)
        ends = np.cumsum(degs)
        if len(nodes) == 0 or ends[-1] <= self.cfg.max_block_edges:
            return self._recompute_block(i, nodes)
        out, lo = [], 0
        while lo < len(nodes):
            # at least one node per chunk, even a hub beyond the budget on its own
            hi = max(lo + 1, int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + self.cfg.max_block_edges,
                                                 side="right")))
            out.append(self._recompute_block(i, nodes[lo:hi]))
            lo = hi
        return np.concatenate(out)

    def _recompute_block(self, i: int, nodes: np.ndarray) -> np.ndarray:
        lens, cols = self.graph.in_neighbours(nodes)
        if self._scratch.shape[0] < self.graph.num_nodes:
            self._scratch = np.full(self.graph.num_nodes, -1, dtype=np.int64)
        sources, ei = block_from_rows(nodes, lens, cols, self._scratch)
        x = torch.from_numpy(np.ascontiguousarray(self._prev(i, sources), dtype=np.float32))
        with torch.inference_mode():
            if isinstance(self.model.convs[i], GCNConv):
                fill = 2.0 if self.model.convs[i].improved else 1.0
                loops = np.flatnonzero(~self._has_loop(nodes))
                ei = np.concatenate([ei, np.stack([loops, loops])], axis=1)
                inv = 1.0 / np.sqrt(self._gcn_degree(i, sources).astype(np.float64))
                w = inv[ei[0]] * inv[ei[1]]
                w[ei.shape[1] - len(loops):] *= fill
                y = self.model.layer(i, x, torch.from_numpy(ei), len(nodes),
                                     gcn_weight=torch.from_numpy(w.astype(np.float32)))
            else:
                y = self.model.layer(i, x, torch.from_numpy(ei), len(nodes))
        return y.float().numpy()

    # --- the update path -------------------------------------------------------------------
    def _readout(self, nodes: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.model.readout([torch.from_numpy(np.ascontiguousarray(a[nodes])) for a in self.layers]).numpy()

    def _grow(self, n: int) -> None:
        """Room for n nodes: new arrays (and new lists of them), so a rollback that restores
        the old references undoes the growth. Capacity grows by at least an eighth, so batches
        that each add a few nodes do not each copy every layer (rows past num_nodes are zero:
        a batch writes only its nodes' rows, journalled)."""
        def grown(a):
            if a is None or a.shape[0] >= n:
                return a
            out = np.zeros((max(n, a.shape[0] + a.shape[0] // 8 + 64),) + a.shape[1:], dtype=a.dtype)
            out[: a.shape[0]] = a
            return out

        self.output = grown(self.output)
        self.layers = [grown(a) for a in self.layers]
        self.aggregates = [grown(a) for a in self.aggregates]

    def apply(self, batch: UpdateBatch, commit: Callable[[], None] | None = None) -> UpdateReport:
        """Apply a batch to the graph and bring every layer up to date, atomically for
        readers (graph lock held for writing throughout). Raises UpdateError, changing
        nothing, for a batch that cannot apply. commit: called last, still under the lock
        (the durable log's append); if it raises, the batch rolls back as well."""
        t0 = time.perf_counter()
        journal = Journal()
        with self.graph.lock.write():
            try:
                journal.attrs(self, "output", "layers", "aggregates", "last_update_unix_s")
                up = self.graph.apply(batch, journal)
                t1 = time.perf_counter()
                self._grow(self.graph.num_nodes)
                self._journal = journal
                affected, changed_counts = self._propagate(up)
                self.last_update_unix_s = time.time()
                if commit is not None:
                    commit()
            except BaseException:
                # All or nothing: the graph, features, embeddings, aggregates and the id
                # counter go back to exactly what they were; readers never saw the batch.
                journal.rollback()
                self._scratch.fill(-1)  # block building may have stopped with marks set
                raise
            finally:
                self._journal = maybe(None)
        t2 = time.perf_counter()
        return UpdateReport(version=self.graph.version, num_updates=batch.num_updates,
                            new_nodes=up.new_nodes.tolist(), affected_per_layer=affected,
                            changed_per_layer=changed_counts, apply_s=t1 - t0, propagate_s=t2 - t1)

    def _old_gcn_degree(self, i: int, up: AppliedUpdate) -> np.ndarray:
        """GCN degree before the batch of the nodes whose rows changed."""
        fill = 2.0 if self.model.convs[i].improved else 1.0
        nodes = up.rows_changed
        return up.old_in_degree + fill * ~up.old_self_loop(nodes, self._has_loop(nodes))

    def _propagate(self, up: AppliedUpdate) -> tuple[list[int], list[int]]:
        dead = np.unique(up.removed_nodes)

        def alive_mask(nodes: np.ndarray) -> np.ndarray:  # of the batch's nodes: never the graph's size
            return ~np.isin(nodes, dead) if len(dead) else np.ones(len(nodes), dtype=bool)

        # Layer-0 change: features (updated and new nodes); old rows of new nodes are zero.
        keep = alive_mask(up.feature_nodes)
        order = np.argsort(up.feature_nodes[keep])
        changed, old_rows = up.feature_nodes[keep][order], up.old_features[keep][order]
        affected_counts, changed_counts = [], []
        changed_any = [up.new_nodes[alive_mask(up.new_nodes)]]
        touched = up.rows_changed
        old_gcn = {i: self._old_gcn_degree(i, up) for i in range(self.model.num_layers)
                   if isinstance(self.model.convs[i], GCNConv)}
        for i in range(self.model.num_layers):
            kind = self.kinds[i]
            gcn_deg_changed = np.empty(0, dtype=np.int64)
            if i in old_gcn:  # dead nodes included: their removed edges carry their old message
                gcn_deg_changed = touched[self._gcn_degree(i, touched) != old_gcn[i]]
            if kind == "recompute":
                movers = np.union1d(changed, gcn_deg_changed)
                _, outs = self.graph.out_neighbours(movers)
                targets = np.concatenate([outs.astype(np.int64), movers, up.added[:, 1], up.removed[:, 1], up.new_nodes])
            else:
                outs = self._apply_deltas(i, up, changed, old_rows, gcn_deg_changed, touched, old_gcn)
                targets = np.concatenate([outs, changed, up.added[:, 1], up.removed[:, 1], up.new_nodes,
                                          gcn_deg_changed])
            targets = self._unique(targets)
            targets = targets[alive_mask(targets)]
            out = self._recompute(i, targets) if kind == "recompute" else self._combine(i, targets)
            if not np.isfinite(out).all():  # kept, it stayed in the running sums for good
                raise UpdateError(f"the update makes layer {i + 1}'s embeddings of "
                                  f"{int((~np.isfinite(out)).any(axis=-1).sum())} node(s) overflow to NaN or "
                                  "infinity; nothing of it was applied")
            old = self.layers[i][targets]
            diff = ~_rows_equal(old, out) if self.cfg.prune else np.ones(len(targets), dtype=bool)
            diff |= np.isin(targets, up.new_nodes)
            fault_point(f"embeddings: layer {i + 1}")
            self._journal.rows(self.layers[i], targets, old)
            self.layers[i][targets] = out
            changed, old_rows = targets[diff], old[diff]
            changed_any.append(changed)
            affected_counts.append(len(targets))
            changed_counts.append(len(changed))
        fault_point("embeddings: output and removed nodes")
        if self.output is not None:
            rows = np.unique(np.concatenate(changed_any))
            self._journal.rows(self.output, np.concatenate([rows, dead]))
            self.output[rows] = self._readout(rows)
            self.output[dead] = 0.0
        for a in self.layers:
            self._journal.rows(a, dead)
            a[dead] = 0.0
        for a in self.aggregates:
            if a is not None:
                self._journal.rows(a, dead)
                a[dead] = 0.0
        return affected_counts, changed_counts

    @torch.inference_mode()
    def _apply_deltas(self, i, up: AppliedUpdate, changed, old_rows, gcn_deg_changed, touched, old_gcn):
        """Bring layer i's aggregates up to date; returns the nodes whose aggregate moved."""
        agg = torch.from_numpy(self.aggregates[i])
        is_gcn = i in old_gcn
        # Nodes whose message changed: changed rows, plus (GCN) nodes whose degree changed.
        movers = np.union1d(changed, gcn_deg_changed)
        pos_changed = np.searchsorted(changed, movers) if len(changed) else np.zeros(len(movers), np.int64)
        in_changed = (pos_changed < len(changed)) & (changed[np.minimum(pos_changed, max(len(changed) - 1, 0))]
                                                     == movers) if len(changed) else np.zeros(len(movers), bool)
        h_new = self._prev(i, movers)
        h_old = h_new.copy()
        if len(changed):  # changed is sorted, so searchsorted finds each mover's old row
            h_old[in_changed] = old_rows[pos_changed[in_changed]]
        d_new = d_old = None
        if is_gcn:
            d_new = self._gcn_degree(i, movers)
            d_old = d_new.astype(np.float64)
            p = np.searchsorted(touched, movers)
            hit = (p < len(touched)) & (touched[np.minimum(p, max(len(touched) - 1, 0))] == movers) \
                if len(touched) else np.zeros(len(movers), bool)
            d_old[hit] = old_gcn[i][p[hit]]
        m_new = self._messages(i, h_new, movers, d_new)
        m_old = self._messages(i, h_old, movers, d_old)
        lens, outs = self.graph.out_neighbours(movers)
        outs = outs.astype(np.int64)
        if len(outs):
            # sum over movers u of (m_new - m_old)[u] into each out-neighbour, in one
            # compiled pass over the movers' out-edges (the journal keeps the rows first).
            self._journal.rows(self.aggregates[i], self._unique(outs, sort=False))
            spread_rows(lens.astype(np.int64), outs, (m_new - m_old).numpy().astype(self._agg_dtype, copy=False),
                        self.aggregates[i])
        # Edge changes carry the source's old message (a mover's change is in the term above).
        for edges, sign in ((up.added, 1.0), (up.removed, -1.0)):
            if len(edges) == 0:
                continue
            src = edges[:, 0]
            m = self._messages(i, self._prev(i, src), src)
            if len(movers):
                p = np.searchsorted(movers, src)
                hit = (p < len(movers)) & (movers[np.minimum(p, len(movers) - 1)] == src)
                if hit.any():
                    m[torch.from_numpy(hit)] = m_old[torch.from_numpy(p[hit])]
            self._journal.rows(self.aggregates[i], edges[:, 1])
            agg.index_add_(0, torch.from_numpy(edges[:, 1]), m * sign)
        return outs

    # --- reads -----------------------------------------------------------------------------
    @property
    def final(self) -> np.ndarray:
        return self.output if self.output is not None else self.layers[-1]

    def lookup(self, node_ids: np.ndarray) -> np.ndarray:
        with self.graph.lock.read():
            return np.array(self.final[node_ids], dtype=np.float32)

    def lookup_both(self, node_ids: np.ndarray, with_embeddings: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(logits, embeddings) of node_ids as of one graph version (embeddings with 0
        columns unless asked for)."""
        with self.graph.lock.read():
            return self._rows(node_ids, with_embeddings)

    def lookup_now(self, node_ids: np.ndarray, with_embeddings: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """lookup_both(), or None at once when an update batch holds or awaits the graph's
        writer lock (the caller then waits for it off the event loop)."""
        lock = self.graph.lock
        if not lock.try_read():
            return None
        try:
            return self._rows(node_ids, with_embeddings)
        finally:
            lock.release_read()

    def _rows(self, node_ids: np.ndarray, with_embeddings: bool) -> tuple[np.ndarray, np.ndarray]:
        # Checked again here, under the read lock: a lookup checked at decode may have waited
        # for a batch that removed its node (whose rows are now zeros, not an answer).
        self.graph.check_alive(node_ids)
        logits = np.array(self.final[node_ids], dtype=np.float32)
        if not with_embeddings:
            return logits, np.empty((len(node_ids), 0), np.float32)
        return logits, hidden_rows(self.model, self.layers, self.graph.features, node_ids)


def computed_layers(graph: DynamicGraph, model, cfg: IncrementalConfig | None = None) -> list[np.ndarray]:
    """Every node's rows at every layer, computed layer by layer over the graph as it is,
    each node from its 1-hop block (what precompute gives on the same graph). For a replica
    that starts from a snapshot's graph holding no embeddings of its model."""
    dims = layer_dims(decompose(model), graph.feature_dim)
    n = graph.num_nodes
    blank = [np.zeros((n, d), dtype=np.float32) for d in dims]
    # recompute mode keeps no aggregates, so nothing is derived from the blank rows
    work = IncrementalEmbeddings(graph, model, blank, dataclasses.replace(cfg or IncrementalConfig(), mode="recompute"))
    nodes = np.arange(n, dtype=np.int64)
    with graph.lock.read():
        for i in range(len(dims)):
            t0 = time.perf_counter()
            work.layers[i][:] = work._recompute(i, nodes)
            log.info("computed layer %d of %d for %d nodes in %.1fs", i + 1, len(dims), n, time.perf_counter() - t0)
    return work.layers
