"""A partitioned engine over one real partition rank run in this process (the rank's own
call loop, rank_server.run, on a one-rank collective stand-in): a request checked at
decode whose node a graph update removed before the ranks served it is a 404, as on one
process, the other requests of its batch answered as before; the graph's description
follows the updates."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from hybridgnn.config import PartitionConfig, SamplingConfig, ServeConfig, UpdateConfig
from hybridgnn.distributed import rank_server
from hybridgnn.distributed.cgp import PartitionedEvaluator
from hybridgnn.distributed.part_updates import PartUpdater
from hybridgnn.distributed.partition import compute_partition
from hybridgnn.distributed.serving_part import open_serving_part
from hybridgnn.embeddings.store import EmbeddingStore
from hybridgnn.errors import RemovedNode, ServiceUnavailable, ServingError, UpdateError
from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch
from hybridgnn.graph.idmap import IdMap
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import load_checkpoint
from hybridgnn.serving.core.partitioned import PartitionedEngine
from hybridgnn.serving.core.updates import PendingUpdate
from hybridgnn.serving.ipc import ranks as wire
from hybridgnn.updates.requests import LoggedRequest


class OneRankCollectives:
    """Collectives of a group of one: everything stays here."""

    rank, world, bytes_sent, device = 0, 1, 0, None

    def counts(self, mine):
        return np.asarray(mine, dtype=np.int64).reshape(1, -1)

    def all_to_all(self, outgoing, width, dtype=torch.float32):
        idx, rows = outgoing[0]
        return idx, rows.to(dtype).reshape(-1, width)

    def gather(self, mine):
        return np.asarray(mine, dtype=np.int64)

    def union(self, mine):
        return np.unique(np.asarray(mine, dtype=np.int64).reshape(-1))

    def sum(self, values):
        return values.clone()


class OneRank:
    """types.PartitionRanks over one rank in this process, served by the rank's own loop
    (rank_server.run); a closed gate holds a call before the rank takes it."""

    world, restarts, why_down = 1, 0, ""

    def __init__(self, dataset, model_dir):
        graph = GraphStore.open(dataset)
        model = load_checkpoint(model_dir)[0]
        store = EmbeddingStore.open(model_dir, graph.fingerprint)
        partition = compute_partition(graph, "ranges", 1, None)

        def stored():
            return open_serving_part(graph, partition, 0, store.layers, store.output)

        self.ev = PartitionedEvaluator(stored(), model, OneRankCollectives())
        self.ev.updater = PartUpdater(self.ev, reopen=stored, names=graph.id_map)  # as open_rank makes it
        self.info = {"ranks": 1, "partition": "ranges", "precomputed": True, "memory_bytes": [1]}
        self.up, self.generation, self.prepare = False, 0, None
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()
        self._lock = threading.Lock()

    def start(self) -> dict:
        self.generation += 1
        if self.prepare is not None:
            self.prepare(self._call, {**self.info, "updates_applied": 0, "generation": self.generation})
        self.up = True
        return self.info

    def stalled_s(self) -> float:
        return 0.0

    def call(self, name, head, arrays, *, generation=None):
        if not self.up or (generation is not None and generation != self.generation):
            raise ServiceUnavailable("down", retry_after_s=1.0)
        if name != "update":
            self.waiting.set()
            self.gate.wait(10)
        return self._call(name, head, arrays)

    def _call(self, name, head, arrays):
        with self._lock:  # one call at a time, as on the link to rank 0
            frame = rank_server.run(self.ev, wire.CALLS[name], memoryview(wire.encode(0, 0, head, arrays))[9:])
        kind = frame[4]
        out, rows = wire.decode(memoryview(frame)[9:])
        if kind == wire.ERROR:
            raise ServingError(str(out["message"]), status=int(out["status"]))
        return out, rows

    def close(self) -> None:
        self.up = False


def _update(**inputs) -> PendingUpdate:
    logged = LoggedRequest({k: np.asarray(v) for k, v in inputs.items()})
    return PendingUpdate(logged, logged.num_updates)


def _remove(*nodes) -> PendingUpdate:
    return _update(remove_nodes=np.asarray(nodes, dtype=np.int64))


def _run(scenario, dataset, model_dir):
    async def main():
        ranks = OneRank(dataset, model_dir)
        cfg = ServeConfig(dataset_dir=dataset, model_dir=model_dir, sampling=SamplingConfig((5, 3)),
                          partitions=PartitionConfig(partitions=1), updates=UpdateConfig(token="12345678", log="off"))
        engine = PartitionedEngine(cfg, ranks)
        await engine.start()
        try:
            return await scenario(engine, ranks)
        finally:
            await engine.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["lookup", "full"])
def test_a_request_whose_node_was_removed_before_the_ranks_served_it_is_a_404(tiny_dataset, tiny_model_pe, kind):
    async def scenario(engine, ranks):
        ask = engine.lookup if kind == "lookup" else engine.full
        want = (await ask(np.array([3]))).logits
        engine.check_alive(np.array([7, 3]))  # decoded while node 7 is alive
        ranks.gate.clear()  # the ranks are busy: the requests wait for them
        busy = asyncio.ensure_future(ask(np.array([1])))
        assert await asyncio.to_thread(ranks.waiting.wait, 10)
        queued = [asyncio.ensure_future(ask(np.array(ids))) for ids in ([7, 3], [3])]  # one batch, later
        await asyncio.sleep(0.05)
        out = await engine.update_graph(_remove(7))  # applied before the ranks serve them
        assert out["graph_version"] == 1
        ranks.gate.set()
        await busy
        removed, kept = await asyncio.gather(*queued, return_exceptions=True)
        return want, removed, kept

    want, removed, kept = _run(scenario, tiny_dataset, tiny_model_pe)
    assert isinstance(removed, RemovedNode) and str(removed) == "node 7 was removed from the graph", removed
    assert not isinstance(kept, BaseException), kept
    np.testing.assert_allclose(kept.logits, want, atol=1e-6)


def test_a_new_node_request_with_an_edge_to_a_removed_node_is_a_404(tiny_dataset, tiny_model_pe):
    async def scenario(engine, ranks):
        n, f = engine.num_nodes, engine.graph.feature_dim
        await engine.update_graph(_remove(7))
        outcomes = []
        for mode in ("pe", "full", "sampled"):
            try:
                await engine.new_nodes(np.ones((1, f), np.float32), np.array([[n, n], [7, 3]]), mode=mode, gamma=0.1,
                                       policy="ratio", num_nodes=n)
                outcomes.append(None)
            except ServingError as exc:
                outcomes.append(exc)
        await engine.new_nodes(np.ones((1, f), np.float32), np.array([[n], [3]]), mode="pe", gamma=0.1,
                               policy="ratio", num_nodes=n)  # no removed node named: served
        return outcomes

    for exc in _run(scenario, tiny_dataset, tiny_model_pe):
        assert isinstance(exc, ServingError) and exc.status == 404 and "node 7 was removed" in str(exc), exc


def test_metadata_counts_the_edges_of_the_graph_the_ranks_serve(tiny_dataset, tiny_model_pe):
    graph = GraphStore.open(tiny_dataset)
    n, f = graph.num_nodes, graph.feature_dim
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    present = [int(indices[indptr[10]]), 10]
    batches = [dict(add_node_features=np.ones((2, f), np.float32), add_edges=np.array([[n, 3], [4, n + 1], [n, n]])),
               dict(remove_nodes=np.array([7]), remove_edges=np.array([present]))]
    one_process = DynamicGraph(graph)
    for b in batches:
        one_process.apply(UpdateBatch(**b))

    async def scenario(engine, ranks):
        counts = [engine.metadata()["num_edges"]]
        for b in batches:
            await engine.update_graph(_update(**b))
            counts.append(engine.metadata()["num_edges"])
        return counts

    stored, added, now = _run(scenario, tiny_dataset, tiny_model_pe)
    assert (stored, added) == (graph.num_edges, graph.num_edges + 3)
    assert now == one_process.num_edges < added


def test_a_call_the_ranks_cannot_take_is_a_400_on_every_rank_and_the_next_is_served(tiny_dataset, tiny_model_pe):
    """Another build's call, or bytes that are not the engine's (a TCP rank 0 is reachable
    by anyone on its network), would raise in the middle of every rank's loop: the ranks
    exited and the group was down until restarted."""
    ranks = OneRank(tiny_dataset, tiny_model_pe)
    n, f = ranks.ev.part.num_nodes, ranks.ev.part.features.shape[1]
    feats, edges = np.ones((1, f), np.float32), np.array([[n], [3]])
    new = {"mode": "pe", "gamma": 0.1, "policy": "ratio", "num_nodes": n}
    broken = [(42, b""),  # an unknown kind: its payload is no frame at all
              (42, wire.encode(0, 0, {}, ())[9:]),
              (wire.EXISTING, b"\x00\x00\x00\x07{\"a\":1}"),  # truncated
              (wire.EXISTING, wire.encode(0, 0, {}, ())[9:]),
              (wire.EXISTING, wire.encode(0, 0, {}, (np.array([n + 5]),))[9:]),
              (wire.EXISTING, wire.encode(0, 0, {}, (np.array([[1, 2]]),))[9:]),
              (wire.LOOKUP, wire.encode(0, 0, {}, (np.array([1]),))[9:]),
              (wire.NEW_NODES, wire.encode(0, 0, {**new, "mode": "nope"}, (feats, edges))[9:]),
              (wire.NEW_NODES, wire.encode(0, 0, {**new, "gamma": "x"}, (feats, edges))[9:]),
              (wire.NEW_NODES, wire.encode(0, 0, {**new, "mode": "sampled"}, (feats, edges))[9:]),
              (wire.NEW_NODES, wire.encode(0, 0, new, (np.ones((1, f + 1), np.float32), edges))[9:]),
              (wire.NEW_NODES, wire.encode(0, 0, new, (feats, np.array([[n + 1], [3]])))[9:]),
              (wire.NEW_NODES, wire.encode(0, 0, new, (feats,))[9:]),
              (wire.UPDATE, wire.encode(0, 0, {}, (np.array([1.5]),))[9:]),
              (wire.UPDATE, wire.encode(0, 0, {}, UpdateBatch().arrays(f) + (np.array([1.5]),))[9:]),
              (wire.UPDATE, wire.encode(0, 0, {}, UpdateBatch().arrays(f) + (np.array(["a", "b"]),))[9:])]
    for kind, payload in broken:
        frame = rank_server.run(ranks.ev, kind, memoryview(payload), 9)
        assert frame[4] == wire.ERROR and int.from_bytes(frame[5:9], "little") == 9, (kind, payload)
        out, _ = wire.decode(memoryview(frame)[9:])
        assert out["status"] == 400 and "partition ranks" in out["message"], out
    out, rows = ranks._call("new_nodes", new, (feats, edges))
    assert rows[0].shape == (1, ranks.ev.model.out_dim)
    assert len(ranks._call("existing", {}, (np.array([1, 2]),))[1][0]) == 2


def test_on_a_dataset_with_names_the_ranks_errors_name_nodes_as_the_client_does(tiny_dataset, tiny_model_pe,
                                                                                 tmp_path):
    """The ranks' update checks and their removed-node 404 named internal row ids the client
    never saw ("add_edges names unknown node 7", "edge [12, 3] is not in the graph") where
    one process names 'n0007' and ['n0012', 'n0003'], nodes added by updates included."""
    import shutil

    named = tmp_path / "named"
    shutil.copytree(tiny_dataset, named)
    graph = GraphStore.open(named)
    n, f = graph.num_nodes, graph.feature_dim
    IdMap(np.array([f"n{i:04d}" for i in range(n)])).save(named)
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    row = set(indices[indptr[3]:indptr[4]].tolist())
    absent = next(i for i in range(8, n) if i not in row)  # no edge absent -> 3
    present = int(indices[indptr[10]])  # an edge present -> 10

    def name(i):
        return f"n{i:04d}"

    async def refused(engine, **inputs) -> str:
        with pytest.raises(UpdateError) as caught:
            await engine.update_graph(_update(**inputs))
        return caught.value.message

    async def scenario(engine, ranks):
        messages = []
        await engine.update_graph(_update(remove_nodes=np.array([name(7)])))
        messages.append(await refused(engine, add_edges=np.array([[name(7), name(3)]])))
        messages.append(await refused(engine, remove_edges=np.array([[name(absent), name(3)]])))
        messages.append(await refused(engine, add_edges=np.array([[name(present), name(10)]])))
        out = await engine.update_graph(_update(add_node_ids=np.array(["zed"]),
                                                add_node_features=np.ones((1, f), np.float32)))
        assert out["new_node_ids"] == ["zed"]
        await engine.update_graph(_update(remove_nodes=np.array(["zed"])))
        messages.append(await refused(engine, update_ids=np.array(["zed"]), update_features=np.ones((1, f), np.float32)))
        with pytest.raises(ServingError) as caught:  # the ranks find it (an update removed it after decode)
            await engine.new_nodes(np.ones((1, f), np.float32), np.array([[n + 1], [7]]), mode="pe", gamma=0.1,
                                   policy="ratio", num_nodes=n + 1)
        assert caught.value.status == 404
        messages.append(caught.value.message)
        names = ranks.ev.updater.names
        assert len(names) == n + 1
        ranks.ev.updater.reset()  # the part as stored: the names too
        assert len(names) == n and not names.to_internal(np.array(["zed"]))[1].any()
        return messages

    messages = _run(scenario, named, tiny_model_pe)
    prefix = "update rejected, nothing applied: "
    assert messages == [prefix + f"add_edges names node '{name(7)}', which an update removed from the graph",
                        prefix + f"remove_edges: edge ['{name(absent)}', '{name(3)}'] is not in the graph",
                        prefix + f"add_edges: edge ['{name(present)}', '{name(10)}'] is already in the graph "
                                 "(duplicate edges are not allowed)",
                        prefix + "update_features names node 'zed', which an update removed from the graph",
                        f"node '{name(7)}' was removed from the graph"], messages


@pytest.mark.parametrize("kind", ["string", "int64"])
def test_an_update_call_whose_names_do_not_fit_is_refused_on_every_rank_with_nothing_applied(
        tiny_dataset, tiny_model_pe, tmp_path, kind):
    """The names of an UPDATE call's new nodes (its 7th array) that are not the dataset's
    kind, or not one per new node, are refused (400) before anything applies: integers on
    a dataset named by strings were taken as the strings '5'..., and strings on one named by
    sparse integers raised ValueError in the id map, so every rank exited and the group
    restarted (and would again at every replay)."""
    import shutil

    named = tmp_path / "named"
    shutil.copytree(tiny_dataset, named)
    n, f = GraphStore.open(named).num_nodes, GraphStore.open(named).feature_dim
    ids = np.array([f"n{i:04d}" for i in range(n)]) if kind == "string" else np.arange(n, dtype=np.int64) * 10 + 7
    IdMap(ids).save(named)
    ranks = OneRank(named, tiny_model_pe)
    names = ranks.ev.updater.names
    batch = UpdateBatch(add_edges=np.array([[n, 3]]), add_node_features=np.ones((1, f), np.float32))
    right = np.array(["zed"]) if kind == "string" else np.array([5], dtype=np.int64)
    wrong_kind = np.array([5], dtype=np.int64) if kind == "string" else np.array(["zed"])
    for bad in (wrong_kind, np.concatenate([right, right + right])):
        with pytest.raises(ServingError) as caught:
            ranks._call("update", {"check_only": False}, batch.arrays(f) + (bad,))
        assert caught.value.status == 400, caught.value.message
        assert ranks.ev.part.num_nodes == n and len(names) == n and ranks.ev.updater.version == 0
    out, _ = ranks._call("update", {"check_only": False}, batch.arrays(f) + (right,))
    assert out["num_nodes"] == n + 1 and names.to_internal(right)[0].tolist() == [n]
