"""The KServe v2 gRPC schema and request conversion (no sockets): the messages carry the
field numbers v2 clients use, and a ModelInferRequest becomes the REST request form."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("grpc")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")

from hybridgnn.errors import BadRequest, Conflict, Overloaded, ServiceUnavailable  # noqa: E402
from hybridgnn.serving.grpc.schema import METHODS, message  # noqa: E402
from hybridgnn.serving.grpc.service import grpc_code, infer_input  # noqa: E402
from hybridgnn.serving.v2.inference import decode_infer  # noqa: E402

WIRE_SAME = {14: 5}  # an enum field is an int32 on the wire


def _fields_match(ours, theirs) -> None:
    """Every field of ours is one of theirs: same number, wire type, cardinality and
    message type name (recursively); ours may leave some of theirs out."""
    for f in ours.fields:
        t = theirs.fields_by_name[f.name]
        assert (f.number, f.is_repeated) == (t.number, t.is_repeated), f.full_name
        assert WIRE_SAME.get(t.type, t.type) == f.type, f.full_name
        if f.message_type is not None:
            assert f.message_type.name == t.message_type.name, f.full_name
            _fields_match(f.message_type, t.message_type)


@pytest.mark.parametrize("name", sorted({m for pair in METHODS.values() for m in pair}))
def test_every_message_has_the_fields_and_numbers_tritonclient_uses(name):
    ours, theirs = message(name).DESCRIPTOR, getattr(service_pb2, name).DESCRIPTOR
    _fields_match(ours, theirs)
    if name.startswith(("Server", "ModelInfer", "ModelMetadata", "ModelReady")):  # these in full
        assert {f.name for f in ours.fields} == {f.name for f in theirs.fields}


def test_a_request_round_trips_with_tritonclient_and_becomes_the_rest_form():
    ids = np.array([3, 1, 4], np.int64)
    theirs = service_pb2.ModelInferRequest(model_name="m", id="r1")
    t = theirs.inputs.add(name="node_ids", datatype="INT64", shape=[3])
    theirs.raw_input_contents.append(ids.tobytes())
    theirs.outputs.add(name="logits")
    theirs.parameters["mode"].string_param = "precomputed"
    theirs.parameters["min_graph_version"].int64_param = 7
    ours = message("ModelInferRequest").FromString(theirs.SerializeToString())
    request = infer_input(ours)
    assert request.parameters == {"mode": "precomputed", "min_graph_version": 7} and request.id == "r1"
    req = decode_infer(request, max_nodes=10, num_nodes=100)
    assert req.node_ids.tolist() == [3, 1, 4] and list(req.outputs) == ["logits"] and req.request_id == "r1"
    assert t.name == "node_ids"


def test_typed_contents_are_accepted_and_a_raw_count_mismatch_is_a_400():
    req = message("ModelInferRequest")(model_name="m")
    t = req.inputs.add(name="node_ids", datatype="INT64", shape=[2])
    t.contents.int64_contents.extend([5, 6])
    assert decode_infer(infer_input(req), max_nodes=10, num_nodes=100).node_ids.tolist() == [5, 6]
    req.raw_input_contents.extend([b"\0" * 16, b"\0" * 8])
    with pytest.raises(BadRequest, match="one raw tensor per input"):
        infer_input(req)
    names = message("ModelInferRequest")(model_name="m")
    names.inputs.add(name="node_ids", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"\xff")
    with pytest.raises(BadRequest, match="UTF-8"):
        infer_input(names)


def test_contents_that_would_be_ignored_are_a_400():
    """An input's values come from one place: raw_input_contents, or the contents field of
    its datatype. Values sent in both, or in another type's field, were ignored (the answer
    was for other ids, or said the data held none)."""
    both = message("ModelInferRequest")(model_name="m")
    t = both.inputs.add(name="node_ids", datatype="INT64", shape=[2])
    t.contents.int64_contents.extend([5, 6])
    both.raw_input_contents.append(np.array([7, 8], np.int64).tobytes())
    with pytest.raises(BadRequest, match="node_ids.*both raw_input_contents and contents"):
        infer_input(both)
    other = message("ModelInferRequest")(model_name="m")
    other.inputs.add(name="node_ids", datatype="INT64", shape=[2]).contents.int_contents.extend([5, 6])
    with pytest.raises(BadRequest, match="node_ids.*int_contents.*INT64.*int64_contents"):
        infer_input(other)
    empty = message("ModelInferRequest")(model_name="m")
    empty.inputs.add(name="node_ids", datatype="INT64", shape=[2])
    empty.raw_input_contents.append(np.array([7, 8], np.int64).tobytes())
    assert decode_infer(infer_input(empty), max_nodes=10, num_nodes=100).node_ids.tolist() == [7, 8]


def test_errors_map_to_grpc_status_codes():
    import grpc

    assert grpc_code(BadRequest("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_code(Conflict("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_code(Overloaded("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_code(ServiceUnavailable("x")) == grpc.StatusCode.UNAVAILABLE
    assert grpc_code(RuntimeError("bug")) == grpc.StatusCode.INTERNAL


def test_huge_declared_inputs_are_413s_before_any_element_is_decoded():
    import time

    from hybridgnn.errors import PayloadTooLarge

    req = message("ModelInferRequest")(model_name="m")
    req.inputs.add(name="node_ids", datatype="BYTES", shape=[4_000_000])
    req.raw_input_contents.append(b"\0\0\0\0" * 4_000_000)  # 4M empty strings
    request = infer_input(req)
    t0 = time.process_time()  # CPU time: a loaded machine's descheduling is not counted
    with pytest.raises(PayloadTooLarge, match="4000000 elements"):
        decode_infer(request, max_nodes=8192, num_nodes=100)
    assert time.process_time() - t0 < 0.5  # decoding the 4M elements first takes seconds
    typed = message("ModelInferRequest")(model_name="m")
    typed.inputs.add(name="node_ids", datatype="BYTES", shape=[100_000]).contents.bytes_contents.extend(
        [b""] * 100_000)
    with pytest.raises(PayloadTooLarge, match="100000 elements"):
        infer_input(typed, max_elements=1000)


@pytest.mark.parametrize("typed", [True, False])
def test_typed_contents_are_taken_up_to_the_decoders_own_limits(typed):
    """A new-node request's edges as typed contents: as many as REST and raw contents take
    (the bound was the features' alone, which refused more than 2 x 64 x F edge ids)."""
    import asyncio
    from types import SimpleNamespace

    from hybridgnn.serving.grpc.service import GrpcFrontend
    from hybridgnn.serving.v2.service import V2Service
    from hybridgnn.serving.v2.types import InferAnswer
    from hybridgnn.types import ServingStats

    engine = SimpleNamespace(typed=typed, max_feature_dim=2, model_version="1", stats=ServingStats(),
                             cfg=SimpleNamespace(server=SimpleNamespace(model_name="m", max_request_nodes=8)))
    service = V2Service(engine)
    taken = []
    service.infer = lambda request, encode, fail: taken.append(request) or encode(InferAnswer("m", "1", None, []))
    req = message("ModelInferRequest")(model_name="m")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([0.0, 1.0])
    m = 64 * 8  # the most edges a request may bring
    if typed:  # a heterogeneous model's neighbour lists
        req.inputs.add(name="neighbor_ids", datatype="INT64", shape=[m]).contents.int64_contents.extend([0] * m)
    else:
        req.inputs.add(name="edge_index", datatype="INT64", shape=[2, m]).contents.int64_contents.extend(
            [8] * m + [0] * m)
    asyncio.run(GrpcFrontend(service).model_infer(req, None))
    assert [len(t.data) for t in taken[0].inputs] == [2, m if typed else 2 * m]


def test_a_call_past_the_cap_is_refused_with_retry_after_and_counted():
    """The cap's refusals reached no metric: an operator saw RESOURCE_EXHAUSTED at clients
    and nothing on the dashboard."""
    import asyncio

    import grpc

    from hybridgnn.serving.grpc.schema import call_cap

    refusals = []
    wrap, backstop = call_cap(2, lambda: refusals.append(1))
    assert backstop == 2 + 256  # a burst past a small cap still reaches the refusal that says when to retry

    class Aborted(Exception):
        pass

    class Context:
        trailing = ()

        def set_trailing_metadata(self, metadata):
            self.trailing = tuple(metadata)

        async def abort(self, code, details):
            raise Aborted(code, details)

    async def main():
        release = asyncio.Event()

        async def handle(request, context):
            await release.wait()
            return request

        call = wrap(handle)
        held = [asyncio.ensure_future(call(i, Context())) for i in range(2)]
        await asyncio.sleep(0)  # both in flight
        context = Context()
        with pytest.raises(Aborted) as refused:
            await call(2, context)
        assert refused.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 gRPC calls" in refused.value.args[1]
        assert dict(context.trailing)["retry-after"] == "1" and len(refusals) == 1
        release.set()
        assert await asyncio.gather(*held) == [0, 1]
        assert await call(3, Context()) == 3 and len(refusals) == 1  # room again: served, nothing counted

    asyncio.run(main())
