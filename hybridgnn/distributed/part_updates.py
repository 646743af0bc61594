"""Graph updates on a partitioned graph: each rank applies what it owns, then the
precomputed embeddings are brought up to date with computation graph parallelism.

Every rank receives the whole batch (in update-log order) and calls the same methods, so
the replicated state (node count, which nodes exist) moves in step everywhere and every
rank refuses a bad batch at the same point with the same message (graph.dynamic's
check_batch; whether an edge exists is asked of its source's owner; on a dataset with
names, nodes are named as the client names them: the engine sends the names of the nodes
each batch adds). A batch that passes the check is applied:

- edges go to the owner of their source (its out-row and the target's in-row there),
  whole-graph in-degrees and self-loops to the owner of the target; a removed node's
  edges are collected from every rank first;
- new nodes get the next ids (as in one process) and are owned by id mod ranks; feature
  rows go to their owner;
- embeddings: layer l is recomputed for the nodes that read something that changed at
  layer l-1 (RIPPLE++'s affected set: out-neighbours of changed rows, nodes whose
  in-row changed, new nodes, and for GCN the readers of a node whose degree changed),
  with the same per-layer step requests use; a node whose new row equals its old one
  stops the propagation there.

A failure after the check (memory, a lost rank) leaves this rank's state half-applied:
the rank exits and the group restarts and replays the log (the server's side).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from hybridgnn.distributed.cgp import PartitionedEvaluator
from hybridgnn.distributed.keyed_rows import rewrite_rows
from hybridgnn.embeddings.newnodes import unique_ints
from hybridgnn.errors import BadRequest
from hybridgnn.graph.dynamic import UpdateBatch, check_batch
from hybridgnn.graph.idmap import IdMap, namer


def _grown(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """`t` with room for `rows` rows (capacity doubles: appending n rows one batch at a
    time copies O(n) in all)."""
    if t is None or t.shape[0] >= rows:
        return t
    out = torch.zeros((max(rows, 2 * t.shape[0], 16), *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class PartUpdater:
    """This rank's half of every graph update (call the same methods on all ranks)."""

    def __init__(self, ev: PartitionedEvaluator, reopen=None, names: IdMap | None = None):
        """reopen: () -> this rank's ServingPart as stored (reset's); names: the dataset's
        id map, when it names its nodes (messages name nodes as the client does, as on one
        process; the nodes updates add are named by the names apply is given)."""
        self.ev, self.part, self.coll = ev, ev.part, ev.coll
        self.version = 0  # batches applied since the part was opened
        self._reopen = reopen
        self.names = names
        self._stored_names = names.mark() if names is not None else None

    def reset(self) -> None:
        """Drop every update applied here: the part as stored again (a server that links to
        ranks which outlived its predecessor replays its log from the start)."""
        if self._reopen is None:
            raise RuntimeError("this rank cannot reopen its part")
        self.part = self.ev.part = self._reopen()
        if self.names is not None:
            self.names.rewind(self._stored_names)
        self.version = 0

    # --- reads of the current graph (collective) ------------------------------------------
    def has_edges(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Whether each (src, dst) edge is present: each source's owner looks in its out-row."""
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        if len(src) == 0:  # the same batch everywhere: every rank skips the collective alike
            return np.zeros(0, dtype=bool)
        found = torch.zeros(len(src), dtype=torch.float64)
        own = np.flatnonzero(self.part.owner_of(src) == self.ev.rank)
        if len(own):
            lens, targets = self.part.out_rows.rows(src[own])
            n = max(self.part.num_nodes, int(dst.max()) + 1)
            present = np.repeat(np.arange(len(own), dtype=np.int64), lens) * n + targets
            want = np.arange(len(own), dtype=np.int64) * n + dst[own]
            found[torch.from_numpy(own)] = torch.from_numpy(np.isin(want, present).astype(np.float64))
        return self.coll.sum(found).numpy() > 0

    def _out_neighbours(self, nodes: np.ndarray) -> np.ndarray:
        return self.coll.union(self.part.local_out(nodes)[1])

    def check(self, batch: UpdateBatch) -> int:
        """UpdateError (on every rank alike) unless the batch applies; the new node count."""
        part = self.part
        return check_batch(batch, part.num_nodes, int(part.features.shape[1]), part.alive, self.has_edges,
                           namer(self.names))

    # --- the update --------------------------------------------------------------------------
    def apply(self, batch: UpdateBatch, names: np.ndarray | None = None) -> dict:
        """Check and apply one batch here, then refresh the embeddings; the report (same on
        every rank): node and edge counts, affected and changed nodes per layer, seconds.
        names: the external ids of the nodes the batch adds, in order (a dataset with names)."""
        t0 = time.perf_counter()
        added_nodes = self.check(batch)
        part, rank = self.part, self.ev.rank
        n0 = part.num_nodes
        if names is not None and len(names) != added_nodes:  # refused alike on every rank, nothing applied
            raise BadRequest(f"a graph-update call to the partition ranks names {len(names)} new nodes but adds "
                             f"{added_nodes}")
        if self.names is not None and names is not None and len(self.names) == n0:  # named as they are added
            self.names.extend(names)
        new_nodes = np.arange(n0, n0 + added_nodes, dtype=np.int64)
        update_ids = np.asarray(batch.update_ids, dtype=np.int64)
        update_feats, add_feats = batch.update_features, batch.add_node_features
        fresh = update_ids >= n0
        if fresh.any():  # a node this batch adds whose features it also updates: the update wins
            add_feats = np.array(add_feats, dtype=np.float32)
            add_feats[update_ids[fresh] - n0] = update_feats[fresh]
            update_ids, update_feats = update_ids[~fresh], update_feats[~fresh]
        removed_nodes = np.asarray(batch.remove_nodes, dtype=np.int64)
        removed = self._removed_edges(batch, removed_nodes, n0 + added_nodes)
        added = np.asarray(batch.add_edges, dtype=np.int64).reshape(-1, 2)
        self._add_nodes(new_nodes, add_feats)
        n = part.num_nodes
        # adjacency: the edges whose source is here
        a_own = added[part.owner_of(added[:, 0]) == rank]
        r_own = removed[part.owner_of(removed[:, 0]) == rank]
        rewrite_rows(part.out_rows, a_own[:, 0], a_own[:, 1], r_own[:, 0], r_own[:, 1], n)
        rewrite_rows(part.in_rows, a_own[:, 1], a_own[:, 0], r_own[:, 1], r_own[:, 0], n)
        # in-degrees and self-loops: kept by the target's owner
        for edges, step in ((removed, -1), (added, 1)):
            mine = edges[part.owner_of(edges[:, 1]) == rank]
            np.add.at(part.in_degree, part.position(mine[:, 1]), step)
            loops = mine[mine[:, 0] == mine[:, 1], 0]
            part.has_loop[part.position(loops)] = step > 0
        part.alive[removed_nodes] = False
        if len(update_ids):
            own = part.owner_of(update_ids) == rank
            part.features[torch.from_numpy(part.position(update_ids[own]))] = torch.from_numpy(
                np.ascontiguousarray(update_feats[own], dtype=np.float32)).to(part.features.dtype)
        apply_s = time.perf_counter() - t0
        touched = unique_ints(np.concatenate([added[:, 1], removed[:, 1], new_nodes]))
        affected, changed = self._refresh(unique_ints(np.concatenate([update_ids, new_nodes])), touched,
                                          new_nodes) if part.layers else ([], [])
        self.version += 1
        # the whole graph's edge count: each edge is counted by its target's owner
        num_edges = int(self.coll.sum(torch.tensor([float(part.in_degree.sum())], dtype=torch.float64)).item())
        return {"num_nodes": n, "num_edges": num_edges, "new_nodes": len(new_nodes), "affected_per_layer": affected,
                "changed_per_layer": changed, "apply_s": apply_s, "propagate_s": time.perf_counter() - t0 - apply_s}

    def _removed_edges(self, batch: UpdateBatch, removed_nodes: np.ndarray, limit: int) -> np.ndarray:
        """The batch's removed edges and every edge of its removed nodes (from all ranks)."""
        part = self.part
        lens_in, srcs = part.local_in(removed_nodes)
        lens_out, dsts = part.local_out(removed_nodes)
        keys = np.concatenate([srcs * limit + np.repeat(removed_nodes, lens_in),
                               np.repeat(removed_nodes, lens_out) * limit + dsts])
        keys = self.coll.union(keys) if len(removed_nodes) else keys
        listed = np.asarray(batch.remove_edges, dtype=np.int64).reshape(-1, 2)
        keys = np.union1d(keys, listed[:, 0] * limit + listed[:, 1])
        return np.stack([keys // limit, keys % limit], axis=1)

    def _add_nodes(self, new_nodes: np.ndarray, features: np.ndarray | None) -> None:
        part = self.part
        if len(new_nodes) == 0:
            return
        n = int(new_nodes[-1]) + 1
        alive = np.ones(max(n, 2 * len(part.alive)), dtype=bool) if n > len(part.alive) else part.alive
        if alive is not part.alive:
            alive[: len(part.alive)] = part.alive
            part.alive = alive
        part.num_nodes = n
        at = np.flatnonzero(part.owner_of(new_nodes) == self.ev.rank)
        if len(at) == 0:
            return
        k = len(part.nodes)
        part.nodes = np.concatenate([part.nodes, new_nodes[at]])
        part.in_degree = np.concatenate([part.in_degree, np.zeros(len(at), dtype=part.in_degree.dtype)])
        part.has_loop = np.concatenate([part.has_loop, np.zeros(len(at), dtype=bool)])
        total = k + len(at)
        part.features = _grown(part.features, total)
        part.features[k:total] = torch.from_numpy(np.ascontiguousarray(features[at], dtype=np.float32))
        part.layers = [_grown(t, total) for t in part.layers]
        part.output = _grown(part.output, total)

    def _refresh(self, changed: np.ndarray, rows_changed: np.ndarray, new_nodes: np.ndarray
                 ) -> tuple[list[int], list[int]]:
        """Recompute layer 1..K for the affected nodes, each layer from the refreshed one
        below; returns (affected, changed) counts per layer."""
        part, ev = self.part, self.ev
        empty = np.empty(0, dtype=np.int64)
        no_features = np.empty((0, 0), dtype=np.float32)
        degree_readers = self._out_neighbours(rows_changed) if ev.gcn else empty
        widths = [int(part.features.shape[1])] + [int(t.shape[1]) for t in part.layers]
        affected_counts, changed_counts = [], []
        touched_own = [empty]
        with torch.inference_mode():
            for layer in range(1, len(part.layers) + 1):
                affected = unique_ints(np.concatenate([changed, self._out_neighbours(changed), rows_changed,
                                                       degree_readers]))
                affected = affected[part.alive[affected]]
                ids, rows = ev.layer(layer, affected, widths[layer - 1], no_features, None, empty, empty)
                table = part.layers[layer - 1]
                pos = torch.from_numpy(part.position(ids))
                differs = (table[pos] != rows.to(table.dtype)).any(dim=1).numpy() | np.isin(ids, new_nodes)
                table[pos] = rows.to(table.dtype)
                touched_own.append(ids[differs])
                changed = self.coll.union(ids[differs])
                affected_counts.append(len(affected))
                changed_counts.append(len(changed))
        if part.output is not None:  # jumping knowledge: the stored output reads every layer
            own = unique_ints(np.concatenate(touched_own))
            if len(own):
                pos = torch.from_numpy(part.position(own))
                with torch.inference_mode():
                    part.output[pos] = ev.model.readout([t[pos].float() for t in part.layers]).to(part.output.dtype)
        return affected_counts, changed_counts
