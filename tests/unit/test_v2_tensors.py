"""Decoding v2 input tensors: node names (BYTES) in JSON and binary form, the bound on
what names may cost once padded, and integers beyond INT64."""

from __future__ import annotations

import pytest

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
