"""Graph updates over HTTP: decoding, and an applier that merges queued requests into
batches and brings the graph and the precomputed embeddings up to date.

Body: KServe v2 style `inputs` (JSON data, or the binary tensor extension with
Inference-Header-Content-Length, as for /infer), any of
    add_edges INT64 [m, 2]  (source, target): target aggregates from source
    remove_edges INT64 [k, 2]
    add_node_features FP32 [a, F]   new nodes, in order
    remove_nodes INT64 [r]
    update_ids INT64 [u] with update_features FP32 [u, F]
Ids -1 .. -a in add_edges / update_ids name this request's new nodes (-1 the first), so a
request never needs to know which ids the server will assign; the answer lists them.

Each request applies entirely or not at all. Queued requests are merged into one batch
(up to max_batch_updates) and applied together; if the merged batch is rejected, each
request is applied alone, so one bad request never takes others down with it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import numpy as np

from hybridgnn.config import UpdateConfig
from hybridgnn.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    PayloadTooLarge,
    UpdateError,
    brief,
)
from hybridgnn.graph.dynamic import UpdateBatch
from hybridgnn.graph.journal import Journal
from hybridgnn.serving.http.codec import decode_inputs, split_body
from hybridgnn.types import ServingStats, UpdateStats
from hybridgnn.updates.log import UpdateLog

log = logging.getLogger("hybridgnn.updates")

MEMORY_KEYS = 100_000  # idempotency keys remembered without a log (bounded: keys come from clients)

# BYTES ids (and add_node_ids) only on a dataset imported with string node ids.
UPDATE_INPUTS = {
    "add_edges": (("INT64", "INT32", "BYTES"), "pairs"),
    "remove_edges": (("INT64", "INT32", "BYTES"), "pairs"),
    "add_node_features": (("FP32",), "matrix"),
    "add_node_ids": (("INT64", "INT32", "BYTES"), "ids"),
    "remove_nodes": (("INT64", "INT32", "BYTES"), "ids"),
    "update_ids": (("INT64", "INT32", "BYTES"), "ids"),
    "update_features": (("FP32",), "matrix"),
}
_ID_INPUTS = ("add_edges", "remove_edges", "remove_nodes", "update_ids")


@dataclass
class UpdateRequest:
    """One client's batch; negative ids are its own new nodes (-1 = first)."""

    add_edges: np.ndarray
    remove_edges: np.ndarray
    add_node_features: np.ndarray
    remove_nodes: np.ndarray
    update_ids: np.ndarray
    update_features: np.ndarray
    received_s: float = 0.0
    # On a dataset with an id map: the external ids of the new nodes (add_node_ids), in
    # order; the other inputs were translated to internal ids (-k for the k-th new node).
    new_external_ids: np.ndarray | None = None
    # A client's Idempotency-Key and the SHA-256 of the body it came with: a retry with the
    # same key gets the first answer again instead of applying twice.
    idempotency_key: str | None = None
    body_sha256: str | None = None

    @property
    def num_new(self) -> int:
        return int(self.add_node_features.shape[0])

    @property
    def num_updates(self) -> int:
        return (len(self.add_edges) + len(self.remove_edges) + self.num_new + len(self.remove_nodes)
                + len(self.update_ids))


def decode_update_request(body: bytes, header_length: str | None, *, feature_dim: int,
                          max_updates: int, id_map=None) -> UpdateRequest:
    """id_map (graph.idmap.IdMap): the dataset names nodes by external ids; the request
    then names every node by one (INT64 or BYTES, as the dataset), new ones included
    (add_node_ids, one per add_node_features row)."""
    header, binary = split_body(body, header_length)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("a graph update needs a non-empty 'inputs' list naming any of "
                         f"{', '.join(UPDATE_INPUTS)}")
    tensors = decode_inputs(inputs, binary, UPDATE_INPUTS, f"a graph update takes any of {', '.join(UPDATE_INPUTS)}")
    new_external = None
    if id_map is not None:
        tensors, new_external = _to_internal_ids(tensors, id_map)
    elif "add_node_ids" in tensors or any(a.dtype.kind == "U" for a in tensors.values()):
        raise BadRequest("this dataset numbers its nodes 0..n-1: name them by INT64 ids; add_node_ids and BYTES "
                         "ids are for datasets imported with an id map (new nodes get the next ids)")
    empty_pairs, empty_ids = np.empty((0, 2), np.int64), np.empty(0, np.int64)
    empty_rows = np.empty((0, feature_dim), np.float32)
    req = UpdateRequest(add_edges=tensors.get("add_edges", empty_pairs),
                        remove_edges=tensors.get("remove_edges", empty_pairs),
                        add_node_features=tensors.get("add_node_features", empty_rows),
                        remove_nodes=tensors.get("remove_nodes", empty_ids),
                        update_ids=tensors.get("update_ids", empty_ids),
                        update_features=tensors.get("update_features", empty_rows),
                        received_s=time.monotonic(), new_external_ids=new_external)
    for name in ("add_node_features", "update_features"):
        got = getattr(req, name)
        if got.shape[1] != feature_dim:
            raise BadRequest(f"{name} must be [count, {feature_dim}] (the graph's feature width), "
                             f"got {list(got.shape)}")
        if not np.isfinite(got).all():
            raise BadRequest(f"{name} holds NaN or infinite values")
    if len(req.update_ids) != len(req.update_features):
        raise BadRequest(f"update_ids names {len(req.update_ids)} nodes but update_features has "
                         f"{len(req.update_features)} rows")
    for name in ("add_edges", "update_ids"):  # own new nodes: -1 .. -num_new
        arr = getattr(req, name)
        if len(arr) and (arr < -req.num_new).any():
            raise BadRequest(f"{name}: negative ids name this request's new nodes (-1 .. -{req.num_new}); "
                             f"found {int(arr.min())}")
    for name in ("remove_edges", "remove_nodes"):
        if len(getattr(req, name)) and (getattr(req, name) < 0).any():
            raise BadRequest(f"{name}: ids must be >= 0")
    if req.num_updates == 0:
        raise BadRequest("the update is empty")
    if req.num_updates > max_updates:
        raise PayloadTooLarge(f"{req.num_updates} updates in one request; the limit is {max_updates}")
    return req


def _to_internal_ids(tensors: dict[str, np.ndarray], id_map) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every node named by its external id → internal ids; this request's new nodes (by
    their add_node_ids) → -1, -2, ... as on a dataset without a map. A node that is
    neither known nor new is a 400 naming it."""
    want = "BYTES (node names)" if id_map.kind == "string" else "INT64 (the dataset's own integer ids)"
    for name, arr in tensors.items():
        if name in (*_ID_INPUTS, "add_node_ids") and not id_map.same_kind(arr):
            raise BadRequest(f"{name} must be {want} on this dataset")
    new = tensors.pop("add_node_ids", None)
    rows = tensors.get("add_node_features")
    if (0 if new is None else len(new)) != (0 if rows is None else len(rows)):
        raise BadRequest(f"add_node_ids names {0 if new is None else len(new)} nodes but add_node_features has "
                         f"{0 if rows is None else len(rows)} rows: on this dataset each new node needs its id")
    new = np.asarray(new if new is not None else np.empty(0, np.str_ if id_map.kind == "string" else np.int64))
    if len(np.unique(new)) != len(new):
        raise BadRequest("add_node_ids names a node twice")
    _, exists = id_map.to_internal(new)
    if exists.any():
        raise BadRequest(f"node {brief(new[np.flatnonzero(exists)[0]].item())} already exists")
    order = np.argsort(new, kind="stable")
    out = dict(tensors)
    for name in _ID_INPUTS:
        if name not in tensors:
            continue
        ext = tensors[name]
        internal, known = id_map.to_internal(ext)
        if not known.all() and name in ("add_edges", "update_ids") and len(new):
            pos = np.minimum(np.searchsorted(new[order], ext), len(new) - 1)
            is_new = ~known & (new[order][pos] == ext)
            internal = np.where(is_new, -(order[pos] + 1), internal)
            known = known | is_new
        if not known.all():
            raise BadRequest(f"{name}: unknown node {brief(ext[~known].flat[0].item())}")
        out[name] = internal.astype(np.int64)
    return out, new


def to_batch(requests: list[UpdateRequest], num_nodes: int) -> tuple[UpdateBatch, list[np.ndarray]]:
    """Merge requests into one UpdateBatch against a graph of num_nodes nodes; also returns
    each request's assigned new-node ids."""
    parts = {k: [] for k in ("add", "rm", "feat", "rmn", "uid", "uf")}
    assigned, next_id = [], num_nodes
    for r in requests:
        own = np.arange(next_id, next_id + r.num_new, dtype=np.int64)
        assigned.append(own)

        def resolve(ids: np.ndarray, own=own) -> np.ndarray:
            ids = ids.astype(np.int64, copy=True)
            neg = ids < 0
            ids[neg] = own[-ids[neg] - 1]
            return ids

        next_id += r.num_new
        parts["add"].append(resolve(r.add_edges))
        parts["rm"].append(r.remove_edges.astype(np.int64))
        parts["feat"].append(r.add_node_features)
        parts["rmn"].append(r.remove_nodes.astype(np.int64))
        parts["uid"].append(resolve(r.update_ids))
        parts["uf"].append(r.update_features)
    feats = np.concatenate(parts["feat"]).astype(np.float32)
    uf = np.concatenate(parts["uf"]).astype(np.float32)
    batch = UpdateBatch(add_edges=np.concatenate(parts["add"]).reshape(-1, 2),
                        remove_edges=np.concatenate(parts["rm"]).reshape(-1, 2),
                        add_node_features=feats if len(feats) else None,
                        remove_nodes=np.concatenate(parts["rmn"]),
                        update_ids=np.concatenate(parts["uid"]), update_features=uf if len(uf) else None)
    return batch, assigned


@dataclass
class _Pending:
    request: UpdateRequest
    future: asyncio.Future


class UpdateApplier:
    """Serialises updates: a single task drains the queue, merging requests into batches,
    and applies each batch on a worker thread (the event loop keeps serving)."""

    def __init__(self, cfg: UpdateConfig, incremental, graph, stats: ServingStats, update_log: UpdateLog | None = None):
        self.cfg = cfg
        self.incremental = incremental  # IncrementalEmbeddings, or None (graph only)
        self.graph = graph  # DynamicGraph
        self.stats = stats
        self.update_log = update_log  # None: updates live in memory only (--update-log off)
        self._queue: list[_Pending] = []
        self._wake = asyncio.Event()
        # Idempotency keys: in flight (key -> (body sha256, future)), and, without a log,
        # answered ones kept in memory (the most recent MEMORY_KEYS).
        self._inflight: dict[str, tuple[str, asyncio.Future]] = {}
        self._answered: collections.OrderedDict[str, tuple[str, dict]] = collections.OrderedDict()
        self._task: asyncio.Task | None = None
        self._compacting: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="graph-updates")

    async def stop(self) -> None:
        for t in (self._task, self._compacting):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def staleness_s(self) -> float:
        """Age of the oldest update accepted but not yet visible (0 when none waits)."""
        return time.monotonic() - self._queue[0].request.received_s if self._queue else 0.0

    def submit(self, req: UpdateRequest) -> asyncio.Future:
        """Queue an update; its future resolves to the answer. A request whose idempotency
        key was seen gets that request's answer (marked "replayed") and applies nothing."""
        loop = asyncio.get_running_loop()
        key = req.idempotency_key
        if key is not None:
            seen = self._answer_for(key)
            if seen is not None or key in self._inflight:
                digest = seen[0] if seen is not None else self._inflight[key][0]
                if digest != req.body_sha256:
                    raise Conflict(f"Idempotency-Key {key!r} was used with a different update; use a new key "
                                   "for a new update")
                if seen is None:
                    return self._inflight[key][1]
                fut = loop.create_future()
                fut.set_result({**seen[1], "replayed": True})
                return fut
        fut = loop.create_future()
        self._queue.append(_Pending(req, fut))
        if key is not None:
            self._inflight[key] = (req.body_sha256, fut)
            fut.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))
        self._wake.set()
        return fut

    def _answer_for(self, key: str) -> tuple[str, dict] | None:
        if self.update_log is not None:
            return self.update_log.answer_for(key)
        return self._answered.get(key)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                take, total = [], 0
                while self._queue and (not take or total + self._queue[0].request.num_updates
                                       <= self.cfg.max_batch_updates):
                    p = self._queue.pop(0)
                    take.append(p)
                    total += p.request.num_updates
                await self._apply_group(take)
                self._maybe_compact()

    async def _apply_group(self, group: list[_Pending]) -> None:
        try:
            results = await asyncio.to_thread(self._apply, [p.request for p in group])
            for p, res in zip(group, results, strict=True):
                if not p.future.done():
                    p.future.set_result(res)
        except UpdateError as exc:
            if len(group) == 1:
                self.stats.updates_rejected()
                if not group[0].future.done():
                    group[0].future.set_exception(exc)
                return
            for p in group:  # one of them is bad: apply each alone, entirely or not at all
                await self._apply_group([p])
        except Exception as exc:
            log.exception("graph update failed")
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)

    def _apply(self, requests: list[UpdateRequest]) -> list[dict]:
        with self.graph.lock.read():
            n = self.graph.num_nodes
        batch, assigned = to_batch(requests, n)
        new_external = self._new_external_ids(requests)
        t0 = time.perf_counter()
        made: list[list[dict]] = []  # the answers, made once: in the commit when keys go to the log

        def keyed_answers(position: int) -> list[tuple[str, str, dict]]:
            made.append(self._answers(requests, assigned, batch, position))
            return [(r.idempotency_key, r.body_sha256, a) for r, a in zip(requests, made[0], strict=True)
                    if r.idempotency_key is not None]

        keyed = any(r.idempotency_key is not None for r in requests)
        position, affected, propagate_s = self._apply_batch(batch, n, new_external,
                                                            durable=self.update_log is not None,
                                                            keyed_answers=keyed_answers if keyed else None)
        counts = {"add_edges": len(batch.add_edges), "remove_edges": len(batch.remove_edges),
                  "add_nodes": sum(len(a) for a in assigned), "remove_nodes": len(batch.remove_nodes),
                  "update_features": len(batch.update_ids)}
        self.stats.updates_applied(UpdateStats(time.perf_counter() - t0, propagate_s, affected, counts))
        answers = [dict(a) for a in made[0]] if made else self._answers(requests, assigned, batch, position)
        for r, answer in zip(requests, answers, strict=True):
            answer["affected_nodes"] = affected
            if r.idempotency_key is not None and self.update_log is None:
                self._answered[r.idempotency_key] = (r.body_sha256, dict(answer))
                while len(self._answered) > MEMORY_KEYS:
                    self._answered.popitem(last=False)
        return answers

    def _answers(self, requests: list[UpdateRequest], assigned: list[np.ndarray], batch: UpdateBatch,
                 position: int | None) -> list[dict]:
        """Each request's answer once its batch is applied (the graph version is the new one)."""
        id_map = self.graph.base.id_map
        if id_map is not None:  # answer in the client's own ids
            assigned = [id_map.to_external(ids) for ids in assigned]
        return [{"graph_version": self.graph.version, "log_position": position, "new_node_ids": ids.tolist(),
                 "updates": r.num_updates, "batch_updates": batch.num_updates}
                for r, ids in zip(requests, assigned, strict=True)]

    def _new_external_ids(self, requests: list[UpdateRequest]) -> np.ndarray | None:
        """The new nodes' external ids in assignment order; UpdateError if two requests of
        the batch, or one applied since they were decoded, claim the same id."""
        id_map = self.graph.base.id_map
        if id_map is None:
            return None
        new = np.concatenate([r.new_external_ids for r in requests if r.new_external_ids is not None] or
                             [np.empty(0, np.int64)])
        if len(np.unique(new)) != len(new) or (len(new) and id_map.to_internal(new)[1].any()):
            raise UpdateError("update rejected, nothing applied: a node in add_node_ids already exists")
        return new

    def _apply_batch(self, batch: UpdateBatch, base_nodes: int, new_external: np.ndarray | None = None, *,
                     durable: bool, keyed_answers=None) -> tuple[int | None, int, float | None]:
        """Apply one batch all or nothing; with durable, its log append is the last step
        under the writer lock (a failed append rolls the batch back), then the id map
        names the new nodes. Returns (log position or None, affected embedding rows,
        propagation seconds or None)."""
        position: list[int] = []
        id_map = self.graph.base.id_map

        def commit() -> None:
            if durable:
                position.append(self.update_log.append(batch, base_nodes, new_external, keyed_answers))
            if id_map is not None and new_external is not None:
                id_map.extend(new_external)

        if self.incremental is not None:
            report = self.incremental.apply(batch, commit)
            return (position[0] if position else None), report.affected_nodes, report.propagate_s
        journal = Journal()
        with self.graph.lock.write():
            try:
                self.graph.apply(batch, journal)
                commit()
            except BaseException:
                journal.rollback()
                raise
        return (position[0] if position else None), 0, None

    def replay(self) -> int:
        """Re-apply every logged batch over the stored dataset (at start, before serving);
        returns how many. A batch that does not land where it landed live means the log
        belongs to other data: refused, not served approximately."""
        if self.update_log is None:
            return 0
        total, t0, done = len(self.update_log), time.perf_counter(), 0
        if total:
            log.info("replaying %d logged update batches from %s", total, self.update_log.path)
        for position, batch, base_nodes, new_external in self.update_log.entries():
            with self.graph.lock.read():
                n = self.graph.num_nodes
            if n != base_nodes:
                raise ConfigError(f"update log {self.update_log.path} position {position} was applied to a graph of "
                                  f"{base_nodes} nodes, but replay reached it with {n}")
            try:
                self._apply_batch(batch, base_nodes, new_external if len(new_external) else None, durable=False)
            except UpdateError as exc:
                raise ConfigError(f"update log {self.update_log.path} position {position} does not apply to this "
                                  f"dataset: {exc}") from exc
            done += 1
            if done % 1000 == 0:
                log.info("replayed %d of %d update batches", done, total)
        if total:
            log.info("replayed %d update batches in %.2fs: graph version %d, %d nodes", total,
                     time.perf_counter() - t0, self.graph.version, self.graph.num_nodes)
        return total

    def _maybe_compact(self) -> None:
        if self.graph.patched_entries < self.cfg.compact_patched_entries:
            return
        if self._compacting is not None and not self._compacting.done():
            return

        async def compact() -> None:
            t0 = time.perf_counter()
            done = await asyncio.to_thread(self.graph.compact)
            if done:
                self.stats.compacted()
                log.info("compacted the graph's patches in %.2fs", time.perf_counter() - t0)

        self._compacting = asyncio.create_task(compact(), name="graph-compaction")
