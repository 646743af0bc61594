"""The load generator's pure parts (no sockets): the response-head parser, the request
bodies and what it reads from a model's metadata."""

import json
import re

import numpy as np
import pytest

from hybridgnn.bench.loadgen import (
    binary_body,
    grpc_body,
    json_body,
    load_size,
    parse_response_head,
)
from hybridgnn.errors import ConfigError


def test_a_whole_head_gives_status_lengths_and_keep_alive():
    buf = bytearray(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 12\r\nRetry-After: 1\r\n\r\n{\"error\": 1}")
    status, head, length, keep = parse_response_head(buf)
    assert (status, length, keep) == (429, 12, True)
    assert bytes(buf[head:head + length]) == b"{\"error\": 1}"


def test_header_names_are_case_insensitive_and_close_ends_keep_alive():
    buf = bytearray(b"HTTP/1.1 200 OK\r\ncontent-length:3\r\nCONNECTION: close\r\n\r\nabc")
    assert parse_response_head(buf)[1:] == (len(buf) - 3, 3, False)


def test_no_length_means_an_empty_body_and_a_partial_head_waits():
    assert parse_response_head(bytearray(b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n"))[2] == 0
    assert parse_response_head(bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n")) is None


HETERO = {"name": "m", "parameters": {"graph": "heterogeneous", "node_types": [
    {"name": "user", "num_nodes": 30, "output_dim": 4, "node_ids": "dense"},
    {"name": "item", "num_nodes": 50, "output_dim": None, "node_ids": "dense"}]}}


def test_a_heterogeneous_model_is_loaded_by_the_node_type_named_else_refused_in_one_line():
    """Its metadata has no num_nodes: bench was a KeyError traceback."""
    assert load_size(HETERO, "user") == 30
    assert load_size({"name": "m", "parameters": {"num_nodes": 7, "node_ids": "dense"}}) == 7
    for node_type, said in ((None, "model 'm' is heterogeneous: bench loads it with node requests of one type; "
                                   "give --node-type (one of ['user'])"),
                            ("item", "answers no node requests of type 'item'; --node-type must be one of ['user']")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_size(HETERO, node_type)
    with pytest.raises(ConfigError, match="model 'm' is homogeneous: it takes no node type"):
        load_size({"name": "m", "parameters": {"num_nodes": 7}}, "user")


def test_request_bodies_carry_the_node_type_in_every_encoding():
    from hybridgnn.serving.grpc.schema import message

    ids = np.array([3, 1], np.int64)
    body, headers = binary_body(ids, {"node_type": "user"})
    header = json.loads(body[:int(headers["Inference-Header-Content-Length"])])
    assert header["parameters"] == {"binary_data_output": True, "node_type": "user"}
    assert json.loads(json_body(ids, {"node_type": "user"})[0])["parameters"] == {"node_type": "user"}
    assert "parameters" not in json.loads(json_body(ids)[0])
    req = message("ModelInferRequest")()
    req.ParseFromString(grpc_body("m", ids, {"node_type": "user"}))
    assert req.parameters["node_type"].string_param == "user" and req.model_name == "m"


@pytest.mark.parametrize("kind, said", [("string", "by strings"), ("int64", "by sparse integer ids")])
def test_a_model_whose_nodes_are_not_ids_0_to_n_is_refused_in_one_line(kind, said):
    """bench sent ids 0..n-1 anyway: every request was refused and the run printed only
    an error count, exit 0."""
    homo = {"name": "m", "parameters": {"num_nodes": 7, "node_ids": kind}}
    with pytest.raises(ConfigError, match=f"model 'm' names its nodes {said} .* bench loads only graphs whose "
                                          "node ids are 0..n-1"):
        load_size(homo)
    hetero = json.loads(json.dumps(HETERO))
    hetero["parameters"]["node_types"][0]["node_ids"] = kind
    with pytest.raises(ConfigError, match=f"model 'm' names its 'user' nodes {said}"):
        load_size(hetero, "user")
