"""The partitioned engine over in-process stand-in ranks (no processes, no sockets): calls
waiting together go as one, each request gets its own rows back, the group's state is
readiness, and what cannot be served exactly is refused. Also the rank link's frames."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.config import PartitionConfig, SamplingConfig, ServeConfig
from hybridgnn.errors import BadRequest, Conflict, ServiceUnavailable, ServingError
from hybridgnn.serving.core.partitioned import PartitionedEngine
from hybridgnn.serving.ipc import ranks as wire
from hybridgnn.serving.ipc.wire import WireError


class StandInRanks:
    """Answers like rank 0 would: logits = id * [1, 2], embeddings = -id; counts its calls."""

    world, restarts, why_down = 2, 0, ""

    def __init__(self):
        self.info, self.up = {}, False
        self.calls: list[tuple[str, dict, tuple]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None

    def start(self) -> dict:
        self.up, self.info = True, {"ranks": 2, "partition": "ranges", "precomputed": True, "memory_bytes": [1, 1]}
        return self.info

    def call(self, name, head, arrays):
        self.gate.wait(10)
        self.calls.append((name, head, arrays))
        if not self.up:
            raise ServiceUnavailable("partition ranks are down (rank 1 exited)", retry_after_s=1.0)
        if self.fail is not None:
            raise self.fail
        ids = arrays[0].astype(np.float32) if name != "new_nodes" else np.arange(len(arrays[0]), dtype=np.float32)
        logits = np.stack([ids, 2 * ids], axis=1)
        return {"recomputed": 0, "bytes_moved": 0, "compute_s": 0.001}, [logits, -ids[:, None]]

    def close(self) -> None:
        self.up = False


def _run(scenario, ranks: StandInRanks | None = None):
    async def main():
        ranks_ = ranks or StandInRanks()
        cfg = ServeConfig(dataset_dir=DATA[0], model_dir=DATA[1], sampling=SamplingConfig((5, 3)),
                          partitions=PartitionConfig(partitions=2))
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

    _run(scenario)


def test_sampled_modes_and_updates_are_refused_not_approximated():
    async def scenario(engine, ranks):
        with pytest.raises(BadRequest, match="full"):
            engine.submit(np.array([1]))
        with pytest.raises(BadRequest, match="srpe"):
            engine.new_nodes(np.zeros((1, 16), np.float32), np.array([[3000], [1]]), mode="sampled", gamma=0.1,
                             policy="ratio")
        assert engine.default_mode == "full" and engine.serves_full
        meta = engine.metadata()
        assert meta["modes"] == ["full", "precomputed"] and meta["partitions"]["ranks"] == 2
        assert not ranks.calls

    _run(scenario)


def test_partition_config_is_checked():
    with pytest.raises(ValueError, match="--partitions"):
        PartitionConfig(partitions=-1)
    with pytest.raises(ValueError, match="--ranks needs"):
        PartitionConfig(ranks="10.0.0.1:7000")
    with pytest.raises(ValueError, match="graph updates"):
        from hybridgnn.config import UpdateConfig

        ServeConfig(dataset_dir=DATA[0], model_dir=DATA[1], partitions=PartitionConfig(partitions=2),
                    updates=UpdateConfig(token="secret-token"))


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


def test_rank_addresses_are_checked():
    assert wire._family("unix:/tmp/x.sock")[1] == "/tmp/x.sock"
    assert wire._family("10.0.0.1:7700")[1] == ("10.0.0.1", 7700)
    assert wire._family("[::1]:7700")[1] == ("::1", 7700)
    for bad in ("10.0.0.1", "host:port", ":"):
        with pytest.raises(ValueError, match="host:port"):
            wire._family(bad)
