"""The real server as a subprocess on 127.0.0.1, driven by plain HTTP and by tritonclient."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from hybridgnn.graph.store import GraphStore
from tests.support.server import FRONTEND_IDS, FRONTENDS, ServerProcess

MODEL = "hybridgnn"


@pytest.fixture(scope="module", params=FRONTENDS, ids=FRONTEND_IDS)
def server(tiny_dataset, tiny_model_pe, request):
    # no admission bound on queueing delay: on a loaded 2-core machine a burst of slow
    # scheduling otherwise refuses a few of the bench test's requests with 429
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "2", "--max-request-nodes", "512", "--frontends",
                        request.param, "--max-queue-delay-ms", "60000").wait_ready()
    yield srv
    assert srv.stop() == 0


def infer_json(url, ids, **kw):
    body = {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": list(ids)}], **kw}
    return requests.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30)


def test_health_and_metadata(server, tiny_dataset):
    graph = GraphStore.open(tiny_dataset)
    assert requests.get(server.url + "/v2/health/live").json() == {"live": True}
    assert requests.get(server.url + "/v2/health/ready").status_code == 200
    assert requests.get(server.url + "/v2").json()["name"] == "hybridgnn"
    models = requests.get(server.url + "/v2/models").json()["models"]
    assert models == [{"name": MODEL, "versions": ["1"], "ready": True}]
    meta = requests.get(f"{server.url}/v2/models/{MODEL}").json()
    params = meta["parameters"]
    assert params["num_nodes"] == graph.num_nodes and params["feature_dim"] == graph.feature_dim
    assert params["fanouts"] == [5, 3] and params["model_kind"] == "sage"
    assert requests.get(f"{server.url}/v2/models/{MODEL}/ready").status_code == 200
    assert requests.get(f"{server.url}/v2/models/{MODEL}/versions/1/ready").status_code == 200
    r = requests.post(f"{server.url}/v2/models/{MODEL}/versions/2/infer",
                      json={"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}]})
    assert r.status_code == 404 and "has no version '2'" in r.json()["error"]


def test_json_inference(server, tiny_dataset):
    r = infer_json(server.url, [0, 5, 5, 17], id="req-1")
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert r.json()["id"] == "req-1"
    assert out["logits"]["shape"] == [4, 4] and out["logits"]["datatype"] == "FP32"
    emb = np.array(out["logits"]["data"]).reshape(4, 4)
    assert out["predictions"]["data"] == emb.argmax(1).tolist()


def test_precomputed_mode_answers_from_stored_embeddings(server, tiny_dataset, tiny_model_pe):
    from hybridgnn.embeddings.store import EmbeddingStore

    graph = GraphStore.open(tiny_dataset)
    store = EmbeddingStore.open(tiny_model_pe, graph.fingerprint)
    meta = requests.get(f"{server.url}/v2/models/{MODEL}").json()["parameters"]
    assert meta["modes"] == ["sampled", "precomputed"]
    assert meta["pe_computed_unix_s"] == pytest.approx(store.computed_unix_s)
    ids = [0, 7, 7, 2999]
    r = infer_json(server.url, ids, parameters={"mode": "precomputed"})
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    emb = np.array(out["logits"]["data"], dtype=np.float32).reshape(4, -1)
    np.testing.assert_allclose(emb, np.asarray(store.final)[ids], rtol=1e-6)
    assert out["predictions"]["data"] == emb.argmax(1).tolist()
    # embeddings: what the head (the last layer) reads, i.e. layer 1's rows of this 2-layer model
    hidden = np.array(out["embeddings"]["data"], dtype=np.float32).reshape(4, -1)
    assert hidden.shape[1] == meta["embedding_dim"] == store.layers[0].shape[1] != meta["logits_dim"]
    np.testing.assert_allclose(hidden, np.asarray(store.layers[0])[ids], rtol=1e-6)
    bad = infer_json(server.url, [1], parameters={"mode": "telepathy"})
    assert bad.status_code == 400 and "unknown mode" in bad.json()["error"]


def new_node_body(feats, edges, **params):
    return {"inputs": [{"name": "features", "shape": list(feats.shape), "datatype": "FP32",
                        "data": feats.reshape(-1).tolist()},
                       {"name": "edge_index", "shape": list(edges.shape), "datatype": "INT64",
                        "data": edges.reshape(-1).tolist()}],
            "parameters": params}


def test_new_node_requests(server, tiny_dataset, tiny_model_pe):
    from hybridgnn.embeddings.newnodes import NewNodeEvaluator
    from hybridgnn.embeddings.store import EmbeddingStore
    from hybridgnn.models.checkpoint import load_checkpoint

    graph = GraphStore.open(tiny_dataset)
    n = graph.num_nodes
    rng = np.random.default_rng(5)
    feats = rng.standard_normal((3, graph.feature_dim)).astype(np.float32)
    edges = np.array([[n, n, n + 1, n + 2, n], [10, 20, 30, 40, n + 1]], dtype=np.int64)
    ev = NewNodeEvaluator(graph, load_checkpoint(tiny_model_pe)[0], EmbeddingStore.open(tiny_model_pe, graph.fingerprint))
    url = f"{server.url}/v2/models/{MODEL}/infer"
    for mode in ("full", "pe", "srpe"):
        r = requests.post(url, json=new_node_body(feats, edges, mode=mode, gamma=0.5), timeout=30)
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        emb = np.array(out["logits"]["data"], dtype=np.float32).reshape(3, -1)
        expect = ev.infer(feats, edges, mode=mode, gamma=0.5).logits
        np.testing.assert_allclose(emb, expect, rtol=1e-5, atol=1e-6)
        assert out["predictions"]["data"] == emb.argmax(1).tolist()
    assert requests.post(url, json=new_node_body(feats, edges), timeout=30).status_code == 200  # default srpe
    r = requests.post(url, json=new_node_body(feats, edges, mode="sampled"), timeout=30)
    outs = {o["name"]: o for o in r.json()["outputs"]}
    assert r.status_code == 200 and len(outs["predictions"]["data"]) == 3
    for params, match in [({"gamma": 1.5}, "gamma"), ({"mode": "telepathy"}, "take mode"),
                          ({"policy": "psychic"}, "policy")]:
        r = requests.post(url, json=new_node_body(feats, edges, **params), timeout=30)
        assert r.status_code == 400 and match in r.json()["error"], r.text
    r = requests.post(url, json=new_node_body(feats[:, :3], edges), timeout=30)
    assert r.status_code == 400 and "columns" in r.json()["error"]
    r = requests.post(url, json=new_node_body(feats, edges + 1000), timeout=30)
    assert r.status_code == 400 and "must lie in" in r.json()["error"]
    # finite features the model overflows on: a 400, not a 200 with null in place of numbers
    r = requests.post(url, json=new_node_body(np.full_like(feats, 3e38), edges, mode="full"), timeout=30)
    assert r.status_code == 400 and "not finite" in r.json()["error"], r.text


def test_predictions_are_accurate(server, tiny_dataset, tiny_model):
    graph = GraphStore.open(tiny_dataset)
    trained = json.loads((tiny_model / "config.json").read_text())["metrics"]["test_acc"]
    test_ids = np.flatnonzero(np.asarray(graph.masks["test_mask"]))[:400]
    r = infer_json(server.url, test_ids.tolist())
    pred = np.array({o["name"]: o for o in r.json()["outputs"]}["predictions"]["data"])
    served = (pred == np.asarray(graph.labels)[test_ids]).mean()
    assert served > 0.6 and served > trained - 0.08  # 4 classes: chance is 0.25


def test_tritonclient_binary_and_json(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL)
    assert meta["inputs"][0]["name"] == "node_ids"
    ids = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)
    for binary in (True, False):
        inp = httpclient.InferInput("node_ids", [len(ids)], "INT64")
        inp.set_data_from_numpy(ids, binary_data=binary)
        outs = [httpclient.InferRequestedOutput("logits", binary_data=binary),
                httpclient.InferRequestedOutput("predictions", binary_data=binary)]
        res = client.infer(MODEL, [inp], outputs=outs)
        emb, pred = res.as_numpy("logits"), res.as_numpy("predictions")
        assert emb.shape == (6, 4) and emb.dtype == np.float32
        assert pred.tolist() == emb.argmax(1).tolist()
    res = client.infer(MODEL, [inp])  # no outputs named: all outputs, binary
    assert res.as_numpy("predictions").shape == (6,)
    with pytest.raises(Exception, match="unknown model"):
        client.infer("nope", [inp])


@pytest.mark.parametrize("send, status, match", [
    (lambda u: requests.post(f"{u}/v2/models/{MODEL}/infer", data=b"{oops", timeout=10), 400, "not valid JSON"),
    (lambda u: requests.post(f"{u}/v2/models/other/infer", json={}, timeout=10), 404, "unknown model"),
    (lambda u: requests.get(f"{u}/v2/models/other", timeout=10), 404, "unknown model"),
    (lambda u: requests.post(f"{u}/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "node_ids", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, timeout=10), 400, "datatype"),
    (lambda u: requests.post(f"{u}/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "node_ids", "shape": [3], "datatype": "INT64", "data": [1]}]}, timeout=10), 400, "shape"),
    (lambda u: infer_json(u, [-3]), 400, ">= 0"),
    (lambda u: infer_json(u, [10**9]), 400, "out of range"),
    (lambda u: infer_json(u, []), 400, "empty"),
    (lambda u: infer_json(u, list(range(513))), 400, "at most 512"),
    (lambda u: requests.get(f"{u}/v2/nothing", timeout=10), 404, "no such endpoint"),
    (lambda u: requests.get(f"{u}/v2/models/{MODEL}/infer", timeout=10), 405, "not allowed"),
    (lambda u: requests.post(f"{u}/v2/models/{MODEL}/infer", data=b"x" * (17 * 2**20), timeout=30), 413, "too large"),
])
def test_bad_input_gets_json_error(server, send, status, match):
    r = send(server.url)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]
    assert infer_json(server.url, [1]).status_code == 200  # still serving


def test_metrics_exposition(server):
    for _ in range(5):
        infer_json(server.url, [1, 2, 3])
    text = requests.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    stages = {s.labels["stage"] for s in families["hybridgnn_stage_seconds"].samples if "stage" in s.labels}
    assert {"queue_wait", "batching", "sample", "gather", "compute", "handoff", "respond", "total"} <= stages
    counted = {s.labels["stage"]: s.value for s in families["hybridgnn_stage_seconds"].samples
               if s.name.endswith("_count") and s.labels.get("pipeline") == "cpu"}
    assert counted["handoff"] == counted["compute"] >= 1  # one per batch, as the pipeline's stages
    codes = {s.labels["code"]: s.value for s in families["hybridgnn_requests"].samples
             if s.name == "hybridgnn_requests_total"}
    assert codes["200"] >= 5
    for name in ("hybridgnn_batch_size_seeds", "hybridgnn_batch_psgs", "hybridgnn_queue_depth_batches",
                 "hybridgnn_routing_decisions", "hybridgnn_pending_requests"):
        assert name in families, name
    routed = {(s.labels["pipeline"], s.labels["reason"]): s.value
              for s in families["hybridgnn_routing_decisions"].samples if s.name.endswith("_total")}
    # Label sets dashboards select on exist at zero; only the single CPU pipeline got batches.
    assert routed[("cpu", "only")] >= 1 and routed[("gpu", "spill")] == 0
    assert sum(routed.values()) == routed[("cpu", "only")]
    assert ("cpu", "host") in {(s.labels["pipeline"], s.labels["tier"]) for s in families["hybridgnn_gathered_rows"].samples}
    assert "hybridgnn_ready 1.0" in text and "hybridgnn_pending_capacity_requests" in text


def test_overload_gets_429_with_retry_after(tiny_dataset, tiny_model):
    # One request in flight at most and a long batching window: of several simultaneous
    # requests, those beyond the first are refused with 429, and every admitted one answered.
    srv = ServerProcess(tiny_dataset, tiny_model, "--max-pending", "1", "--max-wait-ms", "400", "--wait-when-idle",
                        "--max-batch-seeds", "100000", "--max-connections", "8").wait_ready()
    try:
        barrier = threading.Barrier(6)
        responses, lock = [], threading.Lock()

        def one(i):
            barrier.wait()
            r = infer_json(srv.url, [i])
            with lock:
                responses.append(r)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        statuses = sorted(r.status_code for r in responses)
        assert len(statuses) == 6 and set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1 and "overloaded" in refused.json()["error"]
        # past --max-connections: 503 + Retry-After, counted in the refusal series (one process)
        held, head = [], b""
        try:
            while not head.startswith(b"HTTP/1.1 503"):
                assert len(held) <= 8, "a connection past the cap of 8 was served"
                conn = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                held.append(conn)
                conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
                head = conn.recv(4096)
            assert b"retry-after" in head.lower()
        finally:
            for conn in held:
                conn.close()
        deadline, refusals = time.monotonic() + 10, 1
        while (scrape := requests.get(f"{srv.url}/metrics", timeout=10)).status_code == 503:  # closes not seen yet
            assert time.monotonic() < deadline, scrape.text
            refusals += 1
            time.sleep(0.05)  # poll interval, bounded by the deadline
        families = text_string_to_metric_families(scrape.text)
        counted = {s.labels["reason"]: s.value for f in families for s in f.samples
                   if s.name == "hybridgnn_rejected_requests_total"}
        assert counted.get("connection_cap") == refusals and counted.get("overload", 0) >= 1, counted
    finally:
        assert srv.stop() == 0


# the split CPU lane (its device stage on CPU tensors): batches handed to the device stage
# when the signal comes are answered too
SPLIT_LANE = ("--device", "emulate", "--cpu-lane", "split", "--psgs-threshold", "1e12")


# the signal to the server's whole process group, as a terminal's Ctrl-C, `timeout` or
# systemd send it: its worker processes died of it mid-batch, and the drain restarted them
TO_GROUP = ("--worker-processes", "on", "--workers", "2")


@pytest.mark.parametrize("frontends, extra", [*((f, ()) for f in FRONTENDS), ("1", SPLIT_LANE), ("1", TO_GROUP)],
                         ids=[*FRONTEND_IDS, "split-lane", "to-the-process-group"])
def test_sigterm_under_load_drains_everything_accepted(tiny_dataset, tiny_model, frontends, extra):
    srv = ServerProcess(tiny_dataset, tiny_model, "--max-wait-ms", "20", "--frontends", frontends,
                        *extra, own_group=extra == TO_GROUP).wait_ready()
    outcomes, lock = [], threading.Condition()
    stop_clients = threading.Event()

    def client(seed):
        rng = np.random.default_rng(seed)
        session = requests.Session()
        while not stop_clients.is_set():
            ids = rng.integers(0, 3000, size=8).tolist()
            try:
                r = infer_json_session(session, srv.url, ids)
                outcome = (r.status_code, r.json())
            except requests.ConnectionError as exc:
                outcome = ("conn", str(exc))
            except requests.Timeout as exc:
                outcome = ("timeout", f"{time.monotonic() - t_start:.2f}s after start, sigterm at {sigterm_at}: {exc}")
            with lock:
                outcomes.append(outcome)
                lock.notify_all()
            if outcome[0] in ("conn", "timeout"):
                return

    t_start = time.monotonic()
    sigterm_at = []
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    with lock:
        assert lock.wait_for(lambda: len(outcomes) >= 50, timeout=30), "clients made no progress"
    sigterm_at.append(time.monotonic() - t_start)
    if extra == TO_GROUP:
        os.killpg(srv.proc.pid, signal.SIGTERM)
    else:
        srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(60)
    stop_clients.set()
    for t in threads:
        t.join(30)
    assert code == 0, srv.output()
    assert "starting it again" not in srv.output(), srv.output()
    statuses = [o[0] for o in outcomes]
    assert statuses.count(200) >= 50
    # Every answer is a success or a clean "shutting down" refusal; the only transport
    # errors are connections refused or reset while being set up, after the listener
    # closed (the kernel resets ones still in the accept backlog): never a reset
    # mid-request.
    for status, payload in outcomes:
        if status == 200:
            assert len({o["name"]: o for o in payload["outputs"]}["predictions"]["data"]) == 8
        elif status == 503:
            assert "shutting down" in payload["error"]
        elif status == 429:  # admission's queueing-delay bound, on a loaded machine: a clean answer too
            assert "overloaded" in payload["error"], payload
        else:
            assert status == "conn" and ("refused" in payload.lower() or "Connection aborted" in payload
                                         or "Failed to establish a new connection" in payload), payload


def test_sigterm_reports_unready_first_and_keeps_serving_for_the_delay(tiny_dataset, tiny_model):
    # the delay is far longer than the test needs: all it does must fit in the window
    srv = ServerProcess(tiny_dataset, tiny_model, "--unready-delay-s", "15").wait_ready()
    session = requests.Session()
    assert infer_json_session(session, srv.url, [1, 2]).status_code == 200
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 2.5
    while session.get(srv.url + "/v2/health/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "ready did not turn 503 after SIGTERM"
        time.sleep(0.02)  # poll interval; bounded by the deadline
    # Not ready, yet still serving: balancers move away before anything is refused.
    r = infer_json_session(session, srv.url, [3, 4])
    assert r.status_code == 200, r.text
    metrics = session.get(srv.url + "/metrics", timeout=5).text
    assert "hybridgnn_ready 0.0" in metrics
    assert srv.proc.wait(60) == 0, srv.output()


def infer_json_session(session, url, ids):
    body = {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}]}
    return session.post(f"{url}/v2/models/{MODEL}/infer", data=json.dumps(body), timeout=30)


def test_bench_command_drives_the_server(server):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "bench", "--url",
                          server.url, "--rate", "100", "--duration-s", "1", "--nodes-per-request", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["sent"] > 50 and report["ok"] == report["sent"] and report["errors"] == 0
    assert report["seeds_per_s"] == pytest.approx(3 * report["achieved_rps"])
    assert 0 < report["p50_ms"] <= report["p99_ms"] <= report["max_ms"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_bench_stopped_by_a_signal_reports_what_it_measured_so_far(server, sig, code):
    """Ctrl-C during a long bench printed "interrupted" and no report (a SIGTERM killed it
    without a word): what it had measured was lost."""
    import subprocess
    import sys

    def answered() -> int:
        stats = requests.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"][0]
        return stats["inference_stats"]["success"]["count"]

    before = answered()
    bench = subprocess.Popen([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "bench", "--url",
                              server.url, "--rate", "50", "--duration-s", "600", "--nodes-per-request", "3"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while answered() < before + 20:  # the load is under way: the server has answered some of it
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.05)  # poll interval, bounded by the deadline above
        bench.send_signal(sig)
        out, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == code, err
    report = json.loads(out)
    assert report["interrupted"] == sig.name and report["duration_s"] < 600
    assert report["ok"] >= 20 and report["errors"] == report["rejected"] == 0
    assert report["ok"] + report["unanswered"] == report["sent"] < 50 * 600
    assert 0 < report["p50_ms"] <= report["p99_ms"] <= report["max_ms"]
    said = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert f"hybridgnn bench: {said} ({sig.name}) after" in err and "a partial report of the" in err, err
    assert "Traceback" not in err, err


def test_a_taken_port_exits_2_with_a_message(tiny_dataset, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = ServerProcess(tiny_dataset, tiny_model, port=port)
        assert srv.proc.wait(120) == 2
        out = srv.output()
    # refused before anything starts (a port taken between that check and the bind says
    # "cannot listen on ..." instead)
    assert f"port {port} on 127.0.0.1 is in use" in out and "Traceback" not in out, out
