"""The load generator's pure parts (no sockets): the response-head parser, the request
bodies and what it reads from a model's metadata."""

import json
import re

import numpy as np
import pytest

from hybridgnn.bench.loadgen import (
    _result,
    binary_body,
    error_summary,
    grpc_body,
    json_body,
    parse_response_head,
)
from hybridgnn.bench.metadata import load_size
from hybridgnn.bench.report import MESSAGE_CHARS, MESSAGES_PER_STATUS, ErrorSamples
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


def test_failing_answers_are_sampled_by_status_bounded_however_many_fail():
    """The report counted errors by status but never said what the server answered: a run
    of 400s left the user to guess which check refused them."""
    samples = ErrorSamples()
    for i in range(100_000):  # a message per node: only the first few distinct ones are kept
        samples.add_body(400, json.dumps({"error": f"node_ids: unknown node {i}"}).encode())
        samples.add_body(429, b'{"error": "overloaded: retry after 1 s"}')
    samples.add_body(500, b"<html>\n  Internal   Server Error </html>")  # not JSON: its text, one line
    samples.add_body(502, json.dumps({"detail": "x" * 10_000}).encode())  # no "error": its text, cut short
    samples.add(-2, "ConnectionRefusedError: [Errno 111] Connect call failed")
    got = samples.to_dict()
    assert got["400"] == [f"node_ids: unknown node {i}" for i in range(MESSAGES_PER_STATUS)]
    assert got["429"] == ["overloaded: retry after 1 s"]
    assert got["500"] == ["<html> Internal Server Error </html>"]
    assert len(got["502"][0]) == MESSAGE_CHARS and got["502"][0].endswith("...")
    assert list(got) == ["-2", "400", "429", "500", "502"]

    res = _result(1, 1, 1, 1, np.ones(4), np.array([200, 400, 429, -2]), False, np.zeros(4), samples)
    assert res.to_dict()["error_messages"] == got and res.error_statuses == {"-2": 1, "400": 1}
    assert error_summary(res).startswith("-2: ConnectionRefusedError") and "400: node_ids: unknown node 0" in error_summary(res)
    assert _result(1, 1, 1, 1, np.ones(1), np.array([200]), False, np.zeros(1)).error_messages == {}


def test_a_connection_reads_a_failing_answers_message_and_counts_it_as_before():
    """No sockets: the client's protocol fed an answer as the transport would."""
    from hybridgnn.bench.loadgen import _Connection, _ConnectionPool

    class Transport:
        def write(self, data):
            pass

        def close(self):
            pass

    pool = _ConnectionPool("127.0.0.1", 9, [b"request"] * 2, np.zeros(2))
    conn = _Connection(pool)
    conn.transport = Transport()
    body = b'{"error": "node_ids must be INT64"}'
    for i, head in enumerate((b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 200 OK")):
        pool.outstanding += 1
        conn.send(i)
        answer = head + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        conn.data_received(answer[:20])  # in two pieces
        conn.data_received(answer[20:])
    assert pool.statuses.tolist() == [400, 200] and pool.outstanding == 0
    assert pool.samples.to_dict() == {"400": ["node_ids must be INT64"]}


def test_a_grpc_error_counts_as_the_status_a_rest_client_would_have_got():
    """A gRPC run's errors are counted by the HTTP status the server's error carries (every
    code but OK and admission's counted as -1, no answer, before: a run of bad requests
    read as a server that never answered)."""
    from hybridgnn.bench.loadgen import _GRPC_STATUS
    from hybridgnn.serving.grpc.service import GRPC_CODES

    for status, code in GRPC_CODES.items():
        if status in (408, 413):  # their codes are a timeout's (no answer) and admission's (429)
            continue
        assert _GRPC_STATUS[code.name] == status, code
    assert "DEADLINE_EXCEEDED" not in _GRPC_STATUS and _GRPC_STATUS["INTERNAL"] == 500
