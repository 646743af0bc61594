"""Property: a graph update's count of updates, read from its inputs' shapes before any value
is decoded (the 413 that spares the event loop a huge body), is the count its decoded
inputs hold. Whatever the mix of inputs, layouts ([n], [1, n], [n, 1] ids; [n, 2] pairs;
[n, F] rows), JSON or binary values, on a dataset with or without an id map: past the limit
it is a 413 naming that count, and within it never a 413, and an update that decodes
counts exactly what its shapes declared (an over-count would refuse a valid update, an
under-count would let numpy walk a body past the limit)."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgnn.errors import PayloadTooLarge, ServingError
from hybridgnn.graph.idmap import IdMap
from hybridgnn.serving.v2 import tensors
from hybridgnn.serving.v2.requests import declared_updates
from hybridgnn.serving.v2.tensors import DTYPES
from hybridgnn.updates.requests import COUNTED_INPUTS, UPDATE_INPUTS
from tests.support.v2_codec import decode_update_request

F = 3
MAX_UPDATES = 12
NAMES = IdMap(np.array([f"n{i}" for i in range(40)]))


@st.composite
def update_inputs(draw, named: bool, tail: list):
    """One input per drawn name, each of 0..8 rows in a layout decoding takes, its values in
    or out of the graph (ids) or finite or not (features), sent as JSON or binary."""
    out = []
    for name in draw(st.lists(st.sampled_from(list(UPDATE_INPUTS)), min_size=1, max_size=4, unique=True)):
        rows = draw(st.integers(0, 8))
        layout = UPDATE_INPUTS[name][1]
        if layout == "ids":
            shape = draw(st.sampled_from([[rows], [1, rows], [rows, 1]]))
        elif layout == "pairs":
            shape = [rows, 2]
        else:
            shape = [rows, draw(st.sampled_from([F, F, F, F + 1]))]
        count = int(np.prod(shape))
        if layout == "matrix":
            values = draw(st.lists(st.floats(-10, 10, width=32) | st.just(float("nan")), min_size=count,
                                   max_size=count))
            arr, datatype = np.array(values, np.float32).reshape(shape), "FP32"
        elif named:
            arr = np.array([f"n{v}" for v in draw(st.lists(st.integers(0, 45), min_size=count, max_size=count))])
            arr, datatype = arr.reshape(shape), "BYTES"
        else:
            values = draw(st.lists(st.integers(-3, 45), min_size=count, max_size=count))
            datatype = draw(st.sampled_from(["INT64", "INT32"]))
            arr = np.array(values, np.int64).reshape(shape)
        tensor = {"name": name, "datatype": datatype, "shape": shape}
        if datatype != "BYTES" and draw(st.booleans()):
            raw = arr.astype(DTYPES[datatype]).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            tensor["data"] = arr.tolist() if draw(st.booleans()) else arr.reshape(-1).tolist()
        out.append(tensor)
    return out


@st.composite
def update_bodies(draw):
    """(body, Inference-Header-Content-Length or None, declared count, whether the dataset
    names its nodes)."""
    named = draw(st.booleans())
    tail: list[bytes] = []
    inputs = draw(update_inputs(named, tail))
    declared = sum(int(np.prod(t["shape"])) if UPDATE_INPUTS[t["name"]][1] == "ids" else t["shape"][0]
                   for t in inputs if t["name"] in COUNTED_INPUTS)
    head = json.dumps({"inputs": inputs}).encode()
    return head + b"".join(tail), (str(len(head)) if tail else None), declared, named


@settings(max_examples=1500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(update_bodies())
def test_the_count_read_from_the_shapes_is_the_count_decoded(case):
    body, header_length, declared, named = case
    decoded = mock.Mock(wraps=tensors.decode_tensor)
    try:
        with mock.patch.object(tensors, "decode_tensor", decoded):
            pending = decode_update_request(body, header_length, feature_dim=F, max_updates=MAX_UPDATES,
                                            id_map=NAMES if named else None)
    except PayloadTooLarge as exc:
        assert declared > MAX_UPDATES, f"a 413 for {declared} updates within the limit: {exc.message}"
        assert exc.message == f"{declared} updates in one request; the limit is {MAX_UPDATES}"
        assert not decoded.called, "values were decoded before the count was refused"
    except ServingError as exc:
        assert exc.status == 400, exc.message
        assert declared <= MAX_UPDATES, f"{declared} updates past the limit were decoded: {exc.message}"
    else:
        assert declared <= MAX_UPDATES and pending.num_updates == declared
        assert pending.logged.num_updates == declared


@pytest.mark.parametrize("inputs", [
    [{"name": ["add_edges"], "shape": [20, 2]}],  # unhashable: decoding names it unknown
    [{"name": "add_edges", "shape": "20,2"}, {"name": "remove_nodes", "shape": [2.0]}],
    [{"name": "add_edges", "shape": [2] * 9}],  # past the rank decoding takes
])
def test_inputs_decoding_refuses_count_nothing_before_it(inputs):
    from hybridgnn.serving.v2.types import Tensor

    assert declared_updates([Tensor(t["name"], "INT64", t["shape"], []) for t in inputs]) == 0
