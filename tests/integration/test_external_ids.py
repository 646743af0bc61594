"""A dataset imported from an edge list of node names, served: requests name nodes by their
names (JSON and binary BYTES, plain HTTP and tritonclient) and answers echo them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from hybridgnn.embeddings.precompute import precompute
from hybridgnn.graph.importers import import_graph
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import save_model
from hybridgnn.models.gnn import GNN, ModelSpec
from tests.support.server import ServerProcess

MODEL = "hybridgnn"


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    root = tmp_path_factory.mktemp("named")
    rng = np.random.default_rng(0)
    names = [f"user-{i:03d}" for i in range(300)]
    lines = [f"{names[a]} {names[b]}" for a, b in rng.integers(0, 300, (1500, 2)) if a != b]
    (root / "edges.txt").write_text("\n".join(lines) + "\n")
    import_graph(root / "edges.txt", root / "data", undirected=True, feature_dim=8)
    graph = GraphStore.open(root / "data")
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", 8, 8, 3)).eval()
    save_model(model, root / "model", fanouts=[5, 5])
    store = precompute(graph, model, root / "model", progress=False)
    srv = ServerProcess(root / "data", root / "model", "--workers", "1").wait_ready()
    yield srv, graph, np.asarray(store.final)
    srv.stop()


def _post(url, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_requests_name_nodes_and_answers_echo_the_names(named):
    srv, graph, final = named
    ask = ["user-007", "user-123", "user-007"]
    status, out = _post(f"{srv.url}/v2/models/{MODEL}/infer", {
        "inputs": [{"name": "node_ids", "datatype": "BYTES", "shape": [3], "data": ask}],
        "parameters": {"mode": "precomputed"}})
    assert status == 200, out
    outs = {o["name"]: o for o in out["outputs"]}
    assert outs["node_ids"]["datatype"] == "BYTES" and outs["node_ids"]["data"] == ask
    rows = np.asarray(outs["logits"]["data"], dtype=np.float32).reshape(3, -1)
    internal = graph.id_map.to_internal(np.array(ask))[0]
    np.testing.assert_allclose(rows, final[internal], rtol=1e-6)
    status, out = _post(f"{srv.url}/v2/models/{MODEL}/infer", {
        "inputs": [{"name": "node_ids", "datatype": "BYTES", "shape": [2], "data": ["user-001", "mallory"]}]})
    assert status == 400 and "unknown node id 'mallory'" in out["error"]
    status, out = _post(f"{srv.url}/v2/models/{MODEL}/infer", {
        "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}]})
    assert status == 400 and "must be BYTES" in out["error"]
    with urllib.request.urlopen(f"{srv.url}/v2/models/{MODEL}", timeout=10) as r:
        meta = json.loads(r.read())
    assert meta["inputs"][0]["datatype"] == "BYTES" and meta["parameters"]["node_ids"] == "string"


def test_tritonclient_sends_names_as_bytes(named):
    import tritonclient.http as httpclient

    srv, graph, _ = named
    client = httpclient.InferenceServerClient(url=srv.url.removeprefix("http://"))
    names = np.array([b"user-010", b"user-299", b"user-000"], dtype=np.object_)
    for binary in (True, False):
        inp = httpclient.InferInput("node_ids", [3], "BYTES")
        inp.set_data_from_numpy(names, binary_data=binary)
        res = client.infer(MODEL, [inp], outputs=[httpclient.InferRequestedOutput("node_ids", binary_data=binary),
                                                  httpclient.InferRequestedOutput("predictions", binary_data=binary)])
        assert [n if isinstance(n, bytes) else n.encode() for n in res.as_numpy("node_ids").tolist()] == \
            names.tolist()
        assert res.as_numpy("predictions").shape == (3,)


def test_updates_name_nodes_by_their_names_and_survive_a_restart(named, tmp_path):
    _, graph, _ = named
    token, log = "a-long-token", tmp_path / "updates.sqlite"
    flags = ("--workers", "1", "--update-token", token, "--update-log", str(log))
    auth = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}

    def update(url, inputs):
        req = urllib.request.Request(f"{url}/v2/models/{MODEL}/graph", json.dumps({"inputs": inputs}).encode(), auth)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def lookup(url, names):
        return _post(f"{url}/v2/models/{MODEL}/infer", {
            "inputs": [{"name": "node_ids", "datatype": "BYTES", "shape": [len(names)], "data": names}],
            "parameters": {"mode": "precomputed"}})

    add_carol = [{"name": "add_node_features", "datatype": "FP32", "shape": [1, 8], "data": [0.5] * 8},
                 {"name": "add_node_ids", "datatype": "BYTES", "shape": [1], "data": ["carol"]},
                 {"name": "add_edges", "datatype": "BYTES", "shape": [2, 2],
                  "data": [["carol", "user-007"], ["user-007", "carol"]]}]
    srv = ServerProcess(graph.root, graph.root.parent / "model", *flags).wait_ready()
    try:
        status, out = update(srv.url, add_carol)
        assert status == 200 and out["new_node_ids"] == ["carol"], out
        status, out = update(srv.url, add_carol)
        assert status == 400 and "carol" in out["error"] and "already exists" in out["error"]
        status, out = update(srv.url, [{"name": "remove_edges", "datatype": "BYTES", "shape": [1, 2],
                                        "data": [["mallory", "user-007"]]}])
        assert status == 400 and "unknown node 'mallory'" in out["error"]
        status, out = update(srv.url, [{"name": "remove_nodes", "datatype": "INT64", "shape": [1], "data": [3]}])
        assert status == 400 and "must be BYTES" in out["error"]
        status, out = update(srv.url, [{"name": "remove_nodes", "datatype": "BYTES", "shape": [1],
                                        "data": ["user-005"]}])
        assert status == 200, out
        status, before = lookup(srv.url, ["carol", "user-007"])
        assert status == 200 and {o["name"]: o for o in before["outputs"]}["node_ids"]["data"] == ["carol", "user-007"]
        srv.proc.kill()  # kill -9: the names of added nodes come back from the update log
        srv.proc.wait(30)
        srv = ServerProcess(graph.root, graph.root.parent / "model", *flags).wait_ready()
        status, after = lookup(srv.url, ["carol", "user-007"])
        assert status == 200 and after == before
        status, out = lookup(srv.url, ["user-005"])
        assert status == 404 and "removed" in out["error"], out
    finally:
        srv.stop()


def test_new_node_requests_name_query_nodes_and_neighbours(named):
    srv, graph, _ = named
    url = f"{srv.url}/v2/models/{MODEL}/infer"

    def ask(query, edges, mode="full"):
        inputs = [{"name": "features", "datatype": "FP32", "shape": [len(query), 8], "data": [0.25] * (8 * len(query))},
                  {"name": "edge_index", "datatype": "BYTES", "shape": [2, len(edges[0])], "data": edges}]
        if query is not None:
            inputs.append({"name": "query_ids", "datatype": "BYTES", "shape": [len(query)], "data": query})
        return _post(url, {"inputs": inputs, "parameters": {"mode": mode}})

    edges = [["user-007", "user-123", "q1"], ["q1", "q1", "q2"]]
    for mode in ("full", "pe", "srpe", "sampled"):
        status, out = ask(["q1", "q2"], edges, mode)
        assert status == 200, (mode, out)
        outs = {o["name"]: o for o in out["outputs"]}
        assert outs["node_ids"]["data"] == ["q1", "q2"] and outs["logits"]["shape"][0] == 2
    status, out = ask(["user-001", "q2"], edges)
    assert status == 400 and "names an existing node" in out["error"]
    status, out = ask(["q1", "q2"], [["mallory"], ["q1"]])
    assert status == 400 and "unknown node 'mallory'" in out["error"]
    inputs = [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8},
              {"name": "edge_index", "datatype": "BYTES", "shape": [2, 1], "data": [["user-007"], ["q1"]]}]
    status, out = _post(url, {"inputs": inputs})
    assert status == 400 and "query_ids" in out["error"]


def test_bench_refuses_a_server_whose_nodes_are_named_in_one_line(named, capsys):
    """It sent INT64 ids 0..n-1: every request failed, and it printed "ok": 0 with exit 0."""
    from hybridgnn.cli.main import main

    srv, _, _ = named
    assert main(["bench", "--url", srv.url, "--duration-s", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names its nodes by strings" in err, err
