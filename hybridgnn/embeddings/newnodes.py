"""Embeddings of new (query) nodes from precomputed embeddings, with selective
recomputation (SRPE, Reforge §V).

A request brings q query nodes (ids num_nodes .. num_nodes+q-1) with features and edges
to existing nodes and to each other. Every mode is one evaluation with a different set
R_l of nodes whose layer-l embedding is computed; every other node's input is its PE:

    pe    (γ = 0)  R_l = Q
    srpe  (γ)      R_l = Q ∪ S for l < K, S = the top ⌈γ·|D|⌉ direct neighbours D of Q by
                   query-edge ratio |N_Q(u)| / (|N(u)| + |N_Q(u)|) (same order as
                   |N_Q(u)|/|N(u)|, defined at degree 0); R_K = Q
    sampled        no PEs: K-hop keyed neighbour sampling (sampling.keyed) over the graph
                   plus the query edges, one hop per layer
    full           R_l = {u : Q reaches u within l steps along edges (changes spread
                   to readers) and u reaches Q within K - l steps (Q reads it)}: exactly
                   the embeddings the query edges change and later layers read, so the
                   result is exact, on directed graphs too (GCN: l + 1 steps, as new
                   degrees reweight one hop further)

Direct neighbours are the existing nodes a query edge points into; their layer-l inputs
add the query nodes. GCN weights use whole-graph degrees plus the query edges; GAT reads
the computed target embedding, so attention is exact wherever R says so.

A query node without edges (or with only a self-edge) is an isolated node: every mode
answers the model's embedding of it from its own features alone, exactly what the model
gives an isolated node of the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from hybridgnn.embeddings.precompute import gcn_degrees
from hybridgnn.embeddings.store import EmbeddingStore
from hybridgnn.errors import Conflict
from hybridgnn.graph.host import host_tensor
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.decompose import decompose
from hybridgnn.models.gnn import GNN
from hybridgnn.sampling.keyed import draw, sample_keyed

MODES = ("full", "pe", "srpe", "sampled")


def unique_ints(x: np.ndarray) -> np.ndarray:
    """Sorted unique integers by sort + diff (numpy's hash-based unique is slower here)."""
    if x.size == 0:
        return x.astype(np.int64, copy=False)
    a = np.sort(x)
    keep = np.empty(a.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def minus(a_sorted: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elements of sorted unique a that are not in b."""
    b_sorted = unique_ints(b)
    if b_sorted.size == 0:
        return a_sorted
    pos = np.minimum(np.searchsorted(b_sorted, a_sorted), b_sorted.size - 1)
    return a_sorted[b_sorted[pos] != a_sorted]
POLICIES = ("ratio", "random", "degree")


def query_edges(edge_index: np.ndarray, n: int, q: int, undirected: bool) -> tuple[np.ndarray, np.ndarray]:
    """A request's edges as (sources, targets) sorted by target then source, without
    duplicates or self-edges (the self-loop layers add anyway), both directions when
    undirected. Query node j is id n + j."""
    ei = np.asarray(edge_index, dtype=np.int64).reshape(2, -1)
    if undirected and ei.size:
        ei = np.concatenate([ei, ei[::-1]], axis=1)
    ei = ei[:, ei[0] != ei[1]]
    size = n + q  # one sorted key per edge, target-major: deduplicates and groups at once
    key = unique_ints(ei[1] * size + ei[0])
    return key % size, key // size


def sampled_fanouts(fanouts, num_layers: int) -> tuple[int, ...]:
    """The fanouts mode `sampled` draws with: one hop per layer (hops past the last layer
    would not change the answer)."""
    if not fanouts:
        raise ValueError("mode 'sampled' needs fanouts")
    if len(fanouts) < num_layers:
        raise ValueError(f"mode 'sampled' needs a fanout per layer: the model has {num_layers} layers, "
                         f"the fanouts are {list(fanouts)}")
    return tuple(int(f) for f in fanouts[:num_layers])


def select_recompute(direct: np.ndarray, qsrc: np.ndarray, qdst: np.ndarray, n: int, gamma: float, policy: str,
                     seed: int, in_degree) -> np.ndarray:
    """SRPE's targets: the top ⌈γ·|direct|⌉ direct neighbours by `policy` (sorted ids).
    in_degree(nodes) gives stored in-degrees."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be within [0, 1], got {gamma}")
    # ⌈γ·|D|⌉ of γ as written (0.07 · 100 is 7.000000000000001 in floats, whose ceiling is 8)
    k = math.ceil(Fraction(repr(float(gamma))) * len(direct))
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if policy == "ratio":
        from_query = qsrc >= n
        nq = np.bincount(np.searchsorted(direct, qdst[from_query & (qdst < n)]), minlength=len(direct))
        score = nq / (in_degree(direct) + nq)
    elif policy == "degree":  # importance: the best-connected neighbours
        score = np.asarray(in_degree(direct), dtype=np.float64)
    elif policy == "random":
        score = np.random.default_rng(seed).random(len(direct))
    else:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    top = np.argsort(-score, kind="stable")[:k]
    return direct[np.sort(top)]


def levels(start: np.ndarray, hops: int, rows) -> list[np.ndarray]:
    """Nodes by distance from a set: levels[0] = start (distance 1), levels[k] the new
    nodes one more step along rows(nodes) -> (lengths, values); at most `hops` levels."""
    if hops <= 0 or start.size == 0:
        return []
    found, seen, frontier = [start], start, start
    for _ in range(hops - 1):
        frontier = minus(unique_ints(rows(frontier)[1]), seen)
        if frontier.size == 0:
            break
        found.append(frontier)
        seen = unique_ints(np.concatenate([seen, frontier]))
    return found


def layer_sets(mode: str, num_layers: int, n: int, q: int, qsrc: np.ndarray, qdst: np.ndarray, *, gcn: bool,
               gamma: float, policy: str, seed: int, in_degree, in_rows, out_rows) -> list[np.ndarray]:
    """R_1..R_K of a new-node request (see the module docstring): the nodes whose layer-l
    embedding is computed, query nodes first. The graph is read only through in_degree,
    in_rows and out_rows, so a partitioned graph plans the same sets."""
    K = num_layers
    queries = np.arange(n, n + q)
    direct = unique_ints(qdst[(qsrc >= n) & (qdst < n)])
    if mode == "pe":
        keep = np.empty(0, dtype=np.int64)
    elif mode == "srpe":
        keep = select_recompute(direct, qsrc, qdst, n, gamma, policy, seed, in_degree)
    elif mode != "full":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "full":
        # Layer l changes at nodes the query edges reach within l steps along the way
        # changes spread (to a node's readers; GCN one step further, as a direct
        # neighbour's new degree reweights what it sends), and the queries read it
        # within K-l steps along in-edges. On a symmetric graph both are one distance.
        extra = 1 if gcn else 0
        read = unique_ints(qsrc[(qdst >= n) & (qsrc < n)])
        changed = levels(direct, K - 1 + extra, out_rows)
        needed = levels(read, K - 1, in_rows)
    sets = []
    for layer in range(1, K + 1):
        if layer == K:
            sets.append(queries)
        elif mode == "full":
            reach = changed[: layer + extra]
            want = needed[: K - layer]
            both = (np.intersect1d(np.concatenate(reach), np.concatenate(want), assume_unique=True)
                    if reach and want else np.empty(0, dtype=np.int64))
            sets.append(np.concatenate([queries, both]))
        else:
            sets.append(np.concatenate([queries, keep]))
    return sets


def existing_layer_sets(targets: np.ndarray, num_layers: int, in_rows) -> list[np.ndarray]:
    """R_1..R_K for existing nodes with full neighbourhoods from their features: layer l
    computes the targets and every node within K - l steps along in-edges, targets first."""
    found = levels(targets, num_layers, in_rows)
    return [np.concatenate(found[: num_layers - layer + 1]) for layer in range(1, num_layers + 1)]


@dataclass
class NewNodeResult:
    logits: np.ndarray  # [q, out_dim] float32: the model's output
    recomputed: int  # existing nodes recomputed (|S| or the full set)
    embeddings: np.ndarray | None = None  # [q, hidden] float32: what the model's head reads


def _gather(indptr: np.ndarray, indices: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    starts = indptr[nodes]
    lens = indptr[nodes + 1] - starts
    offs = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
    return lens, indices[offs].astype(np.int64)


class StoredGraphView:
    """What the evaluator reads, from a stored graph and its precomputed layers."""

    def __init__(self, graph: GraphStore, layers: list[np.ndarray], gcn: bool):
        self.graph = graph
        self.indptr, self.indices = np.asarray(graph.indptr), np.asarray(graph.indices)
        self._degrees = graph.degrees()
        self._features = host_tensor(graph.features)
        # mapped as stored: rows() widens the rows it gathers (a float16 store widened whole
        # would sit in memory as twice its files)
        self._layers = [host_tensor(a) for a in layers]
        self._has_loop = gcn_degrees(graph)[1] if gcn else None
        self._rev: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_nodes(self) -> int:
        return self.graph.num_nodes

    def close(self) -> None:
        """Let go of the stored layers' memory maps (EmbeddingStore.close): no rows after."""
        self._layers.clear()

    def in_rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _gather(self.indptr, self.indices, nodes)

    def out_rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Readers of `nodes` (the reverse adjacency, built on first use)."""
        if self._rev is None:
            import scipy.sparse as sp

            n = self.graph.num_nodes
            csc = sp.csr_matrix((np.ones(self.indices.shape[0], dtype=np.int8), self.indices, self.indptr),
                                shape=(n, n)).tocsc()
            self._rev = (csc.indptr.astype(np.int64), csc.indices.astype(np.int64))
        return _gather(*self._rev, nodes)

    def in_degree(self, nodes: np.ndarray) -> np.ndarray:
        return self._degrees[nodes]

    def has_loop(self, nodes: np.ndarray) -> np.ndarray:
        return self._has_loop[nodes]

    def rows(self, layer: int, nodes: np.ndarray) -> torch.Tensor:
        """Layer-`layer` rows (0: features) of existing nodes, float32."""
        table = self._features if layer == 0 else self._layers[layer - 1]
        return torch.index_select(table, 0, torch.from_numpy(nodes)).float()


class DynamicGraphView:
    """What the evaluator reads, from a changing graph and the embeddings kept fresh with
    it (IncrementalEmbeddings): call under the graph's read lock."""

    def __init__(self, graph, incremental):
        self.graph, self.incremental = graph, incremental

    @property
    def num_nodes(self) -> int:
        return self.graph.num_nodes

    def in_rows(self, nodes):
        lens, vals = self.graph.in_neighbours(nodes)
        return lens, vals.astype(np.int64)

    def out_rows(self, nodes):
        lens, vals = self.graph.out_neighbours(nodes)
        return lens, vals.astype(np.int64)

    def in_degree(self, nodes):
        return self.graph.in_degree(nodes)

    def has_loop(self, nodes):
        return self.graph.self_loop[nodes]

    def rows(self, layer: int, nodes: np.ndarray) -> torch.Tensor:
        if layer == 0:
            return torch.from_numpy(self.graph.features(nodes))
        return torch.from_numpy(np.ascontiguousarray(self.incremental.layers[layer - 1][nodes], dtype=np.float32))


class NewNodeEvaluator:
    def __init__(self, graph: GraphStore, model: GNN, store: EmbeddingStore | None, *, view=None):
        """store=None serves only mode `sampled`. view: a DynamicGraphView to evaluate on a
        changing graph and its fresh embeddings (the graph and model still describe it)."""
        model = decompose(model)
        if store is not None and len(store.layers) != model.num_layers:
            raise ValueError(f"stored embeddings have {len(store.layers)} layers, the model {model.num_layers}")
        self.model, self.store = model, store
        self.view = view if view is not None else StoredGraphView(graph, store.layers if store is not None else [],
                                                                  model.gcn_normalised)
        self.graph = view.graph if view is not None else graph
        self.gcn = model.gcn_normalised

    def close(self) -> None:
        """Let go of the stored rows now (Resources.close): a view of a stored graph holds
        its layers' memory maps, as tensors."""
        if isinstance(self.view, StoredGraphView):
            self.view.close()

    def infer(self, features: np.ndarray, edge_index: np.ndarray, *, mode: str = "srpe", gamma: float = 0.1,
              undirected: bool = True, policy: str = "ratio", seed: int = 0,
              fanouts: tuple[int, ...] | None = None) -> NewNodeResult:
        n, q = self.view.num_nodes, features.shape[0]
        qsrc, qdst = query_edges(edge_index, n, q, undirected)
        queries = np.arange(n, n + q)
        if mode == "sampled":
            return self._sampled(features, queries, qsrc, qdst, fanouts, seed)
        if self.store is None:
            raise Conflict(f"mode {mode!r} needs precomputed embeddings; run `hybridgnn precompute`")
        view = self.view
        sets = layer_sets(mode, self.model.num_layers, n, q, qsrc, qdst, gcn=self.gcn, gamma=gamma, policy=policy,
                          seed=seed, in_degree=view.in_degree, in_rows=view.in_rows, out_rows=view.out_rows)
        K = self.model.num_layers
        computed: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        runs = self._runs(qdst)
        for layer in range(1, K + 1):
            targets = sets[layer - 1]
            sources, block = self._block(targets, qsrc, runs)
            x = self._inputs(layer - 1, sources, features, computed.get(layer - 1))
            with torch.inference_mode():
                if self.gcn:
                    block, w = self._gcn_weights(block, sources, len(targets), runs)
                    y = self.model.layer(layer - 1, x, torch.from_numpy(block), len(targets),
                                         gcn_weight=torch.from_numpy(w))
                else:
                    y = self.model.layer(layer - 1, x, torch.from_numpy(block), len(targets))
            computed[layer] = (targets, y)
        recomputed = len(minus(unique_ints(np.concatenate(sets[:-1])), queries)) if K > 1 else 0
        # Queries come first in every layer's targets; jumping knowledge mixes their rows.
        with torch.inference_mode():
            rows = [computed[layer][1][:q] for layer in range(1, K + 1)]
            out = self.model.readout(rows)
            hidden = self.model.embedding(rows, torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)))
        return NewNodeResult(out.float().numpy(), recomputed, hidden.float().numpy())

    def _sampled(self, features, queries, qsrc, qdst, fanouts, seed: int) -> NewNodeResult:
        """Keyed neighbour sampling (sampling.keyed) over the graph plus the query edges, one
        hop per layer; no precomputed embeddings involved. Keys make the draw a function of
        the edges and the seed, so partition ranks draw the same sample."""
        fanouts = sampled_fanouts(fanouts, self.model.num_layers)
        view, n = self.view, self.view.num_nodes

        def choose(frontier, fanout):
            return draw(frontier, n, view.in_rows, qsrc, qdst, seed, fanout)[:2]

        sample = sample_keyed(queries, fanouts, choose)
        ids = sample.nodes
        existing = ids < n
        x = torch.empty((len(ids), features.shape[1]), dtype=torch.float32)
        x[torch.from_numpy(np.flatnonzero(existing))] = view.rows(0, ids[existing])
        x[torch.from_numpy(np.flatnonzero(~existing))] = torch.from_numpy(features[ids[~existing] - n])
        degrees = None
        if self.gcn:
            targets, _, counts = self._runs(qdst)
            degrees = self._augmented_degrees(ids, targets, counts)
        with torch.inference_mode():
            out, hidden = self.model(x, torch.from_numpy(sample.edge_index), sample.nodes_per_hop,
                                     sample.edges_per_hop, degrees, with_embeddings=True)
        q = len(queries)  # the seeds come first, in order
        return NewNodeResult(out[:q].float().numpy(), 0, hidden[:q].float().numpy())

    def _augmented_degrees(self, ids: np.ndarray, targets: np.ndarray, counts: np.ndarray):
        """(in-degree, has self-loop) of sample nodes `ids` in the graph plus the query edges
        (`counts[k]` of them into `targets[k]`, sorted); query nodes have no self-loop."""
        n = self.view.num_nodes
        existing = ids < n
        deg = np.zeros(len(ids), dtype=np.int64)
        deg[existing] = self.view.in_degree(ids[existing])
        loop = np.zeros(len(ids), dtype=bool)
        loop[existing] = self.view.has_loop(ids[existing])
        if len(targets):
            pos = np.minimum(np.searchsorted(targets, ids), len(targets) - 1)
            hit = targets[pos] == ids
            deg[hit] += counts[pos[hit]]
        return torch.from_numpy(deg), torch.from_numpy(loop)

    @staticmethod
    def _runs(qdst: np.ndarray):
        """(nodes with query in-edges, first edge of each, count) from target-sorted edges."""
        if qdst.size == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        starts = np.concatenate([[0], np.flatnonzero(np.diff(qdst)) + 1])
        return qdst[starts], starts, np.diff(np.append(starts, qdst.size))

    @staticmethod
    def _lookup(runs, ids: np.ndarray):
        """(first query in-edge, count) of each id; count 0 where it has none."""
        nodes, starts, counts = runs
        if nodes.size == 0:
            zero = np.zeros(ids.shape[0], dtype=np.int64)
            return zero, zero
        pos = np.minimum(np.searchsorted(nodes, ids), nodes.size - 1)
        hit = nodes[pos] == ids
        return np.where(hit, starts[pos], 0), np.where(hit, counts[pos], 0)

    def _block(self, targets, qsrc, runs):
        """In-neighbours of targets in the graph plus the query edges, targets first."""
        n = self.view.num_nodes
        existing = np.flatnonzero(targets < n)
        lens, base_src = self.view.in_rows(targets[existing])
        base_dst = np.repeat(existing, lens)
        lo, qcount = self._lookup(runs, targets)
        qoffs = np.repeat(lo - np.cumsum(qcount) + qcount, qcount) + np.arange(int(qcount.sum()))
        q_src = qsrc[qoffs]
        q_dst = np.repeat(np.arange(len(targets)), qcount)
        all_src = np.concatenate([base_src, q_src])
        others = minus(unique_ints(all_src), targets)
        sources = np.concatenate([targets, others])
        return sources, np.stack([self._positions(sources, all_src), np.concatenate([base_dst, q_dst])])

    def _positions(self, sources: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Row of each id in `sources` (ids must all occur). An uninitialised id-sized array
        costs only the pages touched, unlike a search per id."""
        if ids.size == 0:  # e.g. query nodes without edges: nothing to place
            return np.empty(0, dtype=np.int64)
        where = np.empty(int(max(sources.max(), ids.max())) + 1, dtype=np.int64)
        where[sources] = np.arange(len(sources))
        return where[ids]

    def _inputs(self, layer, sources, features, computed) -> torch.Tensor:
        """Layer-`layer` inputs of `sources`: computed where R says so, else stored (features
        at layer 0, PEs above); query nodes' features come from the request."""
        n = self.view.num_nodes
        existing = sources < n
        queries = np.flatnonzero(~existing)
        # One gather for every row (query rows read row 0 and are overwritten below): cheaper
        # than masking the existing rows out first.
        out = self.view.rows(layer, np.where(existing, sources, 0))
        if layer == 0 and queries.size:
            out[torch.from_numpy(queries)] = torch.from_numpy(features[sources[queries] - n])
        if computed is not None:
            ids, values = computed
            # Computed rows a later layer does not read are simply not among the sources.
            present = np.isin(ids, sources, assume_unique=True)
            pos = self._positions(sources, ids[present])
            out[torch.from_numpy(pos)] = values[torch.from_numpy(np.flatnonzero(present))]
        elif layer > 0 and not np.all(existing):
            raise RuntimeError("query nodes need computed inputs above layer 0")
        return out

    def _gcn_weights(self, block, sources, num_targets, runs):
        """gcn_norm over the graph plus query edges: degree = in-degree (+1 self-loop unless
        the node already has one), counting query in-edges; query nodes get a self-loop."""
        n = self.view.num_nodes
        existing = sources < n
        clipped = np.where(existing, sources, 0)
        has_loop = self.view.has_loop(clipped)
        norm_deg = self.view.in_degree(clipped) + ~has_loop
        query_in = self._lookup(runs, sources)[1]
        deg = np.where(existing, norm_deg, 1).astype(np.float64) + query_in
        loops = np.flatnonzero(~(has_loop[:num_targets] & existing[:num_targets]))
        block = np.concatenate([block, np.stack([loops, loops])], axis=1)
        inv = 1.0 / np.sqrt(deg)
        return block, (inv[block[0]] * inv[block[1]]).astype(np.float32)
