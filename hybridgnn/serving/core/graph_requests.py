"""Requests served beside the sampled pipelines, each through its own admission lane:
precomputed lookups, new-node inference (full / pe / srpe / sampled) and graph updates.
The engine admits and releases them; this module says what each one computes, on which
graph version, and how its lane learns its cost."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from hybridgnn.capabilities import file_identity
from hybridgnn.embeddings.newnodes import DynamicGraphView, NewNodeEvaluator
from hybridgnn.embeddings.store import hidden_rows
from hybridgnn.errors import Conflict, Draining, Forbidden
from hybridgnn.scheduler.admission import new_node_work
from hybridgnn.types import RequestResult, StageTimings

# Lookups of at most this many ids are answered on the event loop when they can be
# (GraphRequests.lookup_now): tens of microseconds at most, less than the thread hop.
INLINE_LOOKUP_IDS = 256


class GraphRequests:
    """Lookups, new nodes and updates for one engine (its resources, lanes and drain state)."""

    def __init__(self, engine, r):
        """r: the engine's runtime.Resources."""
        self.engine = engine
        self.cfg = engine.cfg
        self.graph, self.model = r.graph, r.model
        self.embeddings, self.new_nodes, self.dynamic, self.incremental = (r.embeddings, r.new_nodes, r.dynamic,
                                                                           r.incremental)
        self._sampling_only: NewNodeEvaluator | None = None
        self._current_graph_nodes: NewNodeEvaluator | None = None  # new nodes after graph updates

    @property
    def num_nodes(self) -> int:
        """Node ids requests may name now (grows with graph updates)."""
        return self.dynamic.num_nodes if self.dynamic is not None else self.graph.num_nodes

    async def run_in_lane(self, lane_name: str, work: float, call, *args, waited_s: float = 0.0, **kwargs):
        return await self.engine.run_in_lane(lane_name, work, call, *args, waited_s=waited_s, **kwargs)

    async def run_in_thread_lane(self, lane_name: str, work: float, fn, *args, waited_s: float = 0.0, **kwargs):
        """Admit `work` on a lane (after waited_s already spent in the front end) and run fn
        off the event loop; the lane learns the time fn took in its thread (service), not
        the wait for the thread or the loop around it."""
        engine = self.engine
        engine.admit(lane_name, work, waited_s)
        lane = engine.lane(lane_name)

        def timed():
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            return out, time.perf_counter() - t0

        try:
            out, seconds = await asyncio.to_thread(timed)
            lane.observe(work, seconds)
            return out
        finally:
            lane.remove(work)
            lane.completed(work, time.perf_counter())
            engine.release()

    def lookup_now(self, node_ids: np.ndarray, *, with_embeddings: bool = True,
                   waited_s: float = 0.0) -> RequestResult | None:
        """lookup()'s answer made in this call, when it can be: a request of at most
        INLINE_LOOKUP_IDS ids while no update batch holds or awaits the graph's writer lock.
        None otherwise (then await lookup()). A few rows cost microseconds; a hop to a
        worker thread and back costs more than the lookup (and an event-loop turn)."""
        if self.engine.draining:
            raise Draining("server is shutting down")
        if self.embeddings is None:
            raise Conflict("no precomputed embeddings for this model and dataset; run `hybridgnn precompute`")
        if len(node_ids) > INLINE_LOOKUP_IDS:
            return None
        if self.incremental is not None:
            # admitted on its lane as the awaited lookup is (its wait in the front end counts)
            engine = self.engine
            engine.admit("lookup", 1.0, waited_s)
            lane = engine.lane("lookup")
            t0 = time.perf_counter()
            try:
                rows = self.incremental.lookup_now(node_ids, with_embeddings)
            finally:
                lane.remove(1.0)
                now = time.perf_counter()
                lane.completed(1.0, now)
                engine.release()
            if rows is None:
                return None
            lane.observe(1.0, now - t0)
            logits, hidden = rows
        else:
            logits, hidden = self._rows(node_ids, with_embeddings)
        return RequestResult(logits, hidden, logits.argmax(axis=1).astype(np.int64), "precomputed", StageTimings())

    def local_lookup_spec(self) -> dict | None:
        """What a front-end process needs to answer this engine's precomputed lookups itself
        (serving/v2/lookups.py), or None when only the engine answers them: no stored
        embeddings, or stored rows that change (graph updates), or ids mapped from external
        names. `hidden` (the `embeddings` output's rows) is absent when they are not stored
        rows (a jumping-knowledge readout, or a one-layer model's features)."""
        store = self.embeddings
        if store is None or self.dynamic is not None or self.incremental is not None or self.graph.id_map is not None:
            return None
        final = getattr(store.final, "filename", None)  # np.load(mmap_mode="r") arrays: a file to map again
        if final is None:
            return None
        hidden = None
        if not self.model.readout_needed and len(store.layers) >= 2:
            hidden = getattr(store.layers[-2], "filename", None)
        server = self.cfg.server
        try:  # which files: a front end maps these very ones, or none (a precompute since rewrote them)
            files = {str(f): file_identity(f) for f in (final, hidden) if f}
        except OSError:
            return None
        return {"version": self.engine.model_version, "final": str(final), "hidden": str(hidden) if hidden else None,
                "files": files,
                "num_nodes": int(self.graph.num_nodes), "feature_dim": self.graph.feature_dim,
                "max_nodes": int(server.max_request_nodes), "default_mode": self.engine.default_mode,
                "default_outputs": list(server.default_outputs) if server.default_outputs is not None else None}

    def _rows(self, node_ids: np.ndarray, with_embeddings: bool) -> tuple[np.ndarray, np.ndarray]:
        logits = self.embeddings.lookup(node_ids)
        hidden = (hidden_rows(self.model, self.embeddings.layers, self.graph.features.__getitem__, node_ids)
                  if with_embeddings else np.empty((len(node_ids), 0), np.float32))
        return logits, hidden

    async def lookup(self, node_ids: np.ndarray, *, with_embeddings: bool = True,
                     waited_s: float = 0.0) -> RequestResult:
        """Answer from the stored final layer: no sampling, constant time per id. The hidden
        rows (`embeddings`) are a second gather, made only when asked for (else 0 columns).
        waited_s: what it already waited in the front end (its lane's admission adds it)."""
        if self.engine.draining:
            raise Draining("server is shutting down")
        if self.embeddings is None:
            raise Conflict("no precomputed embeddings for this model and dataset; run `hybridgnn precompute`")
        if self.incremental is not None:
            # Off the loop: the lookup waits while an update batch holds the graph's writer lock.
            logits, hidden = await self.run_in_thread_lane(
                "lookup", 1.0, self.incremental.lookup_both, node_ids, with_embeddings, waited_s=waited_s)
        else:
            logits, hidden = self._rows(node_ids, with_embeddings)
        return RequestResult(logits, hidden, logits.argmax(axis=1).astype(np.int64), "precomputed", StageTimings())

    async def new_nodes_infer(self, features: np.ndarray, edge_index: np.ndarray, *, mode: str, gamma: float,
                              policy: str, num_nodes: int | None = None, waited_s: float = 0.0) -> RequestResult:
        """Embeddings of query nodes (full / pe / srpe from PEs, or sampled), computed off the
        event loop. Counted as pending, so a drain waits for it. num_nodes: the graph's size
        when the request was decoded (its query nodes are num_nodes..); after graph updates
        the request is evaluated on the graph and embeddings as they are then. waited_s: what
        it already waited in the front end (its lane's admission adds it)."""
        if self.new_nodes is None and mode != "sampled":
            raise Conflict(f"new-node mode {mode!r} needs precomputed embeddings; run `hybridgnn precompute` "
                           "and restart, or send parameters.mode 'sampled'")
        t0 = time.perf_counter()
        kw = dict(mode=mode, gamma=gamma, policy=policy, fanouts=self.cfg.sampling.fanouts)
        work = new_node_work(len(features), edge_index.shape[1])
        if self.dynamic is not None and self.dynamic.version > 0:
            res = await self.run_in_thread_lane(
                "new_nodes", work, self._infer_on_current_graph, features, edge_index,
                num_nodes if num_nodes is not None else self.num_nodes, kw, waited_s=waited_s)
        else:
            res = await self.run_in_thread_lane("new_nodes", work, self._new_node_evaluator().infer,
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

    def _new_node_evaluator(self) -> NewNodeEvaluator:
        if self.new_nodes is not None:
            return self.new_nodes
        # `sampled` needs no stored embeddings; an evaluator without them serves only it.
        if self._sampling_only is None:
            self._sampling_only = NewNodeEvaluator(self.graph, self.model, None)
        return self._sampling_only

    async def update_graph(self, req, applier, waited_s: float = 0.0) -> dict:
        """Queue a decoded graph update (after waited_s in the front end, which its lane's
        admission adds); resolves once the graph and embeddings reflect it."""
        if self.dynamic is None:
            raise Forbidden("graph updates are disabled; start the server with --update-token")
        if applier is None:
            raise Draining("server is starting")
        if self.engine.draining:
            raise Draining("server is shutting down")
        return await self.run_in_lane("updates", float(max(1, req.num_updates)), applier.submit, req,
                                      waited_s=waited_s, learn=False)
