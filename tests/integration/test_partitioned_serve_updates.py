"""Graph updates on `hybridgnn serve --partitions 2` as a client sends them: the same
answers as a one-process server given the same updates, read-your-writes, idempotent
retries, removed nodes refused, and what was acknowledged survives a killed rank (the
group replays the log) and a server killed with -9 (the log is durable)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import requests

from tests.support.partitioned import torchrun_ranks
from tests.support.server import ServerProcess, children_of, poll_ready, stop_process

MODEL = "hybridgnn"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def tensor(name, arr, datatype):
    arr = np.asarray(arr)
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def post_update(url, inputs, key: str | None = None):
    headers = {**AUTH, **({"Idempotency-Key": key} if key else {})}
    return requests.post(f"{url}/v2/models/{MODEL}/graph", json={"inputs": inputs}, headers=headers, timeout=120)


def infer(url, body):
    return requests.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=120)


def rows(url, ids, mode="precomputed", **params):
    r = infer(url, {"inputs": [tensor("node_ids", ids, "INT64")], "parameters": {"mode": mode, **params}})
    assert r.status_code == 200, r.text
    return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in r.json()["outputs"]}


def meta(url):
    return requests.get(f"{url}/v2/models/{MODEL}", timeout=10).json()["parameters"]


def version(url):
    return meta(url)["graph_version"]


def start(dataset, model, log, *extra):
    os.environ["HYBRIDGNN_UPDATE_TOKEN"] = TOKEN
    try:
        return ServerProcess(dataset, model, "--update-log", str(log), "--max-wait-ms", "1", *extra).wait_ready(180)
    finally:
        del os.environ["HYBRIDGNN_UPDATE_TOKEN"]


UPDATES = [
    [tensor("add_edges", [[5, 7], [1200, 3], [2999, 0]], "INT64")],
    [tensor("add_node_features", np.linspace(-1, 1, 32).reshape(2, 16), "FP32"),
     tensor("add_edges", [[-1, 10], [11, -1], [-2, -1], [2500, -2]], "INT64")],
    [tensor("update_ids", [0, 42], "INT64"), tensor("update_features", np.full((2, 16), 0.25), "FP32")],
    [tensor("remove_nodes", [17], "INT64")],
]


def test_updates_across_ranks_agree_with_one_process_and_survive_failures(tmp_path, tiny_dataset, tiny_model_pe):
    single = start(tiny_dataset, tiny_model_pe, tmp_path / "single.sqlite", "--workers", "1")
    part_log = tmp_path / "partitioned.sqlite"
    part = start(tiny_dataset, tiny_model_pe, part_log, "--partitions", "2", "--partition", "ranges")
    try:
        answers, stored_edges = [], meta(part.url)["num_edges"]
        for i, inputs in enumerate(UPDATES):
            a, b = post_update(single.url, inputs), post_update(part.url, inputs, key=f"u{i}")
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            ja, jb = a.json(), b.json()
            assert ja["graph_version"] == jb["graph_version"] and ja["new_node_ids"] == jb["new_node_ids"]
            answers.append(jb)
        new = answers[1]["new_node_ids"]
        assert new == [3000, 3001]
        # a retry with the same key is answered, not applied again
        again = post_update(part.url, UPDATES[1], key="u1")
        assert again.status_code == 200 and again.json()["replayed"] and again.json()["new_node_ids"] == new
        bad = post_update(part.url, [tensor("remove_edges", [[5, 6]], "INT64")])
        assert bad.status_code == 400 and "not in the graph" in bad.json()["error"]
        assert version(part.url) == version(single.url) == 4
        assert meta(part.url)["num_edges"] == meta(single.url)["num_edges"] != stored_edges  # as served now

        ids = np.array([0, 5, 7, 10, 11, 42, 1200, 2500, 2999, 3000, 3001])
        want = rows(single.url, ids)
        got = rows(part.url, ids, min_graph_version=4)  # read-your-writes
        np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
        np.testing.assert_allclose(got["embeddings"], want["embeddings"], atol=1e-5)
        r = infer(part.url, {"inputs": [tensor("node_ids", [17], "INT64")], "parameters": {"mode": "full"}})
        assert r.status_code == 404 and "removed" in r.json()["error"]
        query = {"inputs": [tensor("features", np.zeros((1, 16)), "FP32"), tensor("edge_index", [[3002], [17]], "INT64")],
                 "parameters": {"mode": "pe"}}  # an edge to a removed node
        for url in (single.url, part.url):
            r = infer(url, query)
            assert r.status_code == 404 and "node 17 was removed" in r.json()["error"], r.text
        r = infer(part.url, {"inputs": [tensor("node_ids", [1], "INT64")], "parameters": {"min_graph_version": 99}})
        assert r.status_code == 503 and "Retry-After" in r.headers

        # a killed rank: 503 until the group is back, then the same rows (the log replayed)
        os.kill(children_of(part.proc.pid)[1], signal.SIGKILL)
        poll_ready(part.url, 503, 30)
        poll_ready(part.url, 200, 120)
        np.testing.assert_allclose(rows(part.url, ids)["logits"], want["logits"], atol=1e-5)
        assert version(part.url) == 4

        # the server killed with -9: a new one replays the durable log
        os.kill(part.proc.pid, signal.SIGKILL)
        part.proc.wait(30)  # its orphaned ranks stop themselves; the new server starts its own
        part = start(tiny_dataset, tiny_model_pe, part_log, "--partitions", "2", "--partition", "ranges")
        assert version(part.url) == 4
        np.testing.assert_allclose(rows(part.url, ids)["logits"], want["logits"], atol=1e-5)
        out = post_update(part.url, UPDATES[1], key="u1")  # the key survived with the log
        assert out.status_code == 200 and out.json()["replayed"]
    finally:
        single.stop()
        if part.proc.poll() is None:
            assert part.stop() == 0, part.output()


@pytest.fixture(autouse=True)
def _no_token_leak():
    yield
    os.environ.pop("HYBRIDGNN_UPDATE_TOKEN", None)


def test_ranks_that_outlive_the_server_are_reset_before_the_next_one_replays(tmp_path, tiny_dataset, tiny_model_pe):
    """Ranks under torchrun keep running when a server stops; the next server, replaying the
    same log, must not apply its updates twice."""
    torchrun, listen = torchrun_ranks(tiny_dataset, tiny_model_pe)
    log, server = tmp_path / "log.sqlite", None
    ids = np.array([5, 7, 3000])
    try:
        server = start(tiny_dataset, tiny_model_pe, log, "--partitions", "2", "--ranks", listen)
        for inputs in UPDATES[:2]:
            assert post_update(server.url, inputs).status_code == 200
        first = rows(server.url, ids)["logits"]
        assert server.stop() == 0, server.output()
        server = start(tiny_dataset, tiny_model_pe, log, "--partitions", "2", "--ranks", listen)
        assert version(server.url) == 2
        meta = requests.get(f"{server.url}/v2/models/{MODEL}", timeout=10).json()["parameters"]
        assert meta["num_nodes"] == 3002  # the two new nodes once, not twice
        np.testing.assert_allclose(rows(server.url, ids)["logits"], first, atol=1e-6)
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop()
        os.killpg(torchrun.pid, signal.SIGTERM)
        stop_process(torchrun, 30)
