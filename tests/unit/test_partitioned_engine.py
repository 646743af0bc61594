"""The partitioned engine over in-process stand-in ranks (no processes, no sockets): calls
waiting together go as one, each request gets its own rows back, the group's state is
readiness, and what cannot be served exactly is refused. Also the rank link's frames."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.config import PartitionConfig, SamplingConfig, ServeConfig, UpdateConfig
from hybridgnn.errors import (
    BadRequest,
    BatchFailed,
    ConfigError,
    Conflict,
    Draining,
    RemovedNode,
    ServiceUnavailable,
    ServingError,
    UpdateError,
)
from hybridgnn.graph.dynamic import UpdateBatch
from hybridgnn.graph.store import GraphStore
from hybridgnn.serving.core.partitioned import RANKS_STALLED_S, PartitionedEngine
from hybridgnn.serving.core.updates import PendingUpdate
from hybridgnn.serving.ipc import ranks as wire
from hybridgnn.serving.ipc.wire import WireError
from hybridgnn.updates.requests import LoggedRequest


class StandInRanks:
    """Answers like rank 0 would: logits = id * [1, 2], embeddings = -id; counts its calls."""

    world, restarts, why_down, generation = 2, 0, "", 0
    stalled = 0.0  # what stalled_s() says

    def __init__(self, num_nodes: int = 0):
        self.info, self.up = {}, False
        self.calls: list[tuple[str, dict, tuple]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None
        self.prepare = None
        self.base_nodes = self.num_nodes = num_nodes  # what the stand-in graph has (updates add nodes)

    def start(self) -> dict:
        self.info = {"ranks": 2, "partition": "ranges", "precomputed": True, "memory_bytes": [1, 1]}
        self.restart()
        return self.info

    def restart(self, kept_updates: int = 0) -> None:
        """A group formed anew (the stored graph), or relinked holding kept_updates applied
        updates (ranks under torchrun outlive a server); then prepare (the engine replays
        its log)."""
        self.up, self.generation = False, self.generation + 1
        if not kept_updates:
            self.num_nodes = self.base_nodes
        if self.prepare is not None:
            self.prepare(self._call, {**self.info, "updates_applied": kept_updates, "generation": self.generation})
        self.up = True

    def stalled_s(self) -> float:
        return self.stalled

    def call(self, name, head, arrays, *, generation=None):
        if not self.up or (generation is not None and generation != self.generation):
            raise ServiceUnavailable("partition ranks are down (rank 1 exited)", retry_after_s=1.0)
        return self._call(name, head, arrays)

    def _call(self, name, head, arrays):
        self.gate.wait(10)
        self.calls.append((name, head, arrays))
        if self.fail is not None:
            raise self.fail
        if name == "reset":
            self.num_nodes = self.base_nodes
            return {"updates_applied": 0}, []
        if name == "update":  # a batch naming node 0 in remove_nodes is refused, like a rank would
            batch = UpdateBatch.from_arrays(arrays)
            if 0 in batch.remove_nodes:
                raise ServingError("remove_nodes names unknown node 0", status=400)
            added = 0 if batch.add_node_features is None else len(batch.add_node_features)
            if not head["check_only"]:
                self.num_nodes += added
            return {"num_nodes": self.num_nodes, "new_nodes": added, "affected_per_layer": [added, 0],
                    "propagate_s": 0.0}, []
        ids = arrays[0].astype(np.float32) if name != "new_nodes" else np.arange(len(arrays[0]), dtype=np.float32)
        logits = np.stack([ids, 2 * ids], axis=1)
        return {"recomputed": 0, "bytes_moved": 0, "compute_s": 0.001}, [logits, -ids[:, None]]

    def close(self) -> None:
        self.up = False


def _run(scenario, ranks: StandInRanks | None = None, fanouts=(5, 3), **cfg_kw):
    async def main():
        ranks_ = ranks or StandInRanks()
        cfg = ServeConfig(dataset_dir=DATA[0], model_dir=DATA[1], sampling=SamplingConfig(fanouts),
                          partitions=PartitionConfig(partitions=2), **cfg_kw)
        engine = PartitionedEngine(cfg, ranks_)
        await engine.start()
        try:
            return await scenario(engine, ranks_)
        finally:
            await engine.stop()

    return asyncio.run(main())


DATA: list = []


@pytest.fixture(autouse=True)
def _data(tiny_dataset, tiny_model):
    DATA[:] = [tiny_dataset, tiny_model]


def test_requests_waiting_together_go_as_one_call_and_get_their_own_rows():
    ranks = StandInRanks()

    async def scenario(engine, ranks):
        ranks.gate.clear()  # the first call holds the ranks while the others queue behind it
        first = asyncio.ensure_future(engine.full(np.array([7])))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(engine.full(np.array(ids))) for ids in ([1, 2], [3], [4, 5, 6])]
        lookup = asyncio.ensure_future(engine.lookup(np.array([9])))
        await asyncio.sleep(0.05)
        ranks.gate.set()
        results = await asyncio.gather(first, *queued, lookup)
        return results

    results = _run(scenario, ranks)
    assert [c[0] for c in ranks.calls] == ["existing", "existing", "lookup"]
    np.testing.assert_array_equal(ranks.calls[1][2][0], [1, 2, 3, 4, 5, 6])
    for res, ids in zip(results, ([7], [1, 2], [3], [4, 5, 6], [9]), strict=True):
        np.testing.assert_array_equal(res.logits[:, 0], ids)
        np.testing.assert_array_equal(res.predictions, np.ones(len(ids)))
    assert results[-1].pipeline == "precomputed" and results[0].pipeline == "partitioned_full"


def test_a_down_group_is_not_ready_and_its_answer_is_503_with_retry_after():
    async def scenario(engine, ranks):
        assert engine.ready
        ranks.up = False
        assert not engine.ready and not engine.snapshot().ready
        with pytest.raises(ServiceUnavailable) as err:
            await engine.full(np.array([1]))
        assert err.value.headers()["Retry-After"]
        assert engine.pending == 0
        ranks.up = True
        ranks.fail = Conflict("mode 'pe' needs precomputed embeddings; run `hybridgnn precompute`")
        with pytest.raises(ServingError) as err:
            await engine.new_nodes(np.zeros((1, 16), np.float32), np.array([[3000], [1]]), mode="pe", gamma=0.1,
                                   policy="ratio")
        assert err.value.status == 409
        assert engine.pending == 0 and engine.ready
        # a call held by a stopped or stuck rank (until the ranks' timeout): not ready meanwhile
        ranks.fail = None
        ranks.stalled = RANKS_STALLED_S
        assert not engine.ready and engine.metadata()["partitions"]["stalled_s"] == RANKS_STALLED_S
        # and a new request is a 503 at once, not one more queued behind the held call
        calls = len(ranks.calls)
        with pytest.raises(ServiceUnavailable, match="have not answered a call for 5 s") as err:
            await engine.lookup(np.array([1]))
        assert err.value.headers()["Retry-After"] and engine.pending == 0 and len(ranks.calls) == calls
        ranks.stalled = 0.0
        assert engine.ready
        await engine.lookup(np.array([1]))

    _run(scenario)


def test_a_stop_answers_the_group_the_ranks_are_serving():
    """The dispatcher takes a group out of the queue before it calls the ranks; a stop
    during the call must answer that group too (503), not only what still queues."""
    async def scenario(engine, ranks):
        in_call, call = threading.Event(), ranks.call

        def blocked_call(*args, **kwargs):
            in_call.set()
            return call(*args, **kwargs)

        ranks.call = blocked_call
        ranks.gate.clear()  # the ranks' call blocks until the gate opens
        answer = asyncio.ensure_future(engine.full(np.array([1, 2])))
        assert await asyncio.to_thread(in_call.wait, 10)  # the group is in hand
        asyncio.get_running_loop().call_later(0.05, ranks.gate.set)
        await engine.stop()
        with pytest.raises(Draining):
            await asyncio.wait_for(answer, 5)

    _run(scenario)


def test_existing_node_sampling_is_refused_and_new_node_sampling_goes_to_the_ranks():
    async def scenario(engine, ranks):
        with pytest.raises(BadRequest, match="full"):
            engine.submit(np.array([1]))
        with pytest.raises(BadRequest, match="srpe"):
            engine.new_nodes(np.zeros((1, 16), np.float32), np.array([[3000], [1]]), mode="bogus", gamma=0.1,
                             policy="ratio")
        assert engine.default_mode == "full" and engine.serves_full
        meta = engine.metadata()
        assert meta["modes"] == ["full", "precomputed"] and meta["partitions"]["ranks"] == 2
        assert "sampled" in meta["new_node_modes"]
        assert not ranks.calls
        await engine.new_nodes(np.zeros((1, 16), np.float32), np.array([[3000], [1]]), mode="sampled", gamma=0.1,
                               policy="ratio")
        (kind, head, _), = ranks.calls
        assert head["mode"] == "sampled" and head["fanouts"] == list(engine.cfg.sampling.fanouts)

    _run(scenario)


def test_the_seed_log_counts_the_nodes_full_requests_are_rooted_at(tmp_path):
    """--seed-log on a partitioned server: each existing-node id of a full request counted
    once per call (calls grouped for the ranks too), lookups and new nodes not, written as
    the .counts.npy over the stored graph that `workload build --seeds` reads. It wrote
    nothing."""
    from hybridgnn.config import ServerConfig
    from hybridgnn.workload.tables import seed_distribution

    log = tmp_path / "seeds.counts.npy"

    async def scenario(engine, ranks):
        ranks.gate.clear()  # the first call holds the ranks while the others queue behind it: one group
        first = asyncio.ensure_future(engine.full(np.array([7])))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(engine.full(np.array(ids))) for ids in ([1, 1], [7, 2999])]
        await asyncio.sleep(0.05)
        ranks.gate.set()
        await asyncio.gather(first, *queued)
        await engine.lookup(np.array([5, 5]))
        await engine.new_nodes(np.zeros((1, 16), np.float32), np.array([[3000], [1]]), mode="sampled", gamma=0.1,
                               policy="ratio")
        await asyncio.to_thread(engine.save_seed_log, log)
        return engine.graph

    graph = _run(scenario, server=ServerConfig(seed_log=log))
    counts = np.load(log)
    assert counts.dtype == np.int64 and counts.shape == (graph.num_nodes,)
    assert {int(i): int(counts[i]) for i in np.flatnonzero(counts)} == {1: 2, 7: 2, 2999: 1}
    assert [p.name for p in tmp_path.iterdir()] == ["seeds.counts.npy"]  # written whole: no temporary left
    p0, _ = seed_distribution(graph, log)
    assert p0[[1, 7, 2999]].tolist() == [0.4, 0.4, 0.2]


def test_without_a_seed_log_nothing_is_counted():
    async def scenario(engine, ranks):
        await engine.full(np.array([1, 2]))
        return engine._seed_counts

    assert _run(scenario) is None


def test_partition_config_is_checked():
    with pytest.raises(ValueError, match="--partitions"):
        PartitionConfig(partitions=-1)
    with pytest.raises(ValueError, match="--ranks needs"):
        PartitionConfig(ranks="10.0.0.1:7000")
    with pytest.raises(ValueError, match="one model"):
        ServeConfig(dataset_dir=DATA[0], model_dir=DATA[1], partitions=PartitionConfig(partitions=2),
                    model_repository=DATA[1])
    with pytest.raises(ValueError, match="--partition-device"):
        PartitionConfig(partitions=2, device="tpu")


def test_a_down_groups_503_names_what_happened_and_keeps_the_ranks_own_line_for_the_log():
    from hybridgnn.serving.partitions import RankGroup

    group = RankGroup(ServeConfig(dataset_dir=DATA[0], model_dir=DATA[1], partitions=PartitionConfig(partitions=2)))
    group.why_down = ("rank 1 of 2 exited with code 1: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
                      "transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    err = group._unavailable()
    assert err.status == 503 and err.retry_after_s >= 1.0
    assert "(rank 1 of 2 exited with code 1)" in err.message and "pair.cc" not in err.message
    with pytest.raises(ServiceUnavailable, match=r"partition ranks are down \(rank 1 of 2 exited with code 1\)"):
        group.call("ping", {}, ())


def test_a_restart_the_servers_stop_cuts_short_is_not_logged_as_a_failure(caplog):
    from hybridgnn.serving.partitions import RankGroup

    group = RankGroup(ServeConfig(dataset_dir=DATA[0], model_dir=DATA[1],
                                  partitions=PartitionConfig(partitions=2, restart_backoff_s=0.01)))

    def stopped_mid_replay(deadline):
        group._stopping.set()  # the server stops, closing the update log the replay reads
        raise ConfigError("partition ranks could not be prepared: Cannot operate on a closed database.")

    group._bring_up, group._stop_procs = stopped_mid_replay, lambda grace_s: None
    with caplog.at_level("INFO", logger="hybridgnn.serve"):
        group._supervise()  # returns: it was stopped
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_cuda_ranks_need_a_gpu_each():
    from hybridgnn.distributed.rank_server import _backend

    assert _backend("cpu", 5) == "gloo"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"local rank {visible}, {visible} GPU"):
        _backend("cuda", visible)


def _update(**inputs) -> PendingUpdate:
    logged = LoggedRequest({k: np.asarray(v) for k, v in inputs.items()})
    return PendingUpdate(logged, logged.num_updates)


def test_updates_go_through_the_log_to_the_ranks_and_a_restarted_group_replays_them():
    async def scenario(engine, ranks):
        n = engine.num_nodes
        assert engine.takes_updates and engine.graph_version == 0 and engine.metadata()["updates_enabled"]
        f = engine.graph.feature_dim
        out = await engine.update_graph(_update(add_node_features=np.ones((2, f), np.float32),
                                                add_edges=np.array([[-1, 3], [4, -2]])))
        assert out["graph_version"] == 1 and out["new_node_ids"] == [n, n + 1]
        assert engine.num_nodes == n + 2 and engine.graph_version == 1
        with pytest.raises(UpdateError, match="unknown node 0"):  # refused before it is logged
            await engine.update_graph(_update(remove_nodes=np.array([0])))
        out = await engine.update_graph(_update(remove_nodes=np.array([5])))
        assert out["graph_version"] == 2
        with pytest.raises(RemovedNode):
            engine.check_alive(np.array([1, 5]))
        assert await engine.wait_for_version(2) and not await engine.wait_for_version(3)
        # query ids of a new-node request are numbered from the node count it was decoded at
        await engine.new_nodes(np.zeros((1, f), np.float32), np.array([[n], [1]]), mode="pe", gamma=0.1,
                               policy="ratio", num_nodes=n)
        assert ranks.calls[-1][1]["num_nodes"] == n
        # a restarted group starts from the stored graph: the log is replayed before it serves
        old_view, before = engine.updates.view, len(ranks.calls)
        await asyncio.to_thread(ranks.restart)
        replayed = [c for c in ranks.calls[before:] if c[0] == "update" and not c[1]["check_only"]]
        assert len(replayed) == 2 and ranks.num_nodes == n + 2
        for _ in range(200):  # the swap runs on the event loop: poll with a deadline
            if engine.updates._ready is None and engine.updates.view.call is not None:
                break
            await asyncio.sleep(0.01)
        assert engine.graph_version == 2 and engine.num_nodes == n + 2
        with pytest.raises(ServiceUnavailable):  # the old view never reaches the new group
            old_view.check(lambda count: UpdateBatch())
        with pytest.raises(ServiceUnavailable):
            old_view.call("update", {"check_only": True}, UpdateBatch().arrays(f))
        # ranks that kept their updates (a relink) are reset before the replay: applied once
        before = len(ranks.calls)
        await asyncio.to_thread(ranks.restart, 2)
        assert ranks.calls[before][0] == "reset" and ranks.num_nodes == n + 2
        for _ in range(200):  # poll with a deadline for the swap
            if engine.updates._ready is None and engine.updates.view.call is not None:
                break
            await asyncio.sleep(0.01)
        out = await engine.update_graph(_update(update_ids=np.array([2]), update_features=np.ones((1, f), np.float32)))
        assert out["graph_version"] == 3

    _run(scenario, StandInRanks(num_nodes=GraphStore.open(DATA[0]).num_nodes),
         updates=UpdateConfig(token="secret-token", log="off"))


def test_a_replay_that_fails_names_the_log_position_it_failed_at():
    # A logged update whose apply kills a rank fails every replay at the same position: the
    # restart's error line says where, so a group dying over and over is told apart from
    # one that died once meanwhile.
    async def scenario(engine, ranks):
        f = engine.graph.feature_dim
        for i in range(3):
            await engine.update_graph(_update(update_ids=np.array([i + 1]), update_features=np.ones((1, f), np.float32)))
        real = ranks._call
        applied = []

        def dies_on_the_second(name, head, arrays):
            if name == "update" and not head["check_only"]:
                applied.append(1)
                if len(applied) == 2:
                    raise ServiceUnavailable("partition ranks are down (rank 1 exited with -9)")
            return real(name, head, arrays)

        ranks._call = dies_on_the_second
        with pytest.raises(ServiceUnavailable, match=r"replaying the update log into the ranks failed at position 2: "
                                                     r"partition ranks are down \(rank 1 exited with -9\)"):
            await asyncio.to_thread(ranks.restart)

    _run(scenario, StandInRanks(num_nodes=GraphStore.open(DATA[0]).num_nodes),
         updates=UpdateConfig(token="secret-token", log="off"))


arrays = st.lists(st.one_of(
    st.lists(st.integers(-2**40, 2**40), max_size=20).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.floats(width=32, allow_nan=False), max_size=12).map(lambda v: np.array(v, np.float32).reshape(-1, 1)),
), max_size=3)


@settings(max_examples=60, deadline=None)
@given(arrays, st.dictionaries(st.text(max_size=5).filter(lambda k: k != "arrays"), st.integers(), max_size=3))
def test_rank_frames_carry_heads_and_arrays_unchanged(values, head):
    frame = wire.encode(wire.LOOKUP, 7, head, tuple(values))
    back_head, back = wire.decode(memoryview(frame)[9:])
    assert back_head == head
    assert len(back) == len(values)
    for a, b in zip(values, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=64))
def test_a_broken_rank_frame_is_a_wire_error_never_a_crash(junk):
    try:
        wire.decode(junk)
    except WireError:
        pass
    for head in (b'{"arrays": [["<x9", [2]]]}', b'{"arrays": [["<i8", "no"]]}', b'{"arrays": [[1]]}'):
        with pytest.raises(WireError):
            wire.decode(len(head).to_bytes(4, "little") + head)
    frame = wire.encode(wire.LOOKUP, 1, {}, (np.arange(4),))
    with pytest.raises(WireError):
        wire.decode(memoryview(frame)[9:-1])  # arrays longer than the payload


class StalledSocket:
    """A socket that holds `data` and then, as a sender that stopped mid-frame, nothing:
    a recv without a timeout would block for ever."""

    def __init__(self, data: bytes):
        self.data, self.timeout = data, None

    def settimeout(self, timeout):
        self.timeout = timeout

    def recv(self, n: int) -> bytes:
        if not self.data:
            if self.timeout is None:
                raise AssertionError("blocked for ever on a frame cut short")
            raise TimeoutError
        chunk, self.data = self.data[:min(n, 3)], self.data[min(n, 3):]  # a few bytes at a time
        return chunk


def test_a_frame_cut_short_is_a_wire_error_within_its_bound_never_a_wait_for_ever():
    """Rank 0 read the rest of a frame without a timeout: a sender stopped mid-frame held it
    past the followers' timeout (the group died), and the engine's call held the link's
    lock, so the supervisor could not even mark the group down."""
    frame = wire.encode(wire.LOOKUP, 3, {"with_embeddings": True}, (np.arange(5),))
    assert wire.Link(StalledSocket(frame)).recv(1.0, 1.0)[:2] == (wire.LOOKUP, 3)
    for cut in (4, len(frame) - 2):  # in the frame's header, in its payload
        with pytest.raises(WireError, match="cut short"):
            wire.Link(StalledSocket(frame[:cut])).recv(1.0, 0.05)
    with pytest.raises(TimeoutError):  # no frame started: an idle link, the caller's to judge
        wire.Link(StalledSocket(b"")).recv(0.05, 0.05)


def test_rank_addresses_are_checked():
    assert wire._family("unix:/tmp/x.sock")[1] == "/tmp/x.sock"
    assert wire._family("10.0.0.1:7700")[1] == ("10.0.0.1", 7700)
    assert wire._family("[::1]:7700")[1] == ("::1", 7700)
    for bad in ("10.0.0.1", "host:port", ":"):
        with pytest.raises(ValueError, match="host:port"):
            wire._family(bad)


class MisshapenRanks(StandInRanks):
    """Rank 0 of another build: its first answers come in a shape this engine cannot slice."""

    def __init__(self, answers: list):
        super().__init__()
        self.answers = answers

    def _call(self, name, head, arrays):
        if name == "existing" and self.answers:
            self.calls.append((name, head, arrays))
            return {"recomputed": 0, "bytes_moved": 0, "compute_s": 0.001}, self.answers.pop(0)
        return super()._call(name, head, arrays)


def test_a_misshapen_answer_from_rank_0_fails_its_request_and_the_next_is_served():
    bad = [[], [np.zeros((3, 2), np.float32), np.zeros((3, 1), np.float32)]]  # no rows; rows for 3 of 2 ids

    async def scenario(engine, ranks):
        outcomes = []
        for ids in ([1], [1, 2], [5]):
            try:
                outcomes.append((await asyncio.wait_for(engine.full(np.array(ids)), 10)).logits[:, 0].tolist())
            except BatchFailed as exc:
                outcomes.append(str(exc))
        return outcomes

    first, second, served = _run(scenario, MisshapenRanks(bad))
    assert "partition rank 0 answered 'existing' with rows []" in first
    assert "not two arrays of 2 rows" in second
    assert served == [5.0]


def test_fanouts_past_the_models_layers_are_cut_as_a_single_process_server_cuts_them(caplog):
    """Resources cuts fanouts to the model's layers (metadata, describe and the new-node
    head say so); a partitioned server reported and sent the hops it never samples."""
    import logging

    async def scenario(engine, ranks):
        await engine.new_nodes(np.zeros((1, 16), np.float32), np.array([[3000], [1]]), mode="sampled", gamma=0.1,
                               policy="ratio")
        return engine.metadata()["fanouts"], [h["fanouts"] for name, h, _ in ranks.calls if h.get("mode")]

    with caplog.at_level(logging.WARNING):
        listed, sent = _run(scenario, fanouts=(5, 3, 2))
    assert listed == [5, 3] and sent == [[5, 3]]
    assert any("sampling the first 2" in r.getMessage() for r in caplog.records)


def test_a_batch_the_ranks_refuse_is_one_400_that_says_so_once():
    from hybridgnn.serving.core.partitioned_updates import RankGraph

    def refuse(name, head, arrays):  # as RankGroup.call raises rank 0's ERROR answer
        raise ServingError(UpdateError("add_edges names unknown node 17").message, status=400)

    view = RankGraph(10, 4, None, refuse)
    with pytest.raises(UpdateError) as caught:
        view.check(lambda n: UpdateBatch())
    assert caught.value.status == 400
    assert caught.value.message == "update rejected, nothing applied: add_edges names unknown node 17"


def test_new_names_are_committed_before_the_ranks_apply_and_taken_back_if_they_refuse():
    """Named after the ranks had applied the batch, a naming that failed left the entry to
    be retried with the grown node count: the nodes were added twice, or the update
    reported rejected when it had applied."""
    from hybridgnn.graph.idmap import IdMap
    from hybridgnn.serving.core.partitioned_updates import RankGraph

    names = IdMap(np.array(["a", "b", "c"]))
    seen = []

    def ranks(name, head, arrays):
        seen.append(names.to_internal(np.array(["x"]))[1].item())  # named when the ranks apply
        if len(seen) == 1:
            raise ServingError(UpdateError("no").message, status=400)
        return {"num_nodes": 4, "affected_per_layer": [1], "propagate_s": 0.0}, None

    view = RankGraph(3, 4, names, ranks)
    commit = lambda: names.extend(np.array(["x"]))  # noqa: E731
    batch = UpdateBatch(add_node_features=np.ones((1, 4), np.float32))
    with pytest.raises(UpdateError):
        view.apply(batch, commit)
    assert seen == [True] and not names.to_internal(np.array(["x"]))[1].item() and view.num_nodes == 3
    view.apply(batch, commit)
    assert names.to_internal(np.array(["x"]))[0].tolist() == [3] and view.num_nodes == 4 and len(names) == 4

    def naming_fails():
        raise MemoryError

    with pytest.raises(MemoryError):  # nothing reached the ranks
        view.apply(batch, naming_fails)
    assert len(seen) == 2 and view.num_nodes == 4


def test_an_update_that_fails_with_503_teaches_the_lane_nothing_of_its_service_time():
    """A call that waited for a hung rank group and then got 503 took the group's
    timeout, not service: learnt, the lane would refuse concurrent updates (429) long
    after the group is back."""
    async def scenario(engine, ranks):
        async def served():
            return {}

        async def group_down():
            await asyncio.sleep(0.5)  # stands for a call held by a hung rank until its timeout
            raise ServiceUnavailable("partition ranks are down (the link to rank 0 failed)")

        for _ in range(10):
            await engine.run_in_lane("updates", 1.0, served)
        fast = engine.lane("updates").model_delay_s(4.0)
        with pytest.raises(ServiceUnavailable):
            await engine.run_in_lane("updates", 1.0, group_down)
        assert engine.lane("updates").model_delay_s(4.0) <= fast + 0.01

    _run(scenario)


def test_a_read_waiting_for_a_graph_version_gets_it_from_the_group_that_replaced_the_ranks():
    async def scenario(engine, ranks):
        f = engine.graph.feature_dim
        waiting = asyncio.ensure_future(engine.wait_for_version(1))  # a version another replica writes
        await asyncio.sleep(0)  # let it wait on the follower in service now
        old = engine.updates.follower
        await asyncio.to_thread(ranks.restart)
        for _ in range(200):  # the swap runs on the event loop: poll with a deadline
            if engine.updates.follower is not old and engine.updates.view.call is not None:
                break
            await asyncio.sleep(0.01)
        out = await engine.update_graph(_update(update_ids=np.array([2]), update_features=np.ones((1, f), np.float32)))
        assert out["graph_version"] == 1
        assert await asyncio.wait_for(waiting, 2.0)  # within the 5 s catch-up bound: released, not timed out

    _run(scenario, StandInRanks(num_nodes=GraphStore.open(DATA[0]).num_nodes),
         updates=UpdateConfig(token="secret-token", log="off", max_catch_up_s=5.0))
