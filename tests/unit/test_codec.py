import json
import sys

import numpy as np
import pytest

from hybridgnn.errors import BadRequest
from hybridgnn.serving.http import codec
from hybridgnn.serving.http.codec import HEADER_LENGTH
from tests.support.v2_codec import decode_infer_request, encode_infer_response

try:
    import orjson
except ImportError:  # optional: the stdlib parser is then the only one
    orjson = None


@pytest.fixture(autouse=True, params=["stdlib", "orjson"])
def json_backend(request, monkeypatch):
    """Every codec test runs with the stdlib JSON parser and with orjson (when installed)."""
    if request.param == "orjson":
        if orjson is None:
            pytest.skip("orjson is not installed")
        monkeypatch.setattr(codec, "_orjson", orjson)
    else:
        monkeypatch.setattr(codec, "_orjson", None)
    return request.param


def decode(obj, header=None, body=None, max_nodes=100, num_nodes=50, feature_dim=None):
    raw = body if body is not None else json.dumps(obj).encode()
    return decode_infer_request(raw, header, max_nodes=max_nodes, num_nodes=num_nodes, feature_dim=feature_dim)


def req(data, shape=None, datatype="INT64", **extra):
    return {"inputs": [{"name": "node_ids", "shape": shape if shape is not None else [len(data)],
                        "datatype": datatype, "data": data}], **extra}


def test_json_request():
    r = decode(req([1, 2, 3], id="abc"))
    assert r.node_ids.tolist() == [1, 2, 3] and r.node_ids.dtype == np.int64
    assert r.request_id == "abc" and r.outputs == {"logits": False, "embeddings": False, "predictions": False}
    assert decode(req([[4, 5]], shape=[1, 2])).node_ids.tolist() == [4, 5]


def test_binary_request_and_outputs():
    ids = np.array([3, 4, 49], dtype="<i8")
    header = json.dumps({"inputs": [{"name": "node_ids", "shape": [3], "datatype": "INT64",
                                     "parameters": {"binary_data_size": 24}}],
                         "outputs": [{"name": "predictions", "parameters": {"binary_data": True}}]}).encode()
    r = decode(None, header=str(len(header)), body=header + ids.tobytes())
    assert r.node_ids.tolist() == [3, 4, 49] and r.outputs == {"predictions": True}


@pytest.mark.parametrize("body, match", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1]", "JSON object"),
    (json.dumps({"inputs": []}).encode(), "non-empty 'inputs'"),
    (json.dumps(req([1], datatype="FP32")).encode(), "datatype INT64"),
    (json.dumps(req([1.5], datatype="INT64")).encode(), "integers only"),
    (json.dumps(req([1, 2], shape=[3])).encode(), "holds 2"),
    (json.dumps(req([1, 2], shape=[2, 2])).encode(), "1-D"),
    (json.dumps(req([[[[1]]]], shape=[1])).encode(), r"nested as \[1, 1, 1, 1\], not as its shape \[1\]"),
    (json.dumps(req([[1, 2]], shape=[2, 1])).encode(), "nested as"),
    (json.dumps(req([1], shape="x")).encode(), "shape"),
    (json.dumps(req([-1])).encode(), ">= 0"),
    (json.dumps(req([50])).encode(), "out of range"),
    (json.dumps(req([])).encode(), "empty"),
    (json.dumps(req(list(range(101)))).encode(), "at most 100"),
    (json.dumps(req(["a"])).encode(), "integers only"),
    (json.dumps(req([2**70])).encode(), "integer"),  # orjson: past its integers; stdlib: named as beyond int64
    (json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [1]}]}).encode(), "unknown input"),
    (json.dumps({**req([1]), "outputs": [{"name": "hidden"}]}).encode(), "unknown output"),
    (json.dumps({**req([1]), "outputs": ["logits"]}).encode(), r"each output must be an object with a 'name'"),
    (json.dumps({**req([1]), "outputs": [{"name": "logits", "parameters": 1}]}).encode(), "parameters"),
    (json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64"}]}).encode(), "neither 'data'"),
])
def test_bad_requests(body, match):
    with pytest.raises(BadRequest, match=match) as info:
        decode(None, body=body)
    assert info.value.status == 400


def test_bad_binary_sizes():
    header = json.dumps({"inputs": [{"name": "node_ids", "shape": [2], "datatype": "INT64",
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    with pytest.raises(BadRequest, match="needs 16 bytes"):
        decode(None, header=str(len(header)), body=header + b"\0" * 8)
    with pytest.raises(BadRequest, match="does not fit"):
        decode(None, header="99999", body=header)
    for lenient in ("x", "+78", "7_8", " 78", "-1", "٣"):  # int() reads all but x and -1 (a 400 later)
        with pytest.raises(BadRequest, match=r"must be a byte count \(digits\)"):
            decode(None, header=lenient, body=header)
    # values in 'data' as well as in the binary tail: one would be ignored
    both = json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [7],
                                   "parameters": {"binary_data_size": 8}}]}).encode()
    with pytest.raises(BadRequest, match="node_ids.*both 'data' and binary_data_size"):
        decode(None, header=str(len(both)), body=both + np.array([1], "<i8").tobytes())


def test_encode_json_and_binary():
    emb = np.arange(6, dtype=np.float32).reshape(3, 2)
    pred = np.array([1, 0, 1], dtype=np.int64)
    body, headers = encode_infer_response("m", "7", {"embeddings": emb, "predictions": pred},
                                          {"embeddings": False, "predictions": False})
    out = json.loads(body)
    assert out["id"] == "7" and out["outputs"][0]["shape"] == [3, 2]
    assert out["outputs"][0]["data"] == emb.reshape(-1).tolist()
    body, headers = encode_infer_response("m", None, {"embeddings": emb, "predictions": pred},
                                          {"embeddings": True, "predictions": False})
    hlen = int(headers[HEADER_LENGTH])
    head = json.loads(body[:hlen])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 24
    assert np.array_equal(np.frombuffer(body[hlen:], dtype="<f4").reshape(3, 2), emb)


def test_fuzzed_bodies_only_ever_raise_bad_request():
    rng = np.random.default_rng(0)
    pieces = [None, 1, -1, 2**65, 1.5, "x", [], {}, [1, 2], {"a": 1}, True, "INT64", "FP32", [[1]], [-1],
              [2, 1], [1, 4], [[0.5, 1, 2, 3]], [[50], [3]], [float("nan")] * 4]
    for _ in range(2000):
        if rng.random() < 0.3:
            body, header = rng.bytes(int(rng.integers(0, 64))), None
            if rng.random() < 0.3:
                header = str(int(rng.integers(-5, 80)))
        else:
            inp = {k: pieces[int(rng.integers(len(pieces)))] for k in ("name", "shape", "datatype", "data", "parameters")
                   if rng.random() < 0.8}
            if rng.random() < 0.6:
                inp["name"] = ["node_ids", "features", "edge_index"][int(rng.integers(3))]
            doc = {"inputs": [inp] if rng.random() < 0.9 else pieces[int(rng.integers(len(pieces)))]}
            if rng.random() < 0.3:
                doc["outputs"] = pieces[int(rng.integers(len(pieces)))]
            if rng.random() < 0.3:
                doc["parameters"] = pieces[int(rng.integers(len(pieces)))]
            if rng.random() < 0.3:
                doc["inputs"] = [inp, {**inp, "name": "edge_index", "datatype": "INT64"}]
            body, header = json.dumps(doc).encode(), None
        try:
            r = decode_infer_request(body, header, max_nodes=100, num_nodes=50, feature_dim=4)
            if r.is_new_nodes:
                assert r.features.shape[1] == 4 and np.isfinite(r.features).all()
                assert r.edge_index.shape[0] == 2
            else:
                assert r.node_ids.dtype == np.int64 and 0 < r.node_ids.size <= 100
                assert r.node_ids.min() >= 0 and r.node_ids.max() < 50
        except BadRequest:
            pass


def test_new_node_requests():
    feats = [[0.0, 1.0], [2.0, 3.0]]
    doc = {"inputs": [{"name": "features", "shape": [2, 2], "datatype": "FP32", "data": feats},
                      {"name": "edge_index", "shape": [2, 3], "datatype": "INT64", "data": [[50, 51, 50], [3, 4, 51]]}],
           "parameters": {"mode": "srpe", "gamma": 0.2}}
    r = decode(doc, feature_dim=2)
    assert r.is_new_nodes and r.num_outputs == 2 and r.features.dtype == np.float32
    assert r.edge_index.tolist() == [[50, 51, 50], [3, 4, 51]]
    bad = [
        ({**doc, "inputs": doc["inputs"][:1]}, "needs both"),
        ({**doc, "inputs": doc["inputs"] + [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}]},
         "not both"),
        ({**doc, "inputs": [{**doc["inputs"][0], "shape": [1, 4], "data": [[1, 2, 3, 4]]}, doc["inputs"][1]]},
         "2 columns"),
        ({**doc, "inputs": [doc["inputs"][0], {**doc["inputs"][1], "data": [[50, 60, 50], [3, 4, 51]]}]},
         "must lie in"),
        ({**doc, "inputs": [doc["inputs"][0], {**doc["inputs"][1], "data": [[1, 51, 50], [3, 4, 51]]}]},
         "joins two existing"),
        ({**doc, "inputs": [doc["inputs"][0], {**doc["inputs"][1], "shape": [3, 2]}]}, "[2, m]"),
        ({**doc, "inputs": [{**doc["inputs"][0], "datatype": "INT64"}, doc["inputs"][1]]}, "FP32"),
        # rows nested another way than the shape says: reshaped, values would move
        ({**doc, "inputs": [doc["inputs"][0], {**doc["inputs"][1], "data": [[50, 3], [51, 4], [50, 51]]}]},
         "holds 3 entries at its top level"),
        ({**doc, "inputs": [doc["inputs"][0], {**doc["inputs"][1], "data": [[[50], [3], [51]], [[4], [50], [51]]]}]},
         "nested as [2, 3, 1], not as its shape [2, 3]"),
    ]
    for body_doc, match in bad:
        with pytest.raises(BadRequest, match=match.replace("[", r"\[").replace("]", r"\]")):
            decode(body_doc, feature_dim=2)


def test_query_nodes_named_by_position_are_the_ids_after_the_graph():
    # -1 is the first query node (num_nodes = 50 here), as in graph updates
    feats = [[0.0, 1.0], [2.0, 3.0]]
    doc = {"inputs": [{"name": "features", "shape": [2, 2], "datatype": "FP32", "data": feats},
                      {"name": "edge_index", "shape": [2, 3], "datatype": "INT64", "data": [[-1, -2, 50], [3, 4, -2]]}]}
    assert decode(doc, feature_dim=2).edge_index.tolist() == [[50, 51, 50], [3, 4, 51]]
    doc["inputs"][1]["data"] = [[-3, -2, 50], [3, 4, -2]]
    with pytest.raises(BadRequest, match=r"or name query nodes -1\.\.-2; found \[-3, 50\]"):
        decode(doc, feature_dim=2)
    doc["inputs"][1]["data"] = [[-1, 3, 50], [3, 4, -2]]
    with pytest.raises(BadRequest, match="edge 1 joins two existing"):
        decode(doc, feature_dim=2)


def test_json_nested_too_deeply_is_a_400(json_backend):
    # orjson refuses beyond 1024 levels, then the stdlib parser recurses out (RecursionError);
    # from Python 3.12 (a higher C recursion limit) it parses 1,100 levels, which are then
    # refused as the lists they are: a 400 either way
    for depth in (1100, 100_000):
        body = b'{"inputs": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(BadRequest) as info:
            decode(None, body=body)
        assert info.value.status == 400
        if depth > 1100 or sys.version_info < (3, 12):
            assert "nested too deeply" in info.value.message
        else:
            assert info.value.message in ("request body is not valid JSON: nested too deeply",
                                          "each input must be an object with name, shape, datatype and data")
    # within orjson's limit it parses; whatever repr the message shows stays short
    deep = b"[" * 1000 + b"]" * 1000
    with pytest.raises(BadRequest) as info:
        decode(None, body=b'{"inputs": [{"name": ' + deep + b"}]}")
    assert len(info.value.message) < 400


def test_integer_literal_past_the_digit_limit_is_a_400():
    body = b'{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [' + b"7" * 5000 + b"]}]}"
    with pytest.raises(BadRequest, match="more than 4300 digits") as info:
        decode(None, body=body)
    assert info.value.status == 400
    body = b'{"inputs": [{"name": "node_ids", "shape": [' + b"9" * 4000 + b'], "datatype": "INT64", "data": [1]}]}'
    with pytest.raises(BadRequest, match="shape"):
        decode(None, body=body)


@pytest.mark.parametrize("rid, want", [("a", "a"), (7, "7"), (None, None)])
def test_request_id_is_text(rid, want):
    assert decode(req([1], id=rid)).request_id == want


@pytest.mark.parametrize("body", [
    json.dumps(req([1], id=[1, 2])).encode(),
    json.dumps(req([1], id="\ud800")).encode(),  # a lone surrogate: the answer could not carry it
    json.dumps(req([1], shape=[True])).encode(),
])
def test_unusable_ids_and_shapes_are_400(body):
    with pytest.raises(BadRequest):
        decode(None, body=body)


def _names_map():
    from hybridgnn.graph.idmap import IdMap

    return IdMap(np.array(["alice", "bob", "carol", "dave"]))


def _bytes_blob(names):
    return b"".join(len(n.encode()).to_bytes(4, "little") + n.encode() for n in names)


def test_named_ids_json_and_binary_map_to_internal_ids_and_echo():
    id_map = _names_map()
    body = json.dumps({"inputs": [{"name": "node_ids", "datatype": "BYTES", "shape": [3],
                                   "data": ["dave", "alice", "dave"]}]}).encode()
    req = decode_infer_request(body, None, max_nodes=10, num_nodes=4, id_map=id_map)
    assert req.node_ids.tolist() == [3, 0, 3] and req.external_ids.tolist() == ["dave", "alice", "dave"]
    assert set(req.outputs) == {"logits", "embeddings", "predictions", "node_ids"}
    blob = _bytes_blob(["carol", "bob"])
    head = json.dumps({"inputs": [{"name": "node_ids", "datatype": "BYTES", "shape": [2],
                                   "parameters": {"binary_data_size": len(blob)}}],
                       "outputs": [{"name": "node_ids", "parameters": {"binary_data": True}}]}).encode()
    req = decode_infer_request(head + blob, str(len(head)), max_nodes=10, num_nodes=4, id_map=id_map)
    assert req.node_ids.tolist() == [2, 1]
    out, headers = encode_infer_response("m", None, {"node_ids": req.external_ids}, req.outputs)
    n = int(headers[HEADER_LENGTH])
    entry = json.loads(out[:n])["outputs"][0]
    assert entry["datatype"] == "BYTES" and out[n:] == blob
    out, _ = encode_infer_response("m", None, {"node_ids": req.external_ids}, {"node_ids": False})
    assert json.loads(out)["outputs"][0]["data"] == ["carol", "bob"]


@pytest.mark.parametrize("inp, match", [
    ({"datatype": "BYTES", "shape": [2], "data": ["bob", "zed"]}, "unknown node id 'zed'"),
    ({"datatype": "INT64", "shape": [1], "data": [1]}, "must be BYTES"),
    ({"datatype": "BYTES", "shape": [2], "data": ["bob", 3]}, "per row. of 2 strings"),
    ({"datatype": "BYTES", "shape": [1], "data": ["x" * 2000]}, "at most 1024"),
    ({"datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 7}}, "ends inside element|claims"),
])
def test_bad_named_ids_are_clear_400s(inp, match):
    body = {"inputs": [{"name": "node_ids", **inp}]}
    head = json.dumps(body).encode()
    tail = b"\x03\x00\x00\x00bob" if "parameters" in inp else b""
    with pytest.raises(BadRequest, match=match):
        decode_infer_request(head + tail, str(len(head)) if tail else None, max_nodes=10, num_nodes=4,
                             id_map=_names_map())


def test_names_on_a_dense_dataset_and_unnamed_new_nodes_on_a_mapped_one_are_refused():
    body = json.dumps({"inputs": [{"name": "node_ids", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}).encode()
    with pytest.raises(BadRequest, match="must be INT64 here"):
        decode_infer_request(body, None, max_nodes=10, num_nodes=4)
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 2], "data": [0, 0]},
                                  {"name": "edge_index", "datatype": "INT64", "shape": [2, 0], "data": []}]}).encode()
    with pytest.raises(BadRequest, match="query_ids"):
        decode_infer_request(body, None, max_nodes=10, num_nodes=4, feature_dim=2, id_map=_names_map())
    with pytest.raises(BadRequest, match="query_ids and BYTES ids are for datasets imported with an id map"):
        decode_infer_request(body.replace(b'"edge_index"', b'"query_ids", "datatype": "INT64", "shape": [1], '
                                          b'"data": [9]}, {"name": "edge_index"'), None, max_nodes=10, num_nodes=4,
                             feature_dim=2)


def test_sparse_integer_ids_map_too():
    from hybridgnn.graph.idmap import IdMap

    id_map = IdMap(np.array([1, 2, 3, 2_000_000]))
    body = json.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [2],
                                   "data": [2_000_000, 1]}]}).encode()
    req = decode_infer_request(body, None, max_nodes=10, num_nodes=4, id_map=id_map)
    assert req.node_ids.tolist() == [3, 0] and req.external_ids.tolist() == [2_000_000, 1]
    with pytest.raises(BadRequest, match="unknown node id 0"):
        decode_infer_request(body.replace(b"2000000", b"0"), None, max_nodes=10, num_nodes=4, id_map=id_map)


@pytest.mark.parametrize("header, expected", [
    ({"inputs": [{"name": "node_ids", "shape": [64], "datatype": "INT64"}]}, 64),
    ({"inputs": [{"name": "node_ids", "shape": [1, 5]}], "parameters": {"mode": "sampled"}}, 5),
    ({"inputs": [{"name": "node_ids", "shape": [1, 5]}], "parameters": {"mode": "precomputed"}}, None),
    ({"inputs": [], "parameters": {"mode": "srpe"}}, None),
    ({"inputs": [{"name": "features", "shape": [2, 8]}, {"name": "node_ids", "shape": [1, 5]}]}, None),
    ({"inputs": [{"name": "edge_index", "shape": [2, 8]}]}, None),
    ({"inputs": [{"name": "node_ids", "shape": "64"}]}, 0),
    ({"inputs": [{"name": "node_ids", "shape": [True, 3]}]}, 0),
    ({"inputs": [{"name": "node_ids", "shape": [-1]}]}, 0),
    ({"inputs": [{"name": "node_ids", "shape": [1 << 60]}]}, 0),
    ({"inputs": "node_ids"}, 0),
    ({"inputs": [{"name": "node_ids", "shape": [3]}], "parameters": "mode"}, 3),  # the decoder refuses it
    ([1, 2], 0),
])
def test_declared_ids_reads_the_shape_without_validating(header, expected):
    """What admission judges a request by before decoding it: the node_ids input's shape,
    0 whenever that is not a list of sizes (the decoder then says what is wrong), None
    for a request that is not a sampled inference of existing nodes."""
    from hybridgnn.serving.http.codec import parse_infer
    from hybridgnn.serving.v2.inference import declared_ids

    try:
        request, _ = parse_infer(json.dumps(header).encode(), None, "m", None)
    except BadRequest:  # not a body the codec can read: answered before admission judges it
        assert expected == 0
        return
    assert declared_ids(request) == expected


def test_a_large_body_parses_without_collections_and_leaves_the_collector_on(json_backend):
    import gc
    rows = 50_000  # one list each: enough to set off generation-0 collections many times
    body = b'{"inputs": [{"name": "node_ids", "shape": [%d, 1], "datatype": "INT64", "data": [' % rows \
        + b",".join([b"[1]"] * rows) + b"]}]}"
    assert len(body) >= codec.GC_PAUSE_BYTES
    runs = []
    gc.callbacks.append(lambda phase, info: runs.append(phase))
    try:
        header, _ = codec.split_body(body, None)
    finally:
        gc.callbacks.pop()
    assert len(header["inputs"][0]["data"]) == rows
    assert len(runs) <= 2 and gc.isenabled()  # at most the one collection the parse left due, after it
    with pytest.raises(BadRequest):  # an error leaves it on too
        codec.split_body(body[:-3], None)
    assert gc.isenabled()


@pytest.mark.parametrize("params, outputs", [
    ({"binary_data_output": "yes"}, None), ({"binary_data_output": 0}, None),
    ({}, [{"name": "logits", "parameters": {"binary_data": "false"}}])])
def test_binary_switches_take_true_or_false_only(params, outputs):
    from hybridgnn.serving.http.codec import parse_infer

    header = {"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}], "parameters": params}
    if outputs is not None:
        header["outputs"] = outputs
    with pytest.raises(BadRequest, match="must be true or false"):
        parse_infer(json.dumps(header).encode(), None, "m", None)
    header.pop("outputs", None)
    header["parameters"] = {"binary_data_output": True}
    assert parse_infer(json.dumps(header).encode(), None, "m", None)[1] is True


def test_a_repository_load_body_gives_its_parameters_or_a_400():
    assert codec.parse_load(b"") is None and codec.parse_load(b" \n") is None
    assert codec.parse_load(b'{"parameters": {"config": "{}"}}') == {"config": "{}"}
    assert codec.parse_load(b"{}") is None
    for bad in (b"[]", b'{"parameters": 3}', b"{nope"):
        with pytest.raises(BadRequest):
            codec.parse_load(bad)


def test_json_outputs_read_back_as_the_same_values_and_float32_in_its_shortest_form():
    """orjson writes the arrays straight from memory (2-3x cheaper than lists of Python
    numbers for large answers); a float32 is written in its shortest form, which reads
    back as the same float32, where its float64 expansion took about 40% more bytes."""
    from hybridgnn.serving.http.codec import encode_infer_response
    from hybridgnn.serving.v2.types import InferAnswer

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((64, 7)) * 10.0 ** rng.integers(-30, 30, (64, 7))).astype(np.float32)
    logits[0, :3] = [0.1, 1 / 3, 3.4e38]
    ids = np.array([0, 2**62, -5], np.int64)
    body, _ = encode_infer_response(InferAnswer("m", "1", None, [("logits", logits), ("predictions", ids)]), False)
    outs = {o["name"]: o for o in json.loads(body)["outputs"]}
    assert np.array_equal(np.asarray(outs["logits"]["data"], np.float32).reshape(64, 7), logits)
    assert outs["predictions"]["data"] == ids.tolist() and outs["logits"]["datatype"] == "FP32"
    if codec._orjson is not None:  # the standard library's encoder writes each float64's expansion
        assert b"[0.1,0.33333334,3.4e+38," in body


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.bool_])
def test_a_large_output_is_written_in_steps_with_the_bytes_of_one_call(json_backend, dtype, monkeypatch):
    """encode_infer_steps yields between pieces of a large JSON output's data (the loop runs
    between them); the body is the one a single encoder call writes, whatever the sizes
    against the piece, binary outputs beside it included."""
    from hybridgnn.serving.http.codec import (
        encode_infer_response,
        encode_infer_steps,
        takes_turns,
    )
    from hybridgnn.serving.v2.types import InferAnswer

    rng = np.random.default_rng(1)
    for n in (99, 100, 101, 1000, 1234):
        arr = (rng.standard_normal(n) * 1000).astype(dtype).reshape(n, 1)
        for binary in (False, {"y": True}):
            answer = InferAnswer("m", "1", "rid", [("x", arr), ("y", arr[:7]), ("z", arr[:3])])
            monkeypatch.setattr(codec, "_PIECE_VALUES", 1 << 40)
            whole = encode_infer_response(answer, binary)
            assert not takes_turns(answer, binary)
            monkeypatch.setattr(codec, "_PIECE_VALUES", 100)
            assert takes_turns(answer, binary) == (n > 100)
            steps, turns = encode_infer_steps(answer, binary), 0
            while True:
                try:
                    next(steps)
                    turns += 1
                except StopIteration as stop:
                    got = stop.value
                    break
            assert got == whole and turns == (-(-n // 100) + 1 if n > 100 else 0), (n, turns)


def test_a_request_id_holding_the_splice_mark_is_written_whole(monkeypatch):
    """The id is the client's: one that holds the mark a large output's data is spliced at
    must not move the data into it."""
    from hybridgnn.serving.http.codec import encode_infer_response
    from hybridgnn.serving.v2.types import InferAnswer

    monkeypatch.setattr(codec, "_PIECE_VALUES", 10)
    arr = np.arange(100, dtype=np.int64).reshape(50, 2)
    for rid in ("\x00hybridgnn-data-0\x00", "x\x00hybridgnn-data-1\x00", None, "plain"):
        body, _ = encode_infer_response(InferAnswer("m", "1", rid, [("a", arr), ("b", arr[:3])]), False)
        out = json.loads(body)
        assert out.get("id") == rid and [o["data"] for o in out["outputs"]] == [list(range(100)), list(range(6))]
