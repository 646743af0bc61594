"""The front end <-> engine frames (serving/ipc/wire.py) and their stream (channel.py):
what goes in comes out, JSON data becomes the arrays the engine would make of it, and a
broken frame is a WireError, never a wrong request."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridgnn.errors import BadRequest
from hybridgnn.serving.ipc import wire
from hybridgnn.serving.ipc.channel import Channel
from hybridgnn.serving.v2.inference import _ACCEPTED_INPUTS, INPUTS
from hybridgnn.serving.v2.tensors import decode_inputs
from hybridgnn.serving.v2.types import MISSING, Failure, InferAnswer, InferInput, Tensor


def payload_of(frame: bytes) -> tuple[int, int, memoryview]:
    length, kind, rid = wire.FRAME.unpack_from(frame)
    assert length == len(frame) - 4
    return kind, rid, memoryview(frame)[wire.FRAME.size:]


def test_an_inference_crosses_whole():
    inp = InferInput("m", "2", [Tensor("node_ids", "INT64", [3], [1, 2, 3]),
                                Tensor("features", "FP32", [1, 2], raw=np.array([1.5, 2.5], "<f4").tobytes()),
                                Tensor("edge_index", "INT64", [2, 1])],
                     {"mode": "precomputed", "gamma": 0.5}, ["logits"], "req-7", 0.25, True)
    kind, rid, payload = payload_of(wire.encode_infer(41, inp))
    assert (kind, rid) == (wire.INFER, 41)
    out = wire.decode_infer(payload)
    assert (out.model, out.version, out.id, out.parameters, out.outputs, out.waited_s, out.standing) == (
        "m", "2", "req-7", {"mode": "precomputed", "gamma": 0.5}, ["logits"], 0.25, True)
    ids, feats, edges = out.inputs
    assert isinstance(ids.data, np.ndarray) and ids.data.tolist() == [1, 2, 3] and ids.raw is None
    assert bytes(feats.raw) == np.array([1.5, 2.5], "<f4").tobytes()
    assert edges.data is MISSING and edges.raw is None


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=JSON_VALUES, datatype=st.one_of(st.sampled_from(["INT64", "INT32", "FP32", "UINT64", "BYTES", "BOOL", 7]),
                                            JSON_VALUES, st.dictionaries(st.text(max_size=3), JSON_VALUES, max_size=2)),
       shape=st.one_of(st.lists(st.integers(0, 6), max_size=3), JSON_VALUES))
@example(data=[[1], [2], [3]], datatype="INT64", shape=[3])  # nested other than its shape: it crossed flat
@example(data=[[1, 2], [3, 4], [5, 6]], datatype="INT64", shape=[2, 3])
def test_json_data_is_judged_by_the_engine_as_in_one_process(data, datatype, shape):
    """Whatever a client's JSON input holds, the engine decodes the crossed tensor to the
    same array, or refuses it with the same message, as from the JSON itself."""
    sent = Tensor("node_ids", datatype, shape, data)
    crossed = wire.decode_infer(payload_of(wire.encode_infer(1, InferInput("m", None, [sent])))[2]).inputs[0]

    def outcome(t):
        try:
            return decode_inputs([t], INPUTS, _ACCEPTED_INPUTS)["node_ids"].tolist()
        except BadRequest as exc:
            return str(exc)

    assert outcome(crossed) == outcome(sent)


def test_an_answer_crosses_as_bytes_and_comes_back_as_arrays():
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1]  # not C-contiguous
    names = np.array(["a", "bé"])
    kind, rid, payload = payload_of(wire.encode_answer(9, InferAnswer("m", "1", "x", [
        ("logits", logits), ("predictions", np.array([2, 0])), ("node_ids", names)])))
    assert (kind, rid) == (wire.ANSWER, 9)
    out = wire.decode_answer(payload, "m")
    assert (out.model, out.version, out.id) == ("m", "1", "x")
    (n1, a1), (n2, a2), (n3, a3) = out.outputs
    np.testing.assert_array_equal(a1, logits)
    assert a2.tolist() == [2, 0] and a3.tolist() == ["a", "bé"] and n1 == "logits"


def test_failures_and_forwarded_requests_cross():
    f = wire.decode_failure(payload_of(wire.encode_failure(3, Failure(429, "slow down", {"Retry-After": "1"})))[2])
    assert (f.status, f.message, f.headers, f.request_id) == (429, "slow down", {"Retry-After": "1"}, None)
    fwd = wire.decode_forward(payload_of(wire.encode_forward(4, "GET", "/v2", {"host": "x"}, b"\x00body", 0.5,
                                                             False))[2])
    assert fwd == ("GET", "/v2", {"host": "x"}, b"\x00body", 0.5, False)
    rep = wire.decode_reply(payload_of(wire.encode_reply(5, 503, "text/plain", None, b"no"))[2])
    assert rep == (503, "text/plain", None, b"no")


@pytest.mark.parametrize("payload", [b"", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00{}", b"\x02\x00\x00\x00[]",
                                     b"\x09\x00\x00\x00not json!"])
def test_a_broken_frame_is_a_wire_error(payload):
    for decode in (wire.decode_infer, lambda p: wire.decode_answer(p, "m"), wire.decode_forward, wire.decode_reply):
        with pytest.raises(wire.WireError):
            decode(memoryview(payload))


def test_an_answer_claiming_more_bytes_than_it_carries_is_refused():
    good = wire.encode_answer(1, InferAnswer("m", "1", None, [("logits", np.zeros((2, 2), np.float32))]))
    with pytest.raises(wire.WireError):
        wire.decode_answer(memoryview(good)[wire.FRAME.size:-4], "m")
    head = {"v": "1", "id": None, "o": [["x", "|O", [1]]]}
    with pytest.raises(wire.WireError):
        wire.decode_answer(payload_of(wire.with_head(wire.ANSWER, 1, head, b"\0" * 8))[2], "m")


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.closed = False

    def close(self):
        self.closed = True


def test_the_channel_reassembles_frames_split_anywhere_and_joined_in_one_read():
    frames = [wire.json_frame(wire.STATS, i, {"n": i, "pad": "x" * i}) for i in range(20)]
    stream = b"".join(frames)

    async def scenario():
        got = []
        ch = Channel(lambda kind, rid, p: got.append((kind, rid, wire.loads(p)["n"])))
        ch.connection_made(_Transport())
        cuts = [0, 1, 3, 4, 9, 10, 50, 51, 52, 200, len(stream)]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            ch.data_received(stream[a:b])
        return got

    got = asyncio.run(scenario())
    assert got == [(wire.STATS, i, i) for i in range(20)]


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
       cuts=st.lists(st.integers(0, 1 << 16), max_size=20))
def test_frames_of_any_size_cut_anywhere_arrive_whole_and_in_order(sizes, cuts):
    frames = [wire.json_frame(wire.STATS, i, {"n": i, "pad": "x" * size}) for i, size in enumerate(sizes)]
    stream = b"".join(frames)
    cuts = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})

    async def scenario():
        got = []
        ch = Channel(lambda kind, rid, p: got.append((rid, len(wire.loads(p)["pad"]))))
        ch.connection_made(_Transport())
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            ch.data_received(stream[a:b])
        return got, ch.closed

    assert asyncio.run(scenario()) == (list(enumerate(sizes)), False)


def test_a_large_frame_read_in_small_pieces_arrives_once_with_the_frame_after_it():
    big = wire.json_frame(wire.STATS, 1, {"pad": "y" * (4 << 20)})
    small = wire.json_frame(wire.STATS, 2, {"pad": ""})
    stream = big + small

    async def scenario():
        got = []
        ch = Channel(lambda kind, rid, p: got.append((rid, len(wire.loads(p)["pad"]))))
        ch.connection_made(_Transport())
        for a in range(0, len(stream), 1 << 16):
            ch.data_received(stream[a:a + (1 << 16)])
        return got

    assert asyncio.run(scenario()) == [(1, 4 << 20), (2, 0)]


def test_a_frame_that_does_not_decode_closes_the_channel():
    async def scenario():
        lost = []

        def on_message(kind, rid, payload):
            raise wire.WireError("bad")

        ch = Channel(on_message, lost.append)
        t = _Transport()
        ch.connection_made(t)
        ch.data_received(wire.json_frame(wire.STATS, 1, {}))
        assert not ch.send(b"x")
        return t.closed, len(lost), ch.closed

    assert asyncio.run(scenario()) == (True, 1, True)


def test_a_frame_with_an_impossible_length_closes_the_channel():
    async def scenario():
        ch = Channel(lambda *a: None)
        t = _Transport()
        ch.connection_made(t)
        ch.data_received(wire.FRAME.pack(3, 1, 1))
        return ch.closed

    assert asyncio.run(scenario())


def test_nan_in_parameters_crosses():
    inp = InferInput("m", None, [], {"gamma": math.nan})
    out = wire.decode_infer(payload_of(wire.encode_infer(1, inp))[2])
    assert math.isnan(out.parameters["gamma"])


@pytest.mark.parametrize("params", [{"mode": "precomputed", "gamma": 0.25}, {"k": 1 << 70}, {"nested": {"a": [1]}},
                                    {"mode": "srpe", "n": -(1 << 63)}])
def test_parameters_of_every_kind_cross_exactly(params):
    inp = InferInput("m", None, [Tensor("node_ids", "INT64", [1], [3])], params, None, 12)
    out = wire.decode_infer(payload_of(wire.encode_infer(1, inp))[2])
    assert out.parameters == params and out.id == 12


def test_grpc_calls_and_answers_cross():
    call = wire.decode_grpc(payload_of(wire.encode_grpc(2, "ModelInfer", "Bearer t", b"\x0a\x01m"))[2])
    assert call == ("ModelInfer", "Bearer t", b"\x0a\x01m")
    ok = wire.decode_grpc_reply(payload_of(wire.encode_grpc_reply(2, b"\x12\x00"))[2])
    assert ok == (None, "", (), b"\x12\x00")
    failed = wire.decode_grpc_reply(payload_of(wire.encode_grpc_reply(
        3, b"", "RESOURCE_EXHAUSTED", "slow down", (("retry-after", "1"),)))[2])
    assert failed == ("RESOURCE_EXHAUSTED", "slow down", (("retry-after", "1"),), b"")


def test_a_forwarded_grpc_call_for_no_method_or_of_bad_bytes_ends_with_a_clear_status():
    pytest.importorskip("grpc")
    from hybridgnn.serving.grpc.service import GrpcFrontend, answer_forwarded

    frontend = GrpcFrontend(None)  # neither call reaches the service
    none = asyncio.run(answer_forwarded(frontend, "NoSuchMethod", b"", ()))
    bad = asyncio.run(answer_forwarded(frontend, "ModelInfer", b"\xff\xff\xff", ()))
    assert none[1] == "UNIMPLEMENTED" and bad[1] == "INVALID_ARGUMENT" and bad[0] == b""
    assert bad[2] == "the request is not a valid inference.ModelInferRequest protobuf message"


def test_a_lone_surrogate_from_a_client_crosses_as_sent():
    inp = InferInput("m", None, [Tensor("node_ids", "INT64", [1], [3])], {"mode": "\ud800"}, ["\udfff"], "\ud801")
    out = wire.decode_infer(payload_of(wire.encode_infer(1, inp))[2])
    assert (out.parameters, out.outputs, out.id) == ({"mode": "\ud800"}, ["\udfff"], "\ud801")


def test_an_integer_past_64_bits_in_a_shape_crosses_as_sent():
    inp = InferInput("m", None, [Tensor("node_ids", "INT64", -(1 << 63) - 1, None)])
    out = wire.decode_infer(payload_of(wire.encode_infer(1, inp))[2])
    assert out.inputs[0].shape == -(1 << 63) - 1 and type(out.inputs[0].shape) is int


def test_json_data_too_deep_to_read_back_is_a_bad_request_not_a_broken_link(monkeypatch):
    inp = InferInput("m", None, [Tensor("node_ids", "INT64", [1], [[["x"]]])])
    frame = wire.encode_infer(1, inp)

    def too_deep(payload):
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")

    monkeypatch.setattr(wire, "loads", too_deep)
    with pytest.raises(BadRequest, match="nested too deeply"):
        wire.decode_infer(payload_of(frame)[2])


@pytest.mark.parametrize("name, datatype, data, shape", [
    ("node_ids", "INT64", [True, 5], [2]), ("node_ids", "INT32", [5, False], [2]),
    ("edge_index", "INT64", [[1, 2], [True, 4]], [2, 2]), ("features", "FP32", [[1.5, True]], [1, 2])])
def test_true_or_false_among_numbers_crosses_as_json_and_the_engine_refuses_it(name, datatype, data, shape):
    # an array made here read them as 1 and 0, and the engine served the request
    sent = Tensor(name, datatype, shape, data)
    crossed = wire.decode_infer(payload_of(wire.encode_infer(1, InferInput("m", None, [sent])))[2]).inputs[0]
    assert crossed.data == data
    with pytest.raises(BadRequest, match=f"input '{name}': 'data' must hold .*, not true/false"):
        decode_inputs([crossed], INPUTS, _ACCEPTED_INPUTS)
