"""New nodes of a heterogeneous graph from its precomputed embeddings: SRPE per node type
(Reforge §V on typed graphs).

A request brings q query nodes of one node type (local ids N_t .. N_t+q-1 of that type)
with features, and edges of the graph's edge types to existing nodes and to each other.
Planning is the homogeneous one (embeddings/newnodes.layer_sets) over one global
numbering of every type's nodes (type i's node v is offset_i + v; query node j is
total + j), so pe, srpe (γ, ranked by query-edge ratio over all edge types into a node)
and full mean the same sets R_1..R_K as on a homogeneous graph. Execution is typed: layer
l computes R_l's nodes type by type with the model's layer (every edge type into the
type, combined by the cross-type aggregation), each input read from what was computed at
layer l-1, else the stored rows (features at layer 0).

Mode full is exact: it equals adding the query nodes and edges to the graph and running
the model over the whole graph (a test checks it against PyG).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hybridgnn.embeddings.hetero import HeteroEmbeddingStore
from hybridgnn.embeddings.newnodes import layer_sets, minus, query_edges, unique_ints
from hybridgnn.graph.csr import gather_rows
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.models.hetero import HeteroGNN
from hybridgnn.types import EdgeType

MODES = ("full", "pe", "srpe")


@dataclass
class TypedNewNodeResult:
    logits: np.ndarray  # [q, out] float32: the model's output (after the type's head)
    embeddings: np.ndarray  # [q, d] float32: the last layer's rows (what the head reads)
    recomputed: int  # existing nodes whose embeddings were recomputed


def _tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory-mapped rows, read only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(a))


class HeteroNewNodes:
    """Evaluates new-node requests against one heterogeneous graph, model and store
    (thread-safe after the first mode-full request built the reverse adjacency)."""

    def __init__(self, graph: HeteroGraphStore, model: HeteroGNN, store: HeteroEmbeddingStore):
        if store.num_layers != model.num_layers:
            raise ValueError(f"stored embeddings have {store.num_layers} layers, the model {model.num_layers}")
        self.graph, self.model, self.store = graph, model, store
        self.types = list(graph.node_types)
        sizes = np.array([graph.num_nodes(t) for t in self.types], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.offset = dict(zip(self.types, self.offsets.tolist(), strict=True))
        self.total = int(sizes.sum())
        self.into = {t: graph.edge_types_into(t) for t in self.types}
        self._degree = np.zeros(self.total, dtype=np.int64)
        for (_, _, t), edge in graph.edges.items():
            self._degree[self.offset[t]: self.offset[t] + graph.num_nodes(t)] += edge.degrees()
        self._rows = {t: {0: _tensor(n.features), **{l: _tensor(a) for l, a in store.layers[t].items()}}
                      for t, n in graph.nodes.items()}
        self._readers: dict[EdgeType, tuple[np.ndarray, np.ndarray]] = {}

    # --- the graph in global ids (what layer_sets reads) --------------------------------
    def _split(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(type index, local id) of existing global ids."""
        kind = np.searchsorted(self.offsets, nodes, side="right") - 1
        return kind, nodes - self.offsets[kind]

    def in_degree(self, nodes: np.ndarray) -> np.ndarray:
        return self._degree[nodes]

    def _rows_of(self, nodes: np.ndarray, adjacency) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, concatenated global neighbour ids) of existing nodes, summed over the
        edge types adjacency(node type) lists as (neighbour type, indptr, indices)."""
        kind, local = self._split(nodes)
        pos_parts, val_parts = [], []
        for i, t in enumerate(self.types):
            at = np.flatnonzero(kind == i)
            if at.size == 0:
                continue
            for other, indptr, indices in adjacency(t):
                lens, vals = gather_rows(indptr, indices, local[at])
                pos_parts.append(np.repeat(at, lens))
                val_parts.append(vals.astype(np.int64) + self.offset[other])
        if not pos_parts:
            return np.zeros(len(nodes), np.int64), np.empty(0, np.int64)
        pos, vals = np.concatenate(pos_parts), np.concatenate(val_parts)
        order = np.argsort(pos, kind="stable")
        return np.bincount(pos, minlength=len(nodes)).astype(np.int64), vals[order]

    def in_rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = self.graph
        return self._rows_of(nodes, lambda t: [(e[0], np.asarray(g.edges[e].indptr), np.asarray(g.edges[e].indices))
                                               for e in self.into[t]])

    def out_rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Readers of nodes (each edge type's reverse adjacency, built on first use)."""
        return self._rows_of(nodes, lambda s: [(e[2], *self._reader_csr(e)) for e in self.graph.edge_types
                                               if e[0] == s])

    def _reader_csr(self, e: EdgeType) -> tuple[np.ndarray, np.ndarray]:
        if e not in self._readers:
            import scipy.sparse as sp

            edge, (s, _, t) = self.graph.edges[e], e
            shape = (self.graph.num_nodes(t), self.graph.num_nodes(s))
            csc = sp.csr_matrix((np.ones(edge.num_edges, np.int8), np.asarray(edge.indices),
                                 np.asarray(edge.indptr)), shape=shape).tocsc()
            self._readers[e] = (csc.indptr.astype(np.int64), csc.indices.astype(np.int64))
        return self._readers[e]

    # --- a request ------------------------------------------------------------------------
    def infer(self, node_type: str, features: np.ndarray, edges: dict[EdgeType, np.ndarray], *,
              mode: str = "srpe", gamma: float = 0.1, policy: str = "ratio", seed: int = 0) -> TypedNewNodeResult:
        """Outputs of q query nodes of node_type (features [q, F_t]); edges: per edge type,
        local [2, m] ids (query node j of node_type is N_t + j), validated by the caller
        (each edge touches a query node). Reverse edge types are not added here."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        q, K = int(features.shape[0]), self.model.num_layers
        n_q = self.graph.num_nodes(node_type)
        typed = {e: np.asarray(ei, dtype=np.int64).reshape(2, -1) for e, ei in edges.items() if np.size(ei)}

        def glob(ids: np.ndarray, t: str) -> np.ndarray:
            return np.where((t == node_type) & (ids >= n_q), self.total + ids - n_q, ids + self.offset[t])

        pairs = [np.stack([glob(ei[0], e[0]), glob(ei[1], e[2])]) for e, ei in typed.items()]
        qsrc, qdst = query_edges(np.concatenate(pairs, axis=1) if pairs else np.empty((2, 0), np.int64),
                                 self.total, q, undirected=False)
        sets = layer_sets(mode, K, self.total, q, qsrc, qdst, gcn=False, gamma=gamma, policy=policy, seed=seed,
                          in_degree=self.in_degree, in_rows=self.in_rows, out_rows=self.out_rows)
        features_t = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        computed: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        for layer in range(1, K + 1):
            targets = self._local(sets[layer - 1], node_type, n_q)
            computed = self._layer(layer, targets, typed, node_type, n_q, features_t, computed)
        if node_type not in computed:
            raise ValueError(f"the model's last layer gives no output for node type {node_type!r}")
        hidden = computed[node_type][1][:q]  # queries come first in every layer's targets
        with torch.inference_mode():
            logits = self.model.head({node_type: hidden})[node_type]
        recomputed = len(minus(unique_ints(np.concatenate(sets[:-1])), np.arange(self.total, self.total + q))) \
            if K > 1 else 0
        return TypedNewNodeResult(logits.float().numpy(), hidden.float().numpy(), recomputed)

    def _local(self, nodes: np.ndarray, node_type: str, n_q: int) -> dict[str, np.ndarray]:
        """Global ids split by type into local ids, in their order (query nodes: N_t + j)."""
        out: dict[str, list[np.ndarray]] = {}
        query = nodes >= self.total
        if query.any():
            out[node_type] = [n_q + nodes[query] - self.total]
        kind, local = self._split(nodes[~query])
        for i, t in enumerate(self.types):
            mine = local[kind == i]
            if mine.size:
                out.setdefault(t, []).append(mine)
        return {t: np.concatenate(v) for t, v in out.items()}

    def _layer(self, layer: int, targets: dict[str, np.ndarray], typed: dict[EdgeType, np.ndarray],
               node_type: str, n_q: int, features: torch.Tensor, computed):
        """Layer `layer`'s rows of `targets` (local ids per type), from layer-(layer-1)
        inputs: computed where `computed` has them, else stored."""
        i = layer - 1
        edge_src: dict[EdgeType, np.ndarray] = {}
        edge_dst: dict[EdgeType, np.ndarray] = {}
        for e in self.model.layer_edges[i]:
            s, _, t = e
            if t not in targets or not self._has(layer - 1, s):
                continue
            tg = targets[t]
            existing = np.flatnonzero(tg < self.graph.num_nodes(t))
            edge = self.graph.edges[e]
            lens, src = gather_rows(np.asarray(edge.indptr), np.asarray(edge.indices), tg[existing])
            src_parts, dst_parts = [src.astype(np.int64)], [np.repeat(existing, lens)]
            if e in typed:  # the request's edges of this type into these targets
                qs, qd = typed[e]
                where = _positions(tg, qd)
                hit = where >= 0
                src_parts.append(qs[hit])
                dst_parts.append(where[hit])
            edge_src[e], edge_dst[e] = np.concatenate(src_parts), np.concatenate(dst_parts)
        sources: dict[str, np.ndarray] = {}
        for (s, _, _), src in edge_src.items():
            sources[s] = unique_ints(np.concatenate([sources[s], src])) if s in sources else unique_ints(src)
        x = {s: self._inputs(layer - 1, s, ids, node_type, n_q, features, computed) for s, ids in sources.items()}
        x_dst = {t: self._inputs(layer - 1, t, ids, node_type, n_q, features, computed)
                 for t, ids in targets.items() if self._has(layer - 1, t)}
        edge_index = {e: torch.from_numpy(np.stack([np.searchsorted(sources[e[0]], src), edge_dst[e]]))
                      for e, src in edge_src.items()}
        with torch.inference_mode():
            out = self.model.layer(i, x, edge_index, x_dst)
        return {t: (targets[t], rows) for t, rows in out.items()}

    def _has(self, layer: int, t: str) -> bool:
        """Whether node type t has rows after `layer` (0: features), as a layer reads them."""
        return layer == 0 or layer in self._rows[t]

    def _inputs(self, layer: int, t: str, ids: np.ndarray, node_type: str, n_q: int, features: torch.Tensor,
                computed) -> torch.Tensor:
        """Layer-`layer` rows of type t's local ids: computed, else stored; query nodes'
        features from the request at layer 0."""
        n = self.graph.num_nodes(t)
        existing = ids < n
        out = torch.index_select(self._rows[t][layer], 0, torch.from_numpy(np.where(existing, ids, 0))).float()
        if layer == 0 and t == node_type and not existing.all():
            out[torch.from_numpy(np.flatnonzero(~existing))] = features[torch.from_numpy(ids[~existing] - n_q)]
        if t in computed:
            done, rows = computed[t]
            where = _positions(ids, done)
            hit = where >= 0
            out[torch.from_numpy(where[hit])] = rows[torch.from_numpy(np.flatnonzero(hit))]
        elif layer > 0 and not existing.all():
            raise RuntimeError("query nodes need computed inputs above layer 0")
        return out


def _positions(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Position of each id in `table` (unique values, any order); -1 where absent."""
    if table.size == 0 or ids.size == 0:
        return np.full(ids.shape[0], -1, dtype=np.int64)
    order = np.argsort(table, kind="stable")
    pos = np.minimum(np.searchsorted(table, ids, sorter=order), table.size - 1)
    found = order[pos]
    return np.where(table[found] == ids, found, -1)
