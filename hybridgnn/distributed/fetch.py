"""The baseline computation graph parallelism is measured against: rank 0 builds and runs
the whole computation graph itself, fetching every edge list, degree and row it reads
from the ranks that hold them (what a single machine over a partitioned graph does, DGL's
distributed serving). It runs the single-process evaluator on a view whose every read is
a round trip; the other ranks answer in `serve_fetches` until rank 0 says it is done.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridgnn.distributed.collectives import Collectives, broadcast
from hybridgnn.distributed.serving_part import ServingPart
from hybridgnn.embeddings.newnodes import NewNodeEvaluator

DONE, IN_ROWS, OUT_ROWS, IN_DEGREE, HAS_LOOP, ROWS = range(6)


class FetchingView:
    """NewNodeEvaluator's view of a partitioned graph, read from rank 0 by round trips."""

    graph = None  # no stored graph here: every read, mode `sampled`'s in-rows too, is fetched

    def __init__(self, part: ServingPart, coll: Collectives, num_layers: int):
        self.part, self.coll = part, coll
        self.layers = tuple(range(1, num_layers + 1))  # what the evaluator counts as the store's layers

    @property
    def num_nodes(self) -> int:
        return self.part.num_nodes

    def _ask(self, op: int, ids: np.ndarray, layer: int = 0):
        broadcast(torch.tensor([op, layer, len(ids)], dtype=torch.int64))
        broadcast(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))
        self.coll.bytes_sent += 24 * (self.coll.world - 1) + len(ids) * 8 * (self.coll.world - 1)
        return answer(self.part, self.coll, op, layer, np.asarray(ids, dtype=np.int64))

    def in_rows(self, nodes):
        return self._edges(IN_ROWS, nodes)

    def out_rows(self, nodes):
        return self._edges(OUT_ROWS, nodes)

    def _edges(self, op, nodes):
        idx, vals = self._ask(op, nodes)
        order = np.argsort(idx.numpy(), kind="stable")
        return np.bincount(idx.numpy(), minlength=len(nodes)), vals[:, 0].numpy()[order]

    def in_degree(self, nodes):
        idx, vals = self._ask(IN_DEGREE, nodes)
        out = np.zeros(len(nodes), dtype=np.int64)
        out[idx.numpy()] = vals[:, 0].numpy()
        return out

    def has_loop(self, nodes):
        idx, vals = self._ask(HAS_LOOP, nodes)
        out = np.zeros(len(nodes), dtype=bool)
        out[idx.numpy()] = vals[:, 0].numpy() > 0
        return out

    def rows(self, layer: int, nodes: np.ndarray) -> torch.Tensor:
        idx, vals = self._ask(ROWS, nodes, layer)
        out = torch.empty((len(nodes), vals.shape[1]), dtype=torch.float32)
        out[idx] = vals
        return out

    def done(self) -> None:
        broadcast(torch.tensor([DONE, 0, 0], dtype=torch.int64))


def answer(part: ServingPart, coll: Collectives, op: int, layer: int, ids: np.ndarray):
    """Every rank's share of one read, sent to rank 0: (positions in ids, values)."""
    if op in (IN_ROWS, OUT_ROWS):
        lens, vals = part.local_in(ids) if op == IN_ROWS else part.local_out(ids)
        idx, rows, dtype = np.repeat(np.arange(len(ids)), lens), torch.from_numpy(vals).view(-1, 1), torch.int64
    else:
        own = np.flatnonzero(part.owner_of(ids) == coll.rank)
        pos = part.position(ids[own])
        idx, dtype = own, torch.float32
        if op == IN_DEGREE:
            rows, dtype = torch.from_numpy(part.in_degree[pos]).view(-1, 1), torch.int64
        elif op == HAS_LOOP:
            rows, dtype = torch.from_numpy(part.has_loop[pos].astype(np.int64)).view(-1, 1), torch.int64
        else:
            rows = part.rows(layer, ids[own])
    width = 1 if op != ROWS else (part.features.shape[1] if layer == 0 else part.layers[layer - 1].shape[1])
    empty = (torch.empty(0, dtype=torch.int64), torch.empty((0, width), dtype=dtype))
    outgoing = [empty] * coll.world
    outgoing[0] = (torch.from_numpy(np.asarray(idx, dtype=np.int64)), rows.to(dtype).reshape(-1, width))
    return coll.all_to_all(outgoing, width, dtype)


def serve_fetches(part: ServingPart, coll: Collectives) -> None:
    """Ranks other than 0: answer rank 0's reads until it is done with the request."""
    while True:
        op, layer, count = (int(v) for v in broadcast(torch.empty(3, dtype=torch.int64)))
        if op == DONE:
            return
        answer(part, coll, op, layer, broadcast(torch.empty(count, dtype=torch.int64)).numpy())


def fetch_and_infer(part: ServingPart, model, coll: Collectives, features, edge_index, **kw):
    """Rank 0: a new-node request computed here from fetched data (the evaluator's own
    code); other ranks: serve the fetches. Returns (NewNodeResult or None, bytes all ranks
    sent)."""
    coll.bytes_sent = 0
    if coll.rank == 0:
        view = FetchingView(part, coll, len(model.convs))
        try:
            result = NewNodeEvaluator(None, model, view, view=view).infer(features, edge_index, **kw)
        finally:
            view.done()
    else:
        serve_fetches(part, coll)
        result = None
    moved = int(coll.sum(torch.tensor([float(coll.bytes_sent)], dtype=torch.float64)).item())
    return result, moved
