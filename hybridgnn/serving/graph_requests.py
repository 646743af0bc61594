"""Requests served beside the sampled pipelines, each through its own admission lane:
precomputed lookups, new-node inference (full / pe / srpe / sampled) and graph updates.
The engine admits and releases them (run_in_lane, run_in_thread_lane); this module says
what each one computes and on which graph version."""

from __future__ import annotations

import time

import numpy as np

from hybridgnn.embeddings.newnodes import DynamicGraphView, NewNodeEvaluator
from hybridgnn.embeddings.store import hidden_rows
from hybridgnn.errors import Conflict, Draining, Forbidden
from hybridgnn.types import RequestResult, StageTimings


class GraphRequests:
    """Lookups, new nodes and updates for one engine (its resources, lanes and drain state)."""

    def __init__(self, engine):
        self.engine = engine
        self.cfg = engine.cfg
        r = engine.resources
        self.graph, self.model = r.graph, r.model
        self.embeddings, self.new_nodes, self.dynamic, self.incremental = (r.embeddings, r.new_nodes, r.dynamic,
                                                                           r.incremental)
        self._sampling_only: NewNodeEvaluator | None = None
        self._current_graph_nodes: NewNodeEvaluator | None = None  # new nodes after graph updates

    async def lookup(self, node_ids: np.ndarray, *, with_embeddings: bool = True,
                     waited_s: float = 0.0) -> RequestResult:
        """Answer from the stored final layer: no sampling, constant time per id. The hidden
        rows (`embeddings`) are a second gather, made only when asked for (else 0 columns).
        waited_s: what it already waited in the front end (its lane's admission adds it)."""
        if self.engine.draining:
            raise Draining("server is shutting down", retry_after_s=self.cfg.server.retry_after_s)
        if self.embeddings is None:
            raise Conflict("no precomputed embeddings for this model and dataset; run `hybridgnn precompute`")
        if self.incremental is not None:
            # Off the loop: the lookup waits while an update batch holds the graph's writer lock.
            logits, hidden = await self.engine.run_in_thread_lane(
                "lookup", 1.0, self.incremental.lookup_both, node_ids, with_embeddings, waited_s=waited_s)
        else:
            logits = self.embeddings.lookup(node_ids)
            hidden = (hidden_rows(self.model, self.embeddings.layers, self.graph.features.__getitem__, node_ids)
                      if with_embeddings else np.empty((len(node_ids), 0), np.float32))
        return RequestResult(logits, hidden, logits.argmax(axis=1).astype(np.int64), "precomputed", StageTimings())

    async def new_nodes_infer(self, features: np.ndarray, edge_index: np.ndarray, *, mode: str, gamma: float,
                              policy: str, num_nodes: int | None = None, waited_s: float = 0.0) -> RequestResult:
        """Embeddings of query nodes (full / pe / srpe from PEs, or sampled), computed off the
        event loop. Counted as pending, so a drain waits for it. num_nodes: the graph's size
        when the request was decoded (its query nodes are num_nodes..); after graph updates
        the request is evaluated on the graph and embeddings as they are then. waited_s: what
        it already waited in the front end (its lane's admission adds it)."""
        if self.new_nodes is None and mode != "sampled":
            raise Conflict("new-node requests need precomputed embeddings; run `hybridgnn precompute`")
        t0 = time.perf_counter()
        kw = dict(mode=mode, gamma=gamma, policy=policy, fanouts=self.cfg.sampling.fanouts)
        if self.dynamic is not None and self.dynamic.version > 0:
            res = await self.engine.run_in_thread_lane(
                "new_nodes", 1.0, self._infer_on_current_graph, features, edge_index,
                num_nodes if num_nodes is not None else self.engine.num_nodes, kw, waited_s=waited_s)
        else:
            res = await self.engine.run_in_thread_lane("new_nodes", 1.0, self._new_node_evaluator(mode).infer,
                                                       features, edge_index, waited_s=waited_s, **kw)
        return RequestResult(res.logits, res.embeddings, res.logits.argmax(axis=1).astype(np.int64),
                             f"newnodes_{mode}", StageTimings(compute_s=time.perf_counter() - t0))

    def _infer_on_current_graph(self, features, edge_index, decoded_at: int, kw: dict):
        """A new-node request on the updated graph, under its read lock (one version)."""
        if self.incremental is None:
            raise Conflict("new-node requests after graph updates need precomputed embeddings kept fresh; "
                           "run `hybridgnn precompute` and restart")
        if self._current_graph_nodes is None:
            self._current_graph_nodes = NewNodeEvaluator(self.graph, self.model, self.embeddings,
                                                         view=DynamicGraphView(self.dynamic, self.incremental))
        with self.dynamic.lock.read():
            n = self.dynamic.num_nodes
            if n != decoded_at:  # nodes were added since decoding: query ids move up with them
                edge_index = np.where(edge_index >= decoded_at, edge_index + (n - decoded_at), edge_index)
            existing = edge_index[edge_index < n]
            self.engine.check_alive(np.unique(existing))
            return self._current_graph_nodes.infer(features, edge_index, **kw)

    def _new_node_evaluator(self, mode: str) -> NewNodeEvaluator:
        if self.new_nodes is not None:
            return self.new_nodes
        # `sampled` needs no stored embeddings; an evaluator without them serves only it.
        if self._sampling_only is None:
            self._sampling_only = NewNodeEvaluator(self.graph, self.model, None)
        return self._sampling_only

    async def update_graph(self, req, waited_s: float = 0.0) -> dict:
        """Queue a decoded graph update (after waited_s in the front end, which its lane's
        admission adds); resolves once the graph and embeddings reflect it."""
        if self.dynamic is None:
            raise Forbidden("graph updates are disabled; start the server with --update-token")
        if self.engine.updates is None:
            raise Draining("server is starting")
        if self.engine.draining:
            raise Draining("server is shutting down")
        return await self.engine.run_in_lane("updates", float(max(1, req.num_updates)), self.engine.updates.submit, req,
                                             waited_s=waited_s)
