"""Decoding v2 input tensors: node names (BYTES) in JSON and binary form, the bound on
what names may cost once padded, and integers beyond INT64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.errors import BadRequest, PayloadTooLarge
from hybridgnn.serving.v2 import tensors
from hybridgnn.serving.v2.tensors import decode_tensor
from hybridgnn.serving.v2.types import Tensor


def _raw_names(names: list[str]) -> bytes:
    out = bytearray()
    for n in names:
        b = n.encode()
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


@pytest.mark.parametrize("binary", [False, True])
def test_names_decode_in_order_from_json_and_binary(binary):
    names = ["alice", "bob", "ünïcode", ""]
    t = (Tensor("node_ids", "BYTES", [4], raw=_raw_names(names)) if binary
         else Tensor("node_ids", "BYTES", [4], data=names))
    assert decode_tensor(t, ("BYTES",), "ids").tolist() == names


@pytest.mark.parametrize("binary", [False, True])
def test_a_name_is_bounded_by_its_utf8_bytes_in_json_as_in_binary(binary):
    """api.md: names of at most 1,024 bytes. JSON (and gRPC's typed contents) counted
    characters, so a name of 1,024 two-byte characters was taken there and refused in
    the binary layout."""
    def tensor(name):
        return (Tensor("node_ids", "BYTES", [1], raw=_raw_names([name])) if binary
                else Tensor("node_ids", "BYTES", [1], data=[name]))

    for name in ("é" * 512, "a" * 1024):
        assert decode_tensor(tensor(name), ("BYTES",), "ids").tolist() == [name]
    for name in ("é" * 513, "a" * 1025):
        with pytest.raises(BadRequest, match="1024 bytes|claims"):
            decode_tensor(tensor(name), ("BYTES",), "ids")


def test_a_json_name_with_a_lone_surrogate_is_measured_not_an_error():
    # JSON may carry "\ud800", which has no UTF-8 form: counted as 3 bytes, not a 500
    assert decode_tensor(Tensor("node_ids", "BYTES", [1], data=["\ud800" * 341]), ("BYTES",), "ids").size == 1
    with pytest.raises(BadRequest, match="1024 bytes"):
        decode_tensor(Tensor("node_ids", "BYTES", [1], data=["\ud800" * 342]), ("BYTES",), "ids")


@pytest.mark.parametrize("binary", [False, True])
def test_one_long_name_among_many_short_ones_is_refused_before_the_padded_array_is_made(binary, monkeypatch):
    monkeypatch.setattr(tensors, "MAX_NAMES_FIXED_WIDTH_BYTES", 1 << 20)
    names = ["a"] * 20_000 + ["x" * 1000]  # padded: 20,001 x 1,000 x 4 bytes = 80 MB from 40 kB of names
    t = (Tensor("edge_index", "BYTES", [2, 10_000 + 1], raw=_raw_names(names + ["b"])) if binary
         else Tensor("edge_index", "BYTES", [2, 10_000 + 1], data=names + ["b"]))
    with pytest.raises(PayloadTooLarge, match="padded to the longest"):
        decode_tensor(t, ("BYTES",), "edges")


def test_names_of_similar_lengths_pass_the_padding_bound_at_any_count(monkeypatch):
    monkeypatch.setattr(tensors, "MAX_NAMES_FIXED_WIDTH_BYTES", 1 << 10)
    names = [f"user-{i:06d}" for i in range(5_000)]  # padded 4x the characters: within the bound
    out = decode_tensor(Tensor("node_ids", "BYTES", [5_000], data=names), ("BYTES",), "ids")
    assert out.shape == (5_000,) and out[4_999] == "user-004999"


@pytest.mark.parametrize("value", [1 << 63, (1 << 64) - 1])
def test_an_integer_beyond_int64_is_named_not_wrapped_negative(value):
    t = Tensor("node_ids", "INT64", [2], data=[1, value])
    with pytest.raises(BadRequest, match=f"{value} is beyond the largest 64-bit signed integer"):
        decode_tensor(t, ("INT64", "INT32"), "ids")


def test_the_largest_int64_still_decodes():
    t = Tensor("node_ids", "INT64", [1], data=[(1 << 63) - 1])
    assert decode_tensor(t, ("INT64",), "ids").tolist() == [(1 << 63) - 1]


def test_an_integer_alone_beyond_int64_is_named_too():
    t = Tensor("node_ids", "INT64", [1], data=[(1 << 64) - 1])
    with pytest.raises(BadRequest, match="18446744073709551615 is beyond"):
        decode_tensor(t, ("INT64",), "ids")


def test_a_float_among_ids_is_still_called_a_float():
    t = Tensor("node_ids", "INT64", [2], data=[1, 2.5])
    with pytest.raises(BadRequest, match="integers only, found float64"):
        decode_tensor(t, ("INT64",), "ids")


def test_a_value_past_float32_decodes_to_inf_without_a_warning_on_the_servers_stderr():
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarning: overflow encountered in cast
        got = decode_tensor(Tensor("features", "FP32", [1, 2], data=[[1e39, 1.0]]), ("FP32",), "matrix")
    assert np.isinf(got[0, 0]) and got[0, 1] == 1.0  # then refused as not finite (400) where features are checked


def test_millions_of_rows_under_a_small_shape_are_refused_before_numpy_walks_them(monkeypatch):
    # numpy.asarray of 4M one-element lists takes ~0.6 s of the event loop; the top-level
    # length alone says the data cannot fit the shape
    walked = []
    monkeypatch.setattr(tensors.np, "asarray", lambda *a, **k: walked.append(1))
    with pytest.raises(BadRequest, match=r"shape \[1\] has 1 elements but 'data' holds 4000000 entries"):
        decode_tensor(Tensor("node_ids", "INT64", [1], [[1]] * 4_000_000), ("INT64",), "ids", limit=1 << 20)
    assert walked == []


@pytest.mark.parametrize("shape, data", [([2, 3], [[1, 2, 3], [4, 5, 6]]), ([2, 3], [1, 2, 3, 4, 5, 6]),
                                         ([6, 1], [1, 2, 3, 4, 5, 6]), ([1, 6], [[1, 2, 3, 4, 5, 6]]),
                                         ([0, 3], [])])
def test_data_flat_or_nested_as_its_shape_still_decodes(shape, data):
    arr = decode_tensor(Tensor("x", "INT64", shape, data), ("INT64",), "matrix")
    assert list(arr.shape) == shape and arr.reshape(-1).tolist() == [v for row in data for v in
                                                                    (row if isinstance(row, list) else [row])]


@pytest.mark.parametrize("data, shape, named", [([[1 << 70, 1], [2, 3]], [2, 2], f"{1 << 70} is beyond the largest"),
                                                ([1, -(1 << 70)], [2], f"{-(1 << 70)} is beyond the smallest"),
                                                ([1.5, 1 << 70], [2], f"{1 << 70} is beyond the largest")])
def test_an_integer_past_int64_that_makes_numpy_use_objects_is_named_too(data, shape, named):
    # it was "'data' must hold integers only, found object values"
    with pytest.raises(BadRequest, match=named):
        decode_tensor(Tensor("edge_index", "INT64", shape, data), ("INT64",), "matrix" if len(shape) > 1 else "ids")


def test_a_list_that_cannot_fit_its_shape_is_known_and_refused_by_its_length_alone():
    assert tensors.fits_its_shape(Tensor("x", "INT64", [2, 3], [[1, 2, 3], [4, 5, 6]]))
    assert tensors.fits_its_shape(Tensor("x", "INT64", "junk", [1]))  # left for decode_tensor to name
    assert not tensors.fits_its_shape(Tensor("x", "INT64", [2, 3], [[1, 2], [3, 4], [5, 6]]))
    # what crosses from a front end in its place is refused in the list's words
    with pytest.raises(BadRequest, match="shape \\[2, 3\\] has 6 elements but 'data' holds 3 entries"):
        decode_tensor(Tensor("x", "INT64", [2, 3], tensors.UnfitRows(3)), ("INT64",), "matrix")
    with pytest.raises(BadRequest, match="must have datatype INT64"):  # the checks before it come first
        decode_tensor(Tensor("x", "FP32", [2, 3], tensors.UnfitRows(3)), ("INT64",), "matrix")


def test_a_tensor_of_exactly_its_element_limit_passes_and_one_more_is_refused():
    assert decode_tensor(Tensor("node_ids", "INT64", [4], data=[0, 1, 2, 3]), ("INT64",), "ids", limit=4).size == 4
    with pytest.raises(PayloadTooLarge, match="declares 5 elements; the limit is 4"):
        decode_tensor(Tensor("node_ids", "INT64", [5], data=[0, 1, 2, 3, 4]), ("INT64",), "ids", limit=4)


def test_pairs_are_m_by_two():
    assert decode_tensor(Tensor("pairs", "INT64", [2, 2], data=[0, 1, 2, 3]), ("INT64",), "pairs").shape == (2, 2)
    with pytest.raises(BadRequest, match=r"must be \[m, 2\] \(source, target\) pairs, got shape \[2, 3\]"):
        decode_tensor(Tensor("pairs", "INT64", [2, 3], data=[0, 1, 2, 3, 4, 5]), ("INT64",), "pairs")


def test_new_node_limits_hold_at_their_bounds():
    import numpy as np

    from hybridgnn.serving.v2.tensors import validate_new_nodes

    def check(q, edges, **kw):
        args = dict(max_nodes=2, num_nodes=10, feature_dim=3, max_edges=2) | kw
        return validate_new_nodes(np.zeros((q, 3), np.float32), np.array(edges, np.int64).reshape(2, -1), **args)

    check(2, [[10, 11], [0, 0]])  # two query nodes and two edges: the limits themselves
    with pytest.raises(BadRequest, match="features has 3 query nodes; at most 2 per request"):
        check(3, [[10], [0]])
    with pytest.raises(BadRequest, match="edge_index has 3 edges; at most 2 per request"):
        check(1, [[10, 10, 10], [0, 1, 2]])
    _, ei = check(2, [[11, -2], [0, 1]])  # the last query node, by id and as -2
    assert ei.tolist() == [[11, 11], [0, 1]]
    with pytest.raises(BadRequest, match=r"edge_index ids must lie in \[0, 12\)"):
        check(2, [[12], [0]])  # one past the last query node


def test_query_ids_that_name_a_node_twice_are_refused():
    import numpy as np

    from hybridgnn.graph.idmap import IdMap
    from hybridgnn.serving.v2.tensors import map_query_edges

    id_map = IdMap(np.array(["alice", "bob"]))
    edges = np.array([["carol"], ["alice"]])
    internal, _ = map_query_edges({"query_ids": np.array(["carol"]), "edge_index": edges,
                                   "features": np.zeros((1, 2))}, id_map, 2)
    assert internal.tolist() == [[2], [0]]
    with pytest.raises(BadRequest, match="query_ids names a node twice"):
        map_query_edges({"query_ids": np.array(["carol", "carol"]), "edge_index": edges,
                         "features": np.zeros((2, 2))}, id_map, 2)


# What mutation testing showed unpinned: each test below failed with one small change to
# serving/v2/tensors.py that the tests above let pass.

def _ids(shape, **kw):
    return Tensor("node_ids", kw.pop("datatype", "INT64"), shape, **kw)


def test_a_dimension_of_2_48_is_refused_as_a_shape():
    with pytest.raises(BadRequest, match=r"each below 2\*\*48"):
        decode_tensor(_ids([1 << 48], data=[]), ("INT64",), "ids")


def test_a_shape_as_long_as_a_body_holds_is_refused_at_once_not_multiplied():
    """Its product took minutes on the event loop (a body of 16 MiB holds a million
    dimensions), and the message naming it raised past 4,300 digits: a 500."""
    import time

    from hybridgnn.serving.v2.inference import (
        check_declared_node_ids,
        declared_node_ids,
    )
    from hybridgnn.serving.v2.types import InferInput

    long = [(1 << 48) - 1] * 200_000
    request = InferInput("m", None, [_ids(long, data=[1])], {}, None, None)
    t0 = time.process_time()
    assert declared_node_ids(request) == 0 and check_declared_node_ids(request, 10) == 0
    with pytest.raises(BadRequest, match=r"a list of at most 8 non-negative integers"):
        decode_tensor(request.inputs[0], ("INT64",), "ids")
    assert time.process_time() - t0 < 0.5
    assert declared_node_ids(InferInput("m", None, [_ids([1] * 8, data=[1])], {}, None, None)) == 1


def test_a_boolean_id_is_not_taken_as_its_text():
    assert tensors.request_id(7) == "7"
    with pytest.raises(BadRequest, match="'id' must be a string, got bool"):
        tensors.request_id(True)


def test_an_input_sent_twice_is_refused_not_overwritten():
    t = _ids([1], data=[1])
    with pytest.raises(BadRequest, match="input 'node_ids' appears twice"):
        tensors.decode_inputs([t, _ids([1], data=[2])], {"node_ids": (("INT64",), "ids")}, "")


def test_ids_decode_flat_and_other_layouts_keep_their_shape_from_json_and_binary():
    import numpy as np

    raw = np.arange(3, dtype="<i8").tobytes()
    assert decode_tensor(_ids([1, 3], raw=raw), ("INT64",), "ids").shape == (3,)
    assert decode_tensor(_ids([1, 3], data=[0, 1, 2]), ("INT64",), "ids").shape == (3,)
    names = Tensor("edge_index", "BYTES", [2, 2], data=["a", "b", "c", "d"])
    assert decode_tensor(names, ("BYTES",), "edges").tolist() == [["a", "b"], ["c", "d"]]


@pytest.mark.parametrize("datatype, dtype, values", [("INT32", "<i4", [1, -2, 3]), ("UINT64", "<u8", [1, 2, 3]),
                                                     ("FP32", "<f4", [0.5, -1.5, 2.0])])
def test_binary_values_are_read_in_their_datatypes_width(datatype, dtype, values):
    import numpy as np

    t = Tensor("x", datatype, [3], raw=np.array(values, dtype=dtype).tobytes())
    assert decode_tensor(t, (datatype,), "ids").tolist() == values


def test_binary_contents_longer_than_the_shape_are_refused():
    import numpy as np

    with pytest.raises(BadRequest, match=r"shape \[1\] of INT64 needs 8 bytes, 16 were sent"):
        decode_tensor(_ids([1], raw=np.arange(2, dtype="<i8").tobytes()), ("INT64",), "ids")


def test_booleans_are_not_features():
    with pytest.raises(BadRequest, match="must hold numbers, not true/false"):
        decode_tensor(Tensor("features", "FP32", [1, 2], data=[[True, False]]), ("FP32",), "matrix")


def _every_input_spec():
    """(request kind, input name, datatypes, layout) of every numeric input a request takes:
    inference, heterogeneous inference and graph updates."""
    from hybridgnn.serving.v2 import inference, typed
    from hybridgnn.updates.requests import UPDATE_INPUTS

    for kind, specs in (("infer", inference.INPUTS), ("typed", typed.INPUTS), ("update", UPDATE_INPUTS)):
        for name, (datatypes, layout) in specs.items():
            for datatype in datatypes:
                if datatype != "BYTES":
                    yield pytest.param(name, datatype, datatypes, layout, id=f"{kind}-{name}-{datatype}")


def _shaped(layout: str, values: list) -> tuple[list, list]:
    """(shape, data nested as it) of four values in a layout."""
    if layout == "ids":
        return [4], values
    return [2, 2], [values[:2], values[2:]]  # matrix, pairs, edges


@pytest.mark.parametrize("name, datatype, datatypes, layout", list(_every_input_spec()))
@pytest.mark.parametrize("at", [0, 3])
@pytest.mark.parametrize("flag", [True, False])
def test_true_or_false_among_numbers_is_refused_in_every_numeric_input(name, datatype, datatypes, layout, at, flag):
    # numpy made [true, 5] an int64 array [1, 5]: the request was served as if it said 1
    values = [1, 2, 3, 4] if datatype != "FP32" else [0.5, 1.0, 2.0, 3.0]
    values[at] = flag
    shape, data = _shaped(layout, values)
    kind = "numbers" if datatype == "FP32" else "integers"
    with pytest.raises(BadRequest, match=f"input '{name}': 'data' must hold {kind}, not true/false"):
        decode_tensor(Tensor(name, datatype, shape, data), datatypes, layout)
    with pytest.raises(BadRequest, match="not true/false"):  # flat data of a 2-D shape too
        decode_tensor(Tensor(name, datatype, shape, values), datatypes, layout)


def test_the_same_numbers_without_a_boolean_still_decode():
    assert decode_tensor(_ids([2], data=[1, 5]), ("INT64",), "ids").tolist() == [1, 5]
    got = decode_tensor(Tensor("features", "FP32", [1, 2], data=[[1, 0.5]]), ("FP32",), "matrix")
    assert got.tolist() == [[1.0, 0.5]]


@given(values=st.lists(st.integers(-(1 << 63), (1 << 63) - 1) | st.floats(allow_nan=False, allow_infinity=False),
                       min_size=1, max_size=12),
       flag=st.booleans(), at=st.integers(0, 12), nested=st.booleans())
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
def test_a_boolean_anywhere_among_numbers_is_refused(values, flag, at, nested):
    data = [*values[:at], flag, *values[at:]]
    n = len(data)
    t = Tensor("features", "FP32", [1, n], [data] if nested else data)
    with pytest.raises(BadRequest, match="not true/false"):
        decode_tensor(t, ("FP32",), "matrix")
    assert decode_tensor(Tensor("features", "FP32", [1, n - 1], values), ("FP32",), "matrix").shape == (1, n - 1)


def test_data_nested_as_another_shape_of_the_same_size_is_refused():
    with pytest.raises(BadRequest, match=r"nested as \[4, 1\], not as its shape \[2, 2\]"):
        decode_tensor(Tensor("x", "INT64", [2, 2], data=[[1], [2], [3], [4]]), ("INT64",), "matrix")


def test_two_to_the_63_alone_is_named_not_wrapped_negative():
    with pytest.raises(BadRequest, match=f"{1 << 63} is beyond the largest"):
        decode_tensor(_ids([1], data=[1 << 63]), ("INT64",), "ids")


def test_the_smallest_int64_is_not_named_as_beyond_it():
    with pytest.raises(BadRequest, match=f"{1 << 64} is beyond the largest"):
        decode_tensor(_ids([2], data=[-(1 << 63), 1 << 64]), ("INT64",), "ids")


def test_binary_names_of_the_longest_length_decode_and_damaged_layouts_are_refused():
    name = "x" * tensors.MAX_NAME_BYTES
    t = Tensor("node_ids", "BYTES", [1], raw=_raw_names([name]))
    assert decode_tensor(t, ("BYTES",), "ids").tolist() == [name]
    with pytest.raises(BadRequest, match=f"element 0 claims {tensors.MAX_NAME_BYTES + 1} bytes"):
        decode_tensor(Tensor("node_ids", "BYTES", [1], raw=_raw_names([name + "x"])), ("BYTES",), "ids")
    with pytest.raises(BadRequest, match="element 1 claims 5 bytes"):  # the last one cut short
        decode_tensor(Tensor("node_ids", "BYTES", [2], raw=_raw_names(["a", "bcdef"])[:-1]), ("BYTES",), "ids")
    with pytest.raises(BadRequest, match="3 bytes left after 1 elements"):
        decode_tensor(Tensor("node_ids", "BYTES", [1], raw=_raw_names(["a"]) + b"abc"), ("BYTES",), "ids")


def test_json_names_must_be_as_many_as_the_shape_says():
    with pytest.raises(BadRequest, match="a list .* of 2 strings"):
        decode_tensor(Tensor("node_ids", "BYTES", [2], data=["a", "b", "c"]), ("BYTES",), "ids")
    with pytest.raises(BadRequest, match="a list .* of 2 strings"):  # nested rows beside a flat name
        decode_tensor(Tensor("node_ids", "BYTES", [2], data=[["a"], "b"]), ("BYTES",), "ids")


def test_names_padded_to_more_than_sixteen_times_their_bytes_are_refused(monkeypatch):
    # 4 bytes a character padded; 90 names of 1 character and 10 of 50: 590 characters
    # padded to 100 x 50 x 4 = 20,000 bytes, 34x the characters (over 16x, under 64x)
    monkeypatch.setattr(tensors, "MAX_NAMES_FIXED_WIDTH_BYTES", 1 << 10)
    names = ["a"] * 90 + ["y" * 50] * 10
    with pytest.raises(PayloadTooLarge, match="padded to the longest"):
        decode_tensor(Tensor("node_ids", "BYTES", [100], data=names), ("BYTES",), "ids")


@pytest.mark.parametrize("shape, layout, match", [([1, 1, 3], "ids", "must be 1-D"), ([6], "matrix", "must be 2-D"),
                                                  ([2, 3], "ids", "must be 1-D")])
def test_shapes_of_another_rank_are_refused(shape, layout, match):
    with pytest.raises(BadRequest, match=match):
        decode_tensor(Tensor("x", "INT64", shape, data=list(range(6))), ("INT64",), layout)


def test_external_ids_hold_at_the_per_request_limit():
    import numpy as np

    from hybridgnn.graph.idmap import IdMap

    id_map = IdMap(np.array([5, 7, 9], np.int64))
    _, internal = tensors.map_external_ids(np.array([9, 5]), id_map, max_nodes=2)
    assert internal.tolist() == [2, 0]
    with pytest.raises(BadRequest, match="holds 3 ids; at most 2"):
        tensors.map_external_ids(np.array([9, 5, 7]), id_map, max_nodes=2)


def _query(query, edges, rows=None):
    import numpy as np

    from hybridgnn.graph.idmap import IdMap

    id_map = IdMap(np.array(["alice", "bob"]))
    return tensors.map_query_edges({"query_ids": np.asarray(query), "edge_index": np.asarray(edges),
                                    "features": np.zeros((len(query) if rows is None else rows, 2))}, id_map, 2)


def test_query_nodes_map_to_their_own_features_rows_in_any_order():
    internal, _ = _query(["zed", "carol"], [["carol", "zed"], ["alice", "bob"]])
    assert internal.tolist() == [[3, 2], [0, 1]]


def test_query_ids_that_do_not_fit_the_request_are_refused():
    with pytest.raises(BadRequest, match="query_ids names 1 nodes but features has 2 rows"):
        _query(["carol"], [["carol"], ["alice"]], rows=2)
    with pytest.raises(BadRequest, match="query node 'bob' names an existing node"):
        _query(["carol", "bob"], [["carol"], ["alice"]])
    with pytest.raises(BadRequest, match="query_ids must be BYTES"):
        _query([7], [["carol"], ["alice"]])


@pytest.mark.parametrize("ids", [[0, 99, 1], [0, 1, 2, 3, 99, 4, 5, 6, 7, 8], [3, -1, 2], [5, 1, 2, 3, 4, 6, -4, 7, 8]])
def test_node_ids_out_of_range_anywhere_in_the_request_are_refused(ids):
    import numpy as np

    with pytest.raises(BadRequest, match="out of range|must be >= 0"):
        tensors.validate_node_ids(np.array(ids), max_nodes=100, num_nodes=10)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_one_non_finite_feature_is_refused(bad):
    import numpy as np

    features = np.ones((2, 3), np.float32)
    features[1, 2] = bad
    with pytest.raises(BadRequest, match="features must be finite"):
        tensors.validate_new_nodes(features, np.array([[10], [0]]), max_nodes=2, num_nodes=10, feature_dim=3,
                                   max_edges=2)


def test_outputs_are_sent_as_their_datatypes_bytes():
    import numpy as np

    assert tensors.datatype_of(np.arange(2, dtype=np.int32)) == "INT64"
    assert tensors.raw_tensor(np.arange(2, dtype=np.int32)) == np.arange(2, dtype="<i8").tobytes()
    assert tensors.datatype_of(np.ones(2, np.float64)) == "FP32"
    assert tensors.raw_tensor(np.ones(2, np.float16)) == np.ones(2, "<f4").tobytes()
    assert tensors.raw_tensor(np.array(["ü", "ab"])) == _raw_names(["ü", "ab"])  # lengths in bytes, not characters


def test_new_node_results_are_checked_for_inf_and_nan_whatever_outputs_were_asked():
    """Top-k ids ranked by NaN scores came back with a 200 to a client that asked for the
    ids alone (the check saw only the outputs asked for)."""
    from hybridgnn.serving.v2.inference import refuse_non_finite
    from hybridgnn.types import StageTimings, TypedResult

    ranked_by_nan = TypedResult("cpu", StageTimings(), topk_index=np.array([[0, 1]]),
                                topk_scores=np.array([[np.nan, np.nan]], np.float32))
    with pytest.raises(BadRequest, match="output 'topk_scores' of these features is not finite"):
        refuse_non_finite(ranked_by_nan)
    refuse_non_finite(TypedResult("cpu", StageTimings(), topk_index=np.array([[0, 1]]),
                                   topk_scores=np.array([[2.0, 1.0]], np.float32)))
