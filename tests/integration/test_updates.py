"""Graph updates against the real server: auth, JSON and binary bodies, atomic rejection,
read-your-writes of precomputed embeddings, sampling of new nodes, removed nodes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import requests
import torch

from hybridgnn.embeddings.newnodes import NewNodeEvaluator
from hybridgnn.embeddings.precompute import precompute
from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch
from hybridgnn.graph.store import GraphStore, write_dataset
from hybridgnn.models.checkpoint import load_checkpoint
from tests.support.reference import full_graph_forward
from tests.support.server import ServerProcess

MODEL = "hybridgnn"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tiny_dataset, tiny_model_pe, tmp_path_factory):
    os.environ["HYBRIDGNN_UPDATE_TOKEN"] = TOKEN  # the documented way: not on the command line
    log = tmp_path_factory.mktemp("update-log") / "updates.sqlite"  # the shared dataset stays as it is
    try:
        srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--update-log", str(log)).wait_ready()
    finally:
        del os.environ["HYBRIDGNN_UPDATE_TOKEN"]
    yield srv
    assert srv.stop() == 0


def tensor(name, arr, datatype):
    arr = np.asarray(arr)
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def post_update(url, inputs, headers=AUTH):
    return requests.post(f"{url}/v2/models/{MODEL}/graph", json={"inputs": inputs}, headers=headers, timeout=60)


def precomputed(url, ids):
    body = {"inputs": [tensor("node_ids", ids, "INT64")], "parameters": {"mode": "precomputed"}}
    r = requests.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def version(url):
    return requests.get(f"{url}/v2/models/{MODEL}", timeout=10).json()["parameters"]["graph_version"]


def test_auth_and_disabled(server, tiny_dataset, tiny_model):
    r = post_update(server.url, [tensor("remove_nodes", [1], "INT64")], headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "update token" in r.json()["error"]
    plain = ServerProcess(tiny_dataset, tiny_model).wait_ready()
    try:
        r = post_update(plain.url, [tensor("remove_nodes", [1], "INT64")])
        assert r.status_code == 403 and "--update-token" in r.json()["error"]
    finally:
        assert plain.stop() == 0


def test_update_is_visible_to_the_next_read(server, tiny_dataset, tiny_model_pe, tmp_path):
    graph = GraphStore.open(tiny_dataset)
    f = graph.feature_dim
    rng = np.random.default_rng(5)
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    v = 10
    existing = [int(indices[indptr[v]]), v]  # an edge into node 10
    new_feats = rng.normal(size=(1, f)).astype(np.float32)
    upd_feats = rng.normal(size=(2, f)).astype(np.float32)
    inputs = [tensor("add_node_features", new_feats, "FP32"),
              tensor("add_edges", [[-1, 7], [7, -1], [3, -1], [-1, 10]], "INT64"),
              tensor("remove_edges", [existing], "INT64"),
              tensor("update_ids", [5, 6], "INT64"), tensor("update_features", upd_feats, "FP32")]
    before = version(server.url)
    r = post_update(server.url, inputs)
    assert r.status_code == 200, r.text
    body = r.json()
    n = graph.num_nodes
    assert body["new_node_ids"] == [n] and body["graph_version"] == before + 1 and body["affected_nodes"] > 0

    # The same batch applied offline, then a full re-precompute: the served rows must match.
    dyn = DynamicGraph(graph)
    with dyn.lock.write():
        dyn.apply(UpdateBatch(add_edges=np.array([[n, 7], [7, n], [3, n], [n, 10]]), remove_edges=np.array([existing]),
                              add_node_features=new_feats, update_ids=np.array([5, 6]), update_features=upd_feats))
    ip, ix = dyn.to_csr()
    ds = write_dataset(tmp_path / "updated", indptr=ip, indices=ix, features=dyn.features(np.arange(dyn.num_nodes)))
    model, _ = load_checkpoint(tiny_model_pe)
    ref = np.asarray(precompute(GraphStore.open(ds), model, tmp_path / "m", progress=False).final)
    ids = np.array([n, 7, 10, 5, 6, 3, 0, 1, 2])
    got = precomputed(server.url, ids)
    err = np.abs(got - ref[ids]).max() / np.abs(ref[ids]).max()
    assert err < 1e-4, err

    # The new node is a real node now: sampled inference reaches it, metadata counts it.
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json={"inputs": [tensor("node_ids", [n, 7], "INT64")]},
                      timeout=30)
    assert r.status_code == 200, r.text
    meta = requests.get(f"{server.url}/v2/models/{MODEL}", timeout=10).json()["parameters"]
    assert meta["num_nodes"] == n + 1 and meta["updates_enabled"] and meta["pe_updated_unix_s"]
    # New-node requests read the current graph and embeddings: the exact answer is the
    # updated graph plus the query node (edges both ways), run through the model.
    qf = rng.normal(size=(1, f)).astype(np.float32)
    q = {"inputs": [tensor("features", qf, "FP32"), tensor("edge_index", [[n + 1, n + 1], [3, n]], "INT64")],
         "parameters": {"mode": "full"}}
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=q, timeout=30)
    assert r.status_code == 200, r.text
    got = np.asarray({o["name"]: o for o in r.json()["outputs"]}["logits"]["data"], dtype=np.float32)
    with dyn.lock.write():
        dyn.apply(UpdateBatch(add_node_features=qf, add_edges=np.array([[n + 1, 3], [3, n + 1], [n + 1, n],
                                                                        [n, n + 1]])))
    ip, ix = dyn.to_csr()
    ds2 = write_dataset(tmp_path / "with-query", indptr=ip, indices=ix,
                        features=dyn.features(np.arange(dyn.num_nodes)))
    want = full_graph_forward(GraphStore.open(ds2), model)[n + 1]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    # The query node named by its position (-1, the first) is the same request, without
    # the client knowing how many nodes updates have added by now.
    by_position = {**q, "inputs": [q["inputs"][0], tensor("edge_index", [[-1, -1], [3, n]], "INT64")]}
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=by_position, timeout=30)
    assert r.status_code == 200, r.text
    assert np.array_equal(np.asarray({o["name"]: o for o in r.json()["outputs"]}["logits"]["data"], np.float32), got)
    # Keyed sampling reads the current graph too: the draw one process makes on it.
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json={**q, "parameters": {"mode": "sampled"}},
                      timeout=30)
    assert r.status_code == 200, r.text
    got = np.asarray({o["name"]: o for o in r.json()["outputs"]}["logits"]["data"], dtype=np.float32)
    want = NewNodeEvaluator(GraphStore.open(ds), model, None).infer(
        qf, np.array([[n + 1, n + 1], [3, n]]), mode="sampled", fanouts=tuple(meta["fanouts"])).logits[0]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.parametrize("inputs, status, match", [
    ([tensor("add_edges", [[0, 999_999]], "INT64")], 400, "unknown node"),
    ([tensor("update_ids", [1], "INT64"), tensor("update_features", np.zeros((1, 3)), "FP32")], 400, "feature width"),
    ([tensor("add_edges", [[-2, 1]], "INT64"), tensor("add_node_features", np.zeros((1, 16)), "FP32")], 400,
     "new nodes"),
    ([tensor("bogus", [1], "INT64")], 400, "unknown input"),
    ([], 400, "non-empty"),
])
def test_bad_updates_change_nothing(server, inputs, status, match):
    before = version(server.url)
    snapshot = precomputed(server.url, np.arange(20))
    r = post_update(server.url, inputs)
    assert r.status_code == status and match in r.json()["error"], r.text
    assert version(server.url) == before
    assert np.array_equal(precomputed(server.url, np.arange(20)), snapshot)


def test_duplicate_edge_is_rejected(server, tiny_dataset):
    graph = GraphStore.open(tiny_dataset)
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    v = 40
    dup = [int(indices[indptr[v]]), v]
    r = post_update(server.url, [tensor("add_edges", [dup], "INT64")])
    assert r.status_code == 400 and "already in the graph" in r.json()["error"]


def test_binary_body_and_removed_nodes(server):
    ids = np.array([20, 21], dtype=np.int64)
    header = {"inputs": [{"name": "remove_nodes", "datatype": "INT64", "shape": [2],
                          "parameters": {"binary_data_size": ids.nbytes}}]}
    head = json.dumps(header).encode()
    before = version(server.url)
    r = requests.post(f"{server.url}/v2/models/{MODEL}/graph", data=head + ids.tobytes(),
                      headers={**AUTH, "Inference-Header-Content-Length": str(len(head)),
                               "Content-Type": "application/octet-stream"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["graph_version"] == before + 1
    body = {"inputs": [tensor("node_ids", [20], "INT64")]}
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 404 and "removed" in r.json()["error"]
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    assert 'hybridgnn_graph_updates_total{kind="remove_nodes"} 2.0' in metrics
    assert "hybridgnn_embedding_staleness_seconds 0.0" in metrics
    assert 'hybridgnn_graph_update_batches_total{outcome="rejected"}' in metrics


@pytest.mark.parametrize("value", ["7", -1, 1.5, True, None, [3]])
def test_min_graph_version_must_be_a_version(server, value):
    body = {"inputs": [tensor("node_ids", [1], "INT64")], "parameters": {"mode": "precomputed",
                                                                         "min_graph_version": value}}
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 400 and "min_graph_version" in r.json()["error"], r.text


def test_a_read_ahead_of_this_replica_waits_then_is_a_503_with_retry_after(server):
    now = version(server.url)
    body = {"inputs": [tensor("node_ids", [1], "INT64")], "parameters": {"min_graph_version": now}}
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text  # reached already: answered at once
    body["parameters"]["min_graph_version"] = now + 10**12
    r = requests.post(f"{server.url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == 503 and "not yet" in r.json()["error"] and int(r.headers["Retry-After"]) >= 1, r.text


def test_served_logits_after_mixed_updates_equal_a_full_forward_of_the_graph_kept_here(tiny_dataset, tiny_model_pe,
                                                                                      tmp_path):
    """An independent check of incremental propagation end to end: the graph is kept here
    as plain edge sets (not DynamicGraph), updated with what each answer reports, and run
    through the model whole; every live node's served logits must match it, on the server
    that took the updates, and a server started later on the same log serves the same."""
    graph = GraphStore.open(tiny_dataset)
    n, f = graph.num_nodes, graph.feature_dim
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
    edges = set(zip(indices.tolist(), np.repeat(np.arange(n), np.diff(indptr)).tolist(), strict=True))
    x = {v: row for v, row in enumerate(np.asarray(graph.features, dtype=np.float32))}
    rng = np.random.default_rng(11)
    removed = [min(e for e in edges if e[1] == v) for v in (10, 11)]  # an in-edge of each
    new_f, upd_f = rng.normal(size=(2, f)).astype(np.float32), rng.normal(size=(3, f)).astype(np.float32)
    requests_ = [
        [tensor("add_node_features", new_f, "FP32"),
         tensor("add_edges", [[-1, 5], [5, -1], [-2, -1], [-2, -2]], "INT64"),
         tensor("update_ids", [-1], "INT64"), tensor("update_features", upd_f[:1], "FP32")],
        [tensor("remove_edges", removed, "INT64"),
         tensor("update_ids", [3, 4], "INT64"), tensor("update_features", upd_f[1:], "FP32")],
        [tensor("remove_nodes", [12], "INT64")],
    ]
    flags = ("--workers", "1", "--update-log", str(tmp_path / "updates.sqlite"))
    os.environ["HYBRIDGNN_UPDATE_TOKEN"] = TOKEN
    try:
        srv = ServerProcess(tiny_dataset, tiny_model_pe, *flags).wait_ready()
        try:
            answers = [post_update(srv.url, inputs) for inputs in requests_]
            assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
            a, b = answers[0].json()["new_node_ids"]
            x[a], x[b], x[3], x[4] = upd_f[0], new_f[1], upd_f[1], upd_f[2]
            edges = (edges | {(a, 5), (5, a), (b, a), (b, b)}) - set(removed)
            edges = {e for e in edges if 12 not in e}
            ids = np.array(sorted(set(x) - {12}))
            model, _ = load_checkpoint(tiny_model_pe)
            feats = np.stack([x[v] for v in range(len(x))])
            with torch.inference_mode():
                want = model(torch.from_numpy(feats), torch.tensor(sorted(edges), dtype=torch.int64).T).numpy()[ids]
            got = precomputed(srv.url, ids)
            assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
        finally:
            assert srv.stop() == 0
        replica = ServerProcess(tiny_dataset, tiny_model_pe, *flags).wait_ready()  # replays the same log
        try:
            assert np.array_equal(precomputed(replica.url, ids), got)
        finally:
            assert replica.stop() == 0
    finally:
        del os.environ["HYBRIDGNN_UPDATE_TOKEN"]
