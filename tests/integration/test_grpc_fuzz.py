"""Fuzzing the real server's gRPC port (hypothesis, reproducible: derandomize=True):
ModelInferRequest messages with lying shapes, mismatched raw and typed contents, unknown
datatypes, hostile parameters and outputs; bytes that are not a message at all; and the
metadata and repository methods with hostile names. Every call ends within 5 s with OK or
a status a client can act on (never UNKNOWN or INTERNAL, which grpcio gives a method that
raises), an error's details say why, the process stays up, and afterwards a good inference
answers byte for byte as it did before."""

from __future__ import annotations

import collections

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgnn.serving.grpc.schema import SERVICE, message
from tests.support.server import FRONTEND_IDS, FRONTENDS, ServerProcess, free_port

TIMEOUT_S = 5.0
# what a client can act on: its own mistake, a missing model, overload, or the server going away
ANSWERABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
NAMES = ["node_ids", "features", "edge_index", "ids", "", "node_ids\x00", "é" * 40]
DATATYPES = ["INT64", "INT32", "UINT64", "FP32", "FP64", "BYTES", "BOOL", "INT8", "FP16", "", "int64", "NOPE"]
MODES = ["sampled", "precomputed", "full", "pe", "srpe", "", "nope"]
METHOD_NAMES = ["ModelMetadata", "ModelReady", "ModelConfig", "ModelStatistics", "RepositoryModelLoad",
                "RepositoryModelUnload", "RepositoryIndex", "ServerMetadata"]


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@pytest.fixture(scope="module", params=FRONTENDS, ids=FRONTEND_IDS)
def fuzz(tiny_dataset, tiny_model_pe, request):
    port = free_port()
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--grpc-port", str(port),
                        "--frontends", request.param).wait_ready()
    srv.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    srv.cases = 0
    srv.codes = collections.Counter()
    srv.before = good_inference(srv)
    yield srv
    srv.channel.close()
    assert srv.stop() == 0, srv.output()


def call(srv, method: str, body: bytes, metadata=()) -> tuple[grpc.StatusCode, str, bytes]:
    """One unary call of raw bytes: (status, details, response bytes)."""
    stub = srv.channel.unary_unary(f"/{SERVICE}/{method}")  # bytes in, bytes out
    try:
        return grpc.StatusCode.OK, "", stub(body, timeout=TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", b""


def good_inference(srv) -> bytes:
    req = message("ModelInferRequest")(model_name="hybridgnn", parameters={"mode": param(string_param="precomputed")})
    req.inputs.add(name="node_ids", datatype="INT64", shape=[3])
    req.raw_input_contents.append(np.array([0, 17, 2999], np.int64).tobytes())
    code, details, answer = call(srv, "ModelInfer", req.SerializeToString())
    assert code == grpc.StatusCode.OK, details
    return answer


def param(**kw):
    return message("InferParameter")(**kw)


@st.composite
def parameters(draw):
    out = {}
    for key in draw(st.lists(st.sampled_from(["mode", "gamma", "policy", "node_type", "binary_data", "x" * 300]),
                             max_size=3, unique=True)):
        kind = draw(st.sampled_from(["string_param", "int64_param", "bool_param", "double_param", "uint64_param"]))
        value = {"string_param": st.sampled_from(MODES + ["ratio", "degree", "\x00", "a" * 10_000]),
                 "int64_param": st.integers(-2**63, 2**63 - 1), "bool_param": st.booleans(),
                 "double_param": st.floats(allow_nan=True, allow_infinity=True),
                 "uint64_param": st.integers(0, 2**64 - 1)}[kind]
        out[key] = param(**{kind: draw(value)})
    return out


@st.composite
def infer_requests(draw) -> bytes:
    req = message("ModelInferRequest")(
        model_name=draw(st.sampled_from(["hybridgnn"] * 12 + ["nope", "", "../etc", "h" * 5000])),
        model_version=draw(st.sampled_from([""] * 8 + ["1"] * 4 + ["2", "-1", "latest"])),
        id=draw(st.sampled_from(["", "req-1", "\x00\xff".encode("latin-1").decode("latin-1"), "i" * 3000])))
    for key, value in draw(parameters()).items():
        req.parameters[key].CopyFrom(value)
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(st.one_of(st.integers(-2, 70), st.integers(-2**63, 2**63 - 1)), max_size=3))
        t = req.inputs.add(name=draw(st.sampled_from(NAMES)), datatype=datatype, shape=shape)
        if raw:
            n = draw(st.integers(0, 80))
            values = draw(st.one_of(
                st.binary(min_size=0, max_size=n),
                st.lists(st.integers(-5, 60_000), max_size=16).map(lambda v: np.array(v, np.int64).tobytes()),
                st.lists(st.floats(width=32), max_size=16).map(lambda v: np.array(v, np.float32).tobytes())))
            req.raw_input_contents.append(values)
        else:
            field = draw(st.sampled_from(["int64_contents", "int_contents", "fp32_contents", "bytes_contents",
                                          "uint64_contents", "bool_contents", None]))
            if field is not None:
                element = {"int64_contents": st.integers(-2**63, 2**63 - 1), "int_contents": st.integers(-2**31, 2**31 - 1),
                           "fp32_contents": st.floats(width=32), "bytes_contents": st.binary(max_size=12),
                           "uint64_contents": st.integers(0, 2**64 - 1), "bool_contents": st.booleans()}[field]
                getattr(t.contents, field).extend(draw(st.lists(element, max_size=20)))
    if raw and draw(st.integers(0, 9)) == 0:  # one raw tensor too many
        req.raw_input_contents.append(b"\x01" * 8)
    for name in draw(st.lists(st.sampled_from(["logits", "embeddings", "predictions", "nope", ""]), max_size=4)):
        req.outputs.add(name=name)
    return req.SerializeToString()


@st.composite
def nearly_valid_requests(draw) -> bytes:
    """Requests a client meant well: ids or a new node's tensors of consistent shapes, one
    thing at a time wrong (an id out of range, a mode, an output), so the cases reach the
    engine's paths and not only the decoder."""
    req = message("ModelInferRequest")(model_name="hybridgnn")
    for key, value in draw(parameters()).items():
        req.parameters[key].CopyFrom(value)
    if draw(st.booleans()):
        ids = np.array(draw(st.lists(st.integers(-1, 3000), min_size=1, max_size=40)), np.int64)
        req.inputs.add(name="node_ids", datatype="INT64", shape=[len(ids)])
        req.raw_input_contents.append(ids.tobytes())
    else:
        n = draw(st.integers(1, 3))
        feats = np.array(draw(st.lists(st.floats(-10, 10, width=32), min_size=16 * n, max_size=16 * n)), np.float32)
        e = draw(st.integers(0, 6))
        edges = np.array(draw(st.lists(st.integers(-1, 3000 + n), min_size=2 * e, max_size=2 * e)), np.int64)
        req.inputs.add(name="features", datatype="FP32", shape=[n, 16])
        req.inputs.add(name="edge_index", datatype="INT64", shape=[2, e])
        req.raw_input_contents.extend([feats.tobytes(), edges.tobytes()])
    for name in draw(st.lists(st.sampled_from(["logits", "embeddings", "predictions", "nope"]), max_size=3)):
        req.outputs.add(name=name)
    return req.SerializeToString()


def check(srv, method: str, body: bytes, metadata=()) -> None:
    code, details, answer = call(srv, method, body, metadata)
    srv.cases += 1
    srv.codes[code] += 1
    assert srv.proc.poll() is None, f"the server died on {method} {body[:200]!r}:\n{srv.output()}"
    assert code in ANSWERABLE, f"{method} {body[:200]!r} -> {code.name}: {details}"
    assert code == grpc.StatusCode.OK or details.strip(), f"{method} {body[:200]!r} -> {code.name} without a message"


@fuzz_settings(500)
@given(body=st.one_of(infer_requests(), nearly_valid_requests()))
def test_infer_messages(fuzz, body):
    check(fuzz, "ModelInfer", body)


@fuzz_settings(150)
@given(body=st.one_of(st.binary(max_size=300), infer_requests().map(lambda b: b[: len(b) // 2])),
       method=st.sampled_from(["ModelInfer"] + METHOD_NAMES))
def test_bytes_that_are_not_the_message(fuzz, body, method):
    check(fuzz, method, body)


@fuzz_settings(150)
@given(method=st.sampled_from(METHOD_NAMES), name=st.sampled_from(["hybridgnn", "nope", "", "../x", "n" * 4000]),
       version=st.sampled_from(["", "1", "2", "x"]), auth=st.sampled_from([(), (("authorization", "Bearer x"),)]))
def test_metadata_and_repository_methods(fuzz, method, name, version, auth):
    request, _ = {"ModelMetadata": ("ModelMetadataRequest", 0), "ModelReady": ("ModelReadyRequest", 0),
                  "ModelConfig": ("ModelConfigRequest", 0), "ModelStatistics": ("ModelStatisticsRequest", 0),
                  "RepositoryModelLoad": ("RepositoryModelLoadRequest", 1),
                  "RepositoryModelUnload": ("RepositoryModelUnloadRequest", 1),
                  "RepositoryIndex": ("RepositoryIndexRequest", 2), "ServerMetadata": ("ServerMetadataRequest", 2)}[method]
    cls = message(request)
    fields = {f.name for f in cls.DESCRIPTOR.fields}
    kw = {k: v for k, v in (("name", name), ("model_name", name), ("version", version)) if k in fields}
    check(fuzz, method, cls(**kw).SerializeToString(), auth)


def test_server_unchanged_after_fuzzing(fuzz):
    assert fuzz.proc.poll() is None
    assert good_inference(fuzz) == fuzz.before
    assert fuzz.cases >= 800 or fuzz.cases == 0  # 0: run alone (-k)
    if fuzz.cases:  # the cases reach the service: some are served, some refused for each reason
        reached = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
        assert reached <= set(fuzz.codes), fuzz.codes
