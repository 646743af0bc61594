"""Computation graph parallelism (Reforge §VI): a request served by every partition rank
at once, each building its part of the computation graph from the edges it holds.

Every rank runs the same calls with the same request (collective). The plan is the
single-process one (embeddings.newnodes.layer_sets), reading the graph through
collectives: a node's in-neighbours are the union of each rank's local ones, degrees
come from owners. Per layer l, with targets R_l in one order everywhere:

    each rank   aggregates the edges into R_l whose source it holds (its own nodes, and
                the query nodes it is home to), from rows it has: features, its
                precomputed rows, or what it computed at layer l-1
    all-to-all  each target's partial state goes to the target's home: its owner, or
                rank j mod N for query node j
    home        merges the parts, applies the layer's update with the target's own row,
                and keeps the result for layer l+1

Rank 0 then collects the output nodes' rows of every layer and applies the readout.
Nothing here fetches a remote feature or embedding row: only partial aggregates (one row
per target per rank with an edge into it), GAT's target logit halves and the plan's ids
cross ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridgnn.distributed.collectives import Collectives
from hybridgnn.distributed.merge import split_model
from hybridgnn.distributed.serving_part import ServingPart
from hybridgnn.embeddings.newnodes import (
    existing_layer_sets,
    layer_sets,
    minus,
    query_edges,
    sampled_fanouts,
    unique_ints,
)
from hybridgnn.embeddings.store import hidden_rows
from hybridgnn.errors import Conflict
from hybridgnn.models.decompose import decompose
from hybridgnn.sampling.keyed import (
    KeyedSample,
    draw,
    keep_smallest,
    sample_keyed,
)


@dataclass
class PartitionedResult:
    logits: np.ndarray             # [k, out_dim] float32, in request order
    embeddings: np.ndarray         # [k, hidden] float32: what the model's head reads
    recomputed: int                # existing nodes computed below the last layer
    bytes_moved: int | None = None  # payload bytes all ranks sent for this request


class PartitionedEvaluator:
    """This rank's half of every partitioned request (call the same methods on all ranks)."""

    def __init__(self, part: ServingPart, model, coll: Collectives | None = None):
        self.part = part
        self.model = decompose(model)
        self.splits = split_model(self.model)  # ConfigError when a layer has no merge function
        self.gcn = self.model.gcn_normalised
        self.coll = coll if coll is not None else Collectives()
        self.rank, self.world = self.coll.rank, self.coll.world
        self.updater = None  # part_updates.PartUpdater, where the rank takes graph updates
        if part.layers and len(part.layers) != self.model.num_layers:
            raise ValueError(f"stored embeddings have {len(part.layers)} layers, the model {self.model.num_layers}")

    # --- the graph as the plan reads it (collective) --------------------------------
    def _in_rows(self, nodes: np.ndarray):
        return None, self.coll.union(self.part.local_in(nodes)[1])

    def _out_rows(self, nodes: np.ndarray):
        return None, self.coll.union(self.part.local_out(nodes)[1])

    def _in_degree(self, nodes: np.ndarray) -> np.ndarray:
        values = torch.zeros(len(nodes), dtype=torch.float64)
        own = self.part.owner_of(nodes) == self.rank
        values[torch.from_numpy(own)] = torch.from_numpy(self.part.in_degree[self.part.position(nodes[own])]
                                                         .astype(np.float64))
        return self.coll.sum(values).numpy().astype(np.int64)

    # --- requests -----------------------------------------------------------------
    def infer_new(self, features: np.ndarray, edge_index: np.ndarray, *, mode: str = "srpe", gamma: float = 0.1,
                  undirected: bool = True, policy: str = "ratio", seed: int = 0, fanouts=None,
                  count_bytes: bool = False) -> PartitionedResult | None:
        """New nodes (features [q, f], edges over ids < n + q) by mode full, pe, srpe or
        sampled (fanouts); the result on rank 0, None elsewhere."""
        if mode not in ("full", "pe", "srpe", "sampled"):
            raise Conflict(f"new-node mode {mode!r} is not served on a partitioned graph (full, pe, srpe, "
                           "sampled are)")
        if mode != "sampled" and not self.part.layers:
            raise Conflict(f"mode {mode!r} needs precomputed embeddings; run `hybridgnn precompute`")
        n, q = self.part.num_nodes, int(features.shape[0])
        qsrc, qdst = query_edges(edge_index, n, q, undirected)
        queries = np.arange(n, n + q)
        features = np.ascontiguousarray(features, dtype=np.float32)
        self.coll.bytes_sent = 0
        with torch.inference_mode():
            if mode == "sampled":
                sample = self._sample(queries, qsrc, qdst, sampled_fanouts(fanouts, self.model.num_layers), seed)
                return self._result(self._run_sample(sample, features, qsrc, qdst), 0, count_bytes)
            sets = layer_sets(mode, self.model.num_layers, n, q, qsrc, qdst, gcn=self.gcn, gamma=gamma,
                              policy=policy, seed=seed, in_degree=self._in_degree, in_rows=self._in_rows,
                              out_rows=self._out_rows)
            out = self._run(sets, features, qsrc, qdst, queries)
        recomputed = len(minus(unique_ints(np.concatenate(sets[:-1])), queries)) if len(sets) > 1 else 0
        return self._result(out, recomputed, count_bytes)

    def infer_existing(self, node_ids: np.ndarray, *, count_bytes: bool = False) -> PartitionedResult | None:
        """Existing nodes with full neighbourhoods, from features (no precomputed rows):
        the model's exact output; on rank 0, None elsewhere."""
        ids = np.asarray(node_ids, dtype=np.int64)
        targets = unique_ints(ids)
        empty = np.empty(0, dtype=np.int64)
        self.coll.bytes_sent = 0
        with torch.inference_mode():
            sets = existing_layer_sets(targets, self.model.num_layers, self._in_rows)
            out = self._run(sets, np.empty((0, 0), dtype=np.float32), empty, empty, targets)
        if out is not None:
            pos = np.searchsorted(targets, ids)
            out = (out[0][pos], out[1][pos])
        recomputed = len(minus(unique_ints(np.concatenate(sets[:-1])), targets)) if len(sets) > 1 else 0
        return self._result(out, recomputed, count_bytes)

    def lookup(self, node_ids: np.ndarray, *, with_embeddings: bool = True,
               count_bytes: bool = False) -> PartitionedResult | None:
        """Existing nodes' precomputed rows, each from its owner: the stored outputs and
        (with_embeddings) what the model's head reads, as one process answers a lookup; on
        rank 0, None elsewhere."""
        part = self.part
        if not part.layers:
            raise Conflict("no precomputed embeddings for this model and dataset; run `hybridgnn precompute`")
        ids = np.asarray(node_ids, dtype=np.int64)
        targets = unique_ints(ids)
        mine = targets[part.owner_of(targets) == self.rank] if len(targets) else targets
        pos = part.position(mine)
        final = (part.output if part.output is not None else part.layers[-1])[torch.from_numpy(pos)]
        parts = [final]
        if with_embeddings:
            with torch.inference_mode():
                parts.append(torch.from_numpy(hidden_rows(
                    self.model, [t.numpy() for t in part.layers], lambda p: part.features[torch.from_numpy(p)].numpy(),
                    pos)))
        self.coll.bytes_sent = 0
        out = self._to_rank0(len(targets), np.searchsorted(targets, mine), torch.cat(parts, dim=1).float())
        if out is not None:
            at = np.searchsorted(targets, ids)
            width = int(final.shape[1])
            out = (out[at, :width].numpy(), out[at, width:].numpy())
        return self._result(out, 0, count_bytes)

    def _to_rank0(self, count: int, idx: np.ndarray, rows: torch.Tensor) -> torch.Tensor | None:
        """Rows [k, w] for positions idx of a table of `count` rows, from every rank to rank 0:
        the whole table there (every position sent by some rank), None elsewhere."""
        width = int(rows.shape[1])
        outgoing = [(torch.empty(0, dtype=torch.int64), torch.zeros((0, width))) for _ in range(self.world)]
        outgoing[0] = (torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)), rows)
        got_idx, got = self.coll.all_to_all(outgoing, width)
        if self.rank != 0:
            return None
        table = torch.empty((count, width))
        table[got_idx] = got
        return table

    def _result(self, out, recomputed: int, count_bytes: bool) -> PartitionedResult | None:
        moved = None
        if count_bytes:
            sent = self.coll.bytes_sent
            moved = int(self.coll.sum(torch.tensor([float(sent)], dtype=torch.float64)).item())
        if out is None:
            return None
        return PartitionedResult(out[0], out[1], recomputed, moved)

    # --- execution ----------------------------------------------------------------
    def _home(self, ids: np.ndarray) -> np.ndarray:
        n = self.part.num_nodes
        home = np.empty(len(ids), dtype=np.int64)
        existing = ids < n
        home[existing] = self.part.owner_of(ids[existing])
        home[~existing] = (ids[~existing] - n) % self.world
        return home

    def _inputs(self, layer: int, width: int, ids: np.ndarray, features: np.ndarray, computed) -> torch.Tensor:
        """Layer-`layer` rows of nodes homed here: computed at the previous layer where
        the plan says so, else stored (features at 0, precomputed rows above), and a
        query node's features from the request."""
        n = self.part.num_nodes
        out = torch.empty((len(ids), width), dtype=torch.float32)
        done = np.zeros(len(ids), dtype=bool)
        if computed is not None and len(computed[0]):
            c_ids, c_rows = computed  # c_ids sorted
            pos = np.minimum(np.searchsorted(c_ids, ids), len(c_ids) - 1)
            done = c_ids[pos] == ids
            out[torch.from_numpy(done)] = c_rows[torch.from_numpy(pos[done])]
        stored = ~done & (ids < n)
        if stored.any():
            if layer > 0 and not self.part.layers:
                raise RuntimeError("a node's stored row above layer 0 was needed without precomputed embeddings")
            out[torch.from_numpy(stored)] = self.part.rows(layer, ids[stored])
        query = ~done & (ids >= n)
        if query.any():
            if layer > 0:
                raise RuntimeError("query nodes need computed inputs above layer 0")
            out[torch.from_numpy(query)] = torch.from_numpy(features[ids[query] - n])
        return out

    def _run(self, sets: list[np.ndarray], features, qsrc, qdst, outputs: np.ndarray, edges=None):
        """Run layers 1..K over the plan; rank 0 gets (logits, embeddings) of `outputs`
        (the first len(outputs) targets of every layer). edges(layer): that layer's edges
        held here, in place of the graph's and the request's (see `layer`)."""
        query = self._query(qdst)
        widths = [int(self.part.features.shape[1])]  # of each layer's rows, 0: features
        computed, kept = None, []
        mine_out = np.flatnonzero(self._home(outputs) == self.rank)
        kept.append(self._inputs(0, widths[0], outputs[mine_out], features, None))
        for layer in range(1, len(sets) + 1):
            computed = self.layer(layer, sets[layer - 1], widths[layer - 1], features, computed, qsrc, qdst, query,
                                  edges=edges(layer) if edges is not None else None)
            widths.append(int(computed[1].shape[1]))
            kept.append(self._inputs(layer, widths[layer], outputs[mine_out], features, computed))
        return self._collect(outputs, mine_out, kept)

    # --- mode sampled ---------------------------------------------------------------
    def _sample(self, queries, qsrc, qdst, fanouts, seed: int) -> KeyedSample:
        """One process's keyed sample (sampling.keyed), drawn collectively: per hop each rank
        keeps the smallest keys among the in-edges it holds, and everyone the smallest of
        all of those."""
        n = self.part.num_nodes
        held = self._home(qsrc) == self.rank  # a request edge is offered by its source's home
        own_qsrc, own_qdst = qsrc[held], qdst[held]

        def choose(frontier, fanout):
            mine = draw(frontier, n, self.part.local_in, own_qsrc, own_qdst, seed, fanout)
            every = self.coll.gather(np.stack(mine, axis=1))
            dst, src, _ = keep_smallest(every[:, 0], every[:, 1], every[:, 2], seed, fanout)
            return dst, src

        return sample_keyed(queries, fanouts, choose)

    def _run_sample(self, sample: KeyedSample, features, qsrc, qdst):
        """The model on a keyed sample as stack_forward runs it in one process: layer l's
        targets are the nodes within K - l hops, reading the edges drawn into them."""
        K, n = self.model.num_layers, self.part.num_nodes
        nodes = sample.nodes
        sets = [nodes[: sample.within(K - layer)] for layer in range(1, K + 1)]
        src_held = self._home(nodes[sample.src]) == self.rank
        scale = np.ones(len(sample.src), dtype=np.float64)
        if self.gcn:  # sampled_gcn_weights: d_v / s_v, whole in-degree (with the request's) over drawn
            targets = sets[0]
            degree = self._request_in(targets, *self._query(qdst)).astype(np.float64)
            existing = targets < n
            degree[existing] += self._in_degree(targets[existing])
            drawn = np.maximum(np.bincount(sample.dst, minlength=len(targets)), 1)
            scale = (degree / drawn[: len(targets)])[sample.dst]

        def edges(layer):
            end = sample.edges_within(K - layer + 1)
            held = np.flatnonzero(src_held[:end])
            return nodes[sample.src[held]], sample.dst[held], scale[held]

        return self._run(sets, features, qsrc, qdst, nodes[: sample.nodes_per_hop[0]], edges)

    @staticmethod
    def _query(qdst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query nodes with request edges into them, how many each)."""
        query_nodes = unique_ints(qdst)
        return query_nodes, np.bincount(np.searchsorted(query_nodes, qdst), minlength=len(query_nodes))

    def layer(self, layer: int, targets: np.ndarray, width: int, features: np.ndarray, computed, qsrc: np.ndarray,
              qdst: np.ndarray, query=None, edges=None) -> tuple[np.ndarray, torch.Tensor]:
        """Layer `layer` (1..K) of `targets` (one order on every rank) from layer-(layer-1)
        rows of `width` (computed: (sorted ids, rows) homed here, else stored); returns the
        rows of the targets homed here, as (sorted ids, rows). edges: (source ids, target
        positions, GCN weight scales) of a sample's edges held here, read instead of every
        graph and request edge (the layer still adds its self-loops)."""
        rank = self.rank
        query_nodes, query_in = query if query is not None else self._query(qdst)
        split = self.splits[layer - 1]
        home = self._home(targets)
        mine = np.flatnonzero(home == rank)
        if edges is None:
            src, dst, scale = *self._local_edges(targets, qsrc, qdst), None
        else:
            src, dst, scale = edges
        src, dst, scale = self._self_loops(src, dst, scale, targets, home, split.self_loops)
        sources = unique_ints(np.concatenate([src, targets[mine]]))
        x_src = self._inputs(layer - 1, width, sources, features, computed)
        x_own = x_src[torch.from_numpy(np.searchsorted(sources, targets[mine]))]
        weight = None
        if split.weighted:
            deg_t = self._degrees(targets, mine, query_nodes, query_in)
            deg_s = self._own_degrees(src, query_nodes, query_in)
            weight = 1.0 / np.sqrt(deg_s * deg_t[dst])
            weight = torch.from_numpy((weight if scale is None else weight * scale).astype(np.float32))
        info = None
        if split.needs_target_info:
            local = split.target_info(x_own)
            info = torch.zeros((len(targets), *local.shape[1:]), dtype=local.dtype)
            info[torch.from_numpy(mine)] = local
            info = self.coll.sum(info)
        dst_t = torch.from_numpy(dst)
        part = split.local(x_src, torch.from_numpy(np.searchsorted(sources, src)), dst_t, len(targets), info, weight)
        touched = np.flatnonzero(np.bincount(dst, minlength=len(targets)) > 0)
        outgoing = []
        for r in range(self.world):
            idx = touched[home[touched] == r]
            outgoing.append((torch.from_numpy(idx), part[torch.from_numpy(idx)]))
        idx_in, parts_in = self.coll.all_to_all(outgoing, split.width)
        slot = np.full(len(targets), -1, dtype=np.int64)
        slot[mine] = np.arange(len(mine))
        y = split.finish(torch.from_numpy(slot[idx_in.numpy()]), parts_in, len(mine), x_own)
        y = self.model.between_layers(layer - 1, y)
        order = np.argsort(targets[mine], kind="stable")
        return targets[mine][order], y[torch.from_numpy(order)]

    def _local_edges(self, targets, qsrc, qdst) -> tuple[np.ndarray, np.ndarray]:
        """(source ids, target positions) of the edges into `targets` held here: graph
        edges from own nodes and request edges from nodes homed here."""
        n, rank = self.part.num_nodes, self.rank
        if len(targets) == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        existing = np.flatnonzero(targets < n)
        lens, g_src = self.part.local_in(targets[existing])
        g_dst = np.repeat(existing, lens)
        order = np.argsort(targets, kind="stable")
        q_src = q_dst = np.empty(0, dtype=np.int64)
        if len(qdst):
            pos = np.minimum(np.searchsorted(targets[order], qdst), len(targets) - 1)
            hit = (targets[order][pos] == qdst) & (self._home(qsrc) == rank)
            q_src, q_dst = qsrc[hit], order[pos[hit]]
        return np.concatenate([g_src, q_src]).astype(np.int64), np.concatenate([g_dst, q_dst]).astype(np.int64)

    def _self_loops(self, src, dst, scale, targets, home, rule: str):
        """The edges plus the self-loops the layer adds for targets homed here ("all": one
        per target, replacing any; "missing": where the graph has none), loops last with
        weight scale 1."""
        n = self.part.num_nodes
        mine = np.flatnonzero(home == self.rank)
        if rule == "all":
            keep = src != targets[dst]
            src, dst, loops = src[keep], dst[keep], mine
            scale = scale[keep] if scale is not None else None
        elif rule == "missing":
            own_existing = mine[targets[mine] < n]
            lacking = own_existing[~self.part.has_loop[self.part.position(targets[own_existing])]]
            loops = np.concatenate([lacking, mine[targets[mine] >= n]])
        else:
            return src, dst, scale
        if scale is not None:
            scale = np.concatenate([scale, np.ones(len(loops))])
        return (np.concatenate([src, targets[loops]]).astype(np.int64), np.concatenate([dst, loops]).astype(np.int64),
                scale)

    def _own_degrees(self, ids, query_nodes, query_in) -> np.ndarray:
        """gcn_norm's degree of nodes homed here: in-degree, +1 without a self-loop (query
        nodes have none), plus the request's edges into them."""
        n = self.part.num_nodes
        deg = np.ones(len(ids), dtype=np.float64)
        existing = ids < n
        pos = self.part.position(ids[existing])
        deg[existing] = self.part.in_degree[pos] + ~self.part.has_loop[pos]
        return deg + self._request_in(ids, query_nodes, query_in)

    @staticmethod
    def _request_in(ids, query_nodes, query_in) -> np.ndarray:
        """How many of the request's edges go into each of ids (query_nodes sorted, with
        query_in edges each: `_query`)."""
        count = np.zeros(len(ids), dtype=np.int64)
        if len(query_nodes):
            at = np.minimum(np.searchsorted(query_nodes, ids), len(query_nodes) - 1)
            hit = query_nodes[at] == ids
            count[hit] = query_in[at[hit]]
        return count

    def _degrees(self, targets, mine, query_nodes, query_in) -> np.ndarray:
        """Every target's gcn_norm degree, each filled in by its home."""
        values = torch.zeros(len(targets), dtype=torch.float64)
        values[torch.from_numpy(mine)] = torch.from_numpy(self._own_degrees(targets[mine], query_nodes, query_in))
        return self.coll.sum(values).numpy()

    def _collect(self, outputs: np.ndarray, mine_out: np.ndarray, kept: list[torch.Tensor]):
        """Rank 0 gathers the output nodes' rows of every layer and applies the readout."""
        widths = [int(t.shape[1]) for t in kept]
        rows = torch.cat(kept, dim=1) if mine_out.size else torch.zeros((0, sum(widths)))
        table = self._to_rank0(len(outputs), mine_out, rows)
        if table is None:
            return None
        layers = list(torch.split(table, widths, dim=1))
        logits = self.model.readout(layers[1:])
        hidden = self.model.embedding(layers[1:], layers[0])
        return logits.float().numpy(), hidden.float().numpy()
