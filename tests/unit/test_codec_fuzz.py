"""Property: whatever body and Inference-Header-Content-Length a client sends, decoding
either succeeds (and the answer can be encoded) or raises a ServingError with a 4xx status
and a short message; never KeyError, TypeError, IndexError, RecursionError or the like
(those would be 500s, reserved for bugs)."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgnn.errors import ServingError
from hybridgnn.serving.http import codec
from hybridgnn.serving.v2.tensors import DTYPES
from hybridgnn.updates.requests import UPDATE_INPUTS, build_request
from tests.support.v2_codec import (
    decode_infer_request,
    decode_update_request,
    encode_infer_response,
)

try:
    import orjson
except ImportError:  # optional: the stdlib parser is then the only one
    orjson = None

NUM_NODES, FEATURE_DIM, MAX_NODES = 50, 4, 16
NAMES = ["node_ids", "features", "edge_index", *UPDATE_INPUTS, "x", ""]
DATATYPES = ["INT64", "INT32", "FP32", "UINT64", "BOOL", "BYTES", None]

ints = st.one_of(st.integers(-3, NUM_NODES + 3), st.integers(), st.sampled_from([2**63 - 1, 2**63, -(2**63), 2**64]))
numbers = st.one_of(ints, st.floats(allow_nan=True, allow_infinity=True), st.booleans())
scalars = st.one_of(st.none(), numbers, st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=12)
shapes = st.one_of(st.lists(st.integers(0, 6), max_size=3), st.lists(ints, max_size=3), json_values)
data = st.one_of(st.lists(numbers, max_size=12), st.lists(st.lists(numbers, max_size=5), max_size=4), json_values)
parameters = st.one_of(
    st.fixed_dictionaries({}, optional={"binary_data_size": st.one_of(st.integers(-2, 64), json_values),
                                        "binary_data": st.booleans()}),
    json_values)


# name -> (kind of values, layout): what a well-formed tensor of that name looks like
LAYOUTS = {"node_ids": ("id", "ids"), "features": ("float", "matrix"), "edge_index": ("id", "edges"),
           "add_edges": ("id", "pairs"), "remove_edges": ("id", "pairs"), "add_node_features": ("float", "matrix"),
           "remove_nodes": ("id", "ids"), "update_ids": ("id", "ids"), "update_features": ("float", "matrix"),
           "add_node_ids": ("id", "ids")}


@st.composite
def tensors(draw, name: str, tail: list):
    """One input: mostly well-formed for its name (so decoding gets past the first checks),
    then perhaps one field bent. Binary inputs append their bytes to tail."""
    kind, layout = LAYOUTS[name]
    n = draw(st.integers(0, 5))
    width = draw(st.sampled_from([FEATURE_DIM] * 6 + [0, FEATURE_DIM + 1]))
    shape = {"ids": [n], "matrix": [n, width], "edges": [2, n], "pairs": [n, 2]}[layout]
    count = int(np.prod(shape))
    if kind == "id":
        values = draw(st.lists(st.integers(-3, NUM_NODES + 6), min_size=count, max_size=count))
        datatype = draw(st.sampled_from(["INT64", "INT64", "INT32"]))
    else:
        values = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=count, max_size=count))
        if count and draw(st.integers(0, 9)) == 0:
            values[draw(st.integers(0, count - 1))] = draw(st.sampled_from([float("nan"), float("-inf"), float("inf")]))
        datatype = "FP32"
    arr = np.array(values, dtype=np.float32 if kind == "float" else np.int64).reshape(shape)
    inp = {"name": name, "datatype": datatype, "shape": shape}
    if draw(st.booleans()):
        raw = arr.astype(DTYPES[datatype]).tobytes()
        inp["parameters"] = {"binary_data_size": len(raw)}
        tail.append(raw)
    else:
        inp["data"] = arr.tolist() if draw(st.booleans()) else arr.reshape(-1).tolist()
    bend = draw(st.sampled_from([None] * 6 + ["name", "datatype", "shape", "data", "parameters", "drop",
                                              "size", "tail"]))
    if bend == "drop":
        inp.pop(draw(st.sampled_from(sorted(inp))))
    elif bend == "size" and "parameters" in inp:
        inp["parameters"]["binary_data_size"] = draw(st.integers(-2, 100) | json_values)
    elif bend == "tail" and tail:
        tail[-1] = tail[-1][:draw(st.integers(0, len(tail[-1])))] + draw(st.binary(max_size=9))
    elif bend == "shape":
        inp["shape"] = draw(shapes | st.just(shape[::-1]) | st.just([*shape, 1]) | st.just([max(0, shape[0] - 1)]))
    elif bend is not None:
        inp[bend] = draw(st.one_of(json_values, st.sampled_from(NAMES + DATATYPES)))
    return inp


@st.composite
def documents(draw, tail: list):
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)
    infer = st.sampled_from([["node_ids"]] * 3 + [["features", "edge_index"]] * 3 + [
        ["edge_index", "features"], ["features"], ["node_ids", "features", "edge_index"]])
    update = st.lists(st.sampled_from(list(UPDATE_INPUTS)), min_size=1, max_size=3) | st.sampled_from(
        [["update_ids", "update_features"], ["add_node_features", "add_edges"]])
    names = draw(update if draw(st.sampled_from("iiu")) == "u" else infer)
    if draw(st.integers(0, 9)):
        doc = {"inputs": [draw(tensors(name, tail)) for name in names]}
    else:
        doc = {"inputs": draw(json_values)}
    doc.update(draw(st.fixed_dictionaries({}, optional={
        "outputs": st.one_of(st.lists(st.fixed_dictionaries({"name": st.sampled_from(
            ["logits", "embeddings", "predictions", "hidden"])},
                                                             optional={"parameters": parameters}), max_size=3),
                             json_values),
        "parameters": st.integers(0, 4).flatmap(lambda i: json_values if i == 0 else st.fixed_dictionaries(
            {}, optional={"binary_data_output": st.booleans(), "mode": json_values})),
        "id": json_values})))
    return doc


@st.composite
def bodies(draw):
    """(body, Inference-Header-Content-Length or None): JSON, raw bytes, or a JSON header
    with a binary tail whose declared length may lie."""
    kind = draw(st.sampled_from(["json", "json", "binary", "binary", "binary", "raw", "mutated"]))
    if kind == "raw":
        return draw(st.binary(max_size=64)), draw(st.one_of(st.none(), st.integers(-5, 80).map(str)))
    tail: list[bytes] = []
    head = json.dumps(draw(documents(tail))).encode()  # NaN and Infinity as the stdlib writes them
    if kind == "mutated":  # a byte flipped or the text cut short
        if head and draw(st.booleans()):
            i = draw(st.integers(0, len(head) - 1))
            head = head[:i] + bytes([draw(st.integers(0, 255))]) + head[i + 1:]
        else:
            head = head[:draw(st.integers(0, len(head)))]
    if kind in ("json", "mutated"):
        return head, None
    body = head + b"".join(tail)
    length = draw(st.one_of(st.just(len(head)), st.just(len(head)), st.integers(-2, len(body) + 2),
                            st.sampled_from(["", "x", " 12", "1e3", "0x10", "9" * 5000, "-0", "+3", "1_0"])))
    return body, str(length)


def _check(body: bytes, header: str | None, use_orjson: bool) -> None:
    saved = codec._orjson
    codec._orjson = orjson if use_orjson else None
    try:
        try:
            r = decode_infer_request(body, header, max_nodes=MAX_NODES, num_nodes=NUM_NODES, feature_dim=FEATURE_DIM)
        except ServingError as exc:
            assert 400 <= exc.status < 500 and isinstance(exc.message, str) and len(exc.message) < 1000, exc.message
        else:
            if r.is_new_nodes:
                assert r.features.dtype == np.float32 and r.features.shape[1] == FEATURE_DIM
                assert 0 < r.features.shape[0] <= MAX_NODES and np.isfinite(r.features).all()
                assert r.edge_index.dtype == np.int64 and r.edge_index.shape[0] == 2
            else:
                assert r.node_ids.dtype == np.int64 and 0 < r.node_ids.size <= MAX_NODES
                assert 0 <= r.node_ids.min() and r.node_ids.max() < NUM_NODES
            n = r.num_outputs
            encode_infer_response("m", r.request_id, {"logits": np.zeros((n, 3), np.float32),
                                                      "embeddings": np.zeros((n, 5), np.float32),
                                                      "predictions": np.zeros(n, np.int64)}, r.outputs)
        try:
            u = decode_update_request(body, header, feature_dim=FEATURE_DIM, max_updates=32)
        except ServingError as exc:
            assert 400 <= exc.status < 500 and isinstance(exc.message, str) and len(exc.message) < 1000, exc.message
        else:
            assert 0 < u.num_updates <= 32
            u = build_request(u.logged.inputs, feature_dim=FEATURE_DIM, max_updates=32)  # what the log replays
            assert u.add_edges.shape[1] == 2 and u.remove_edges.shape[1] == 2
            assert u.add_node_features.shape[1] == FEATURE_DIM == u.update_features.shape[1]
            assert len(u.update_ids) == len(u.update_features)
    finally:
        codec._orjson = saved


@settings(max_examples=2000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies(), st.booleans())
def test_any_body_decodes_or_is_a_4xx(case, use_orjson):
    _check(*case, use_orjson=use_orjson and orjson is not None)


def test_nesting_and_long_integers_anywhere_are_4xx():
    for use_orjson in (False, True):
        for depth in (500, 1000, 1024, 1025, 3000):
            nest = b"[" * depth + b"]" * depth
            for body in (nest, b'{"inputs": ' + nest + b"}", b'{"id": ' + nest + b', "inputs": [1]}',
                         b'{"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": ' + nest + b"}]}",
                         b'{"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": ' + nest
                         + b"}]}", b'{"inputs": [{"name": ' + nest + b"}]}",
                         b'{"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}], '
                         b'"parameters": {"mode": ' + nest + b"}}"):
                _check(body, None, use_orjson and orjson is not None)
        big = b"9" * 4301
        for body in (big, b'{"id": ' + big + b"}", b'{"inputs": [{"name": "node_ids", "shape": [' + big + b"]}]}"):
            _check(body, None, use_orjson and orjson is not None)
