"""A model repository served over one graph by the real server: two models, two versions
of one, requests routed by name and version, a version that cannot load listed with why,
and the repository index and model configuration as tritonclient reads them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import requests

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from tests.support.server import ServerProcess, free_port  # noqa: E402

TOKEN = "repository-token"


def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition` until it holds; fail naming `what` past the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # poll interval; bounded by the deadline


def _index(url: str) -> dict:
    return {(e["name"], e["version"]): e for e in requests.post(f"{url}/v2/repository/index", timeout=10).json()}


@pytest.fixture(scope="module")
def repo_server(tiny_dataset, tiny_model_pe, tmp_path_factory):
    import torch

    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    repo = tmp_path_factory.mktemp("repository")
    shutil.copytree(tiny_model_pe, repo / "sage" / "1")
    torch.manual_seed(123)  # version 2: other weights, so its answers differ
    v2 = GNN(ModelSpec("sage", 16, 16, 4, num_layers=2)).eval()
    save_model(v2, repo / "sage" / "2", fanouts=[5, 3])
    precompute(GraphStore.open(tiny_dataset), v2, repo / "sage" / "2", progress=False)
    (repo / "sage" / "config.json").write_text('{"version_policy": {"all": {}}}')
    shutil.copytree(tiny_model_pe, repo / "other" / "3")
    (repo / "other" / "config.json").write_text('{"outputs": ["logits"]}')  # what a request naming none gets
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "config.json").write_text("{}")  # not a model directory
    grpc_port = free_port()
    seed_log = repo.parent / "repository-seeds.counts.npy"
    srv = ServerProcess(tiny_dataset, None, "--workers", "1", "--model-repository", str(repo), "--grpc-port",
                        str(grpc_port), "--update-token", TOKEN, "--seed-log", str(seed_log),
                        "--seed-log-interval-s", "0.2").wait_ready()
    srv.grpc_port, srv.seed_log = grpc_port, seed_log
    yield srv
    assert srv.stop() == 0


def _lookup(url: str, path: str, ids) -> requests.Response:
    body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": list(ids)}],
            "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]}
    return requests.post(f"{url}{path}/infer", json=body, timeout=30)


def test_requests_are_routed_by_model_and_version(repo_server):
    url = repo_server.url
    listed = requests.get(f"{url}/v2/models", timeout=10).json()["models"]
    assert [(m["name"], m["versions"]) for m in listed] == [("other", ["3"]), ("sage", ["1", "2"])]
    v1 = _lookup(url, "/v2/models/sage/versions/1", [0, 5, 9]).json()["outputs"][0]["data"]
    v2 = _lookup(url, "/v2/models/sage/versions/2", [0, 5, 9]).json()["outputs"][0]["data"]
    latest = _lookup(url, "/v2/models/sage", [0, 5, 9]).json()["outputs"][0]["data"]
    other = _lookup(url, "/v2/models/other", [0, 5, 9]).json()
    assert v1 != v2 and latest == v2 and other["outputs"][0]["data"] == v1 and other["model_name"] == "other"
    missing = _lookup(url, "/v2/models/sage/versions/7", [0])
    assert missing.status_code == 404 and "versions: ['1', '2']" in missing.json()["error"]
    unknown = _lookup(url, "/v2/models/broken", [0])
    assert unknown.status_code == 404 and "['other', 'sage']" in unknown.json()["error"]
    plain = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}],
             "parameters": {"mode": "precomputed"}}
    names = {m: [o["name"] for o in requests.post(f"{url}/v2/models/{m}/infer", json=plain, timeout=30).json()["outputs"]]
             for m in ("other", "sage")}
    assert names == {"other": ["logits"], "sage": ["logits", "embeddings", "predictions"]}
    meta = requests.get(f"{url}/v2/models/sage", timeout=10).json()
    assert meta["name"] == "sage" and meta["versions"] == ["1", "2"]


def test_repository_index_and_model_config_as_tritonclient_reads_them(repo_server):
    client = httpclient.InferenceServerClient(repo_server.url.removeprefix("http://"))
    index = {(m["name"], m["version"]): m for m in client.get_model_repository_index()}
    assert {k: m["state"] for k, m in index.items()} == {("other", "3"): "READY", ("sage", "1"): "READY",
                                                         ("sage", "2"): "READY", ("broken", "1"): "UNAVAILABLE"}
    assert index[("broken", "1")]["reason"]  # says why it is not served
    config = client.get_model_config("sage", "1")
    assert config["name"] == "sage" and config["input"][0]["name"] == "node_ids"
    assert config["input"][0]["data_type"] == "TYPE_INT64" and [o["name"] for o in config["output"]][0] == "logits"
    assert client.is_model_ready("sage", "2") and client.is_model_ready("other")
    x = httpclient.InferInput("node_ids", [2], "INT64")
    x.set_data_from_numpy(np.array([1, 2], np.int64), binary_data=True)
    out = client.infer("sage", [x], model_version="1", parameters={"mode": "precomputed"})
    assert out.as_numpy("logits").shape == (2, 4)



def _copy_in(src, dest):
    """Drop a version in as an operator should: copied beside, then renamed into place."""
    tmp = dest.parent / f".incoming-{dest.name}"
    shutil.copytree(src, tmp)
    tmp.rename(dest)


def test_a_new_version_switches_under_load_and_a_broken_one_leaves_the_old(tiny_dataset, tiny_model_pe, tmp_path):
    import threading

    import torch

    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_pe, repo / "m" / "1")
    shutil.copytree(tiny_model_pe, repo / "n" / "1")
    torch.manual_seed(7)
    save_model(GNN(ModelSpec("sage", 16, 16, 4, num_layers=2)).eval(), tmp_path / "v2", fanouts=[5, 3])  # no PEs
    srv = ServerProcess(tiny_dataset, None, "--workers", "1", "--model-repository", str(repo), "--update-token", TOKEN,
                        "--repository-poll-s", "0.2").wait_ready()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        v1 = _lookup(srv.url, "/v2/models/m", [1, 2, 3]).json()["outputs"][0]["data"]
        answers, stop = [], threading.Event()

        def load() -> None:  # steady load through the switch; every answer kept in order
            with requests.Session() as s:
                body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}],
                        "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]}
                while not stop.is_set():
                    r = s.post(f"{srv.url}/v2/models/m/infer", json=body, timeout=30)
                    answers.append((r.status_code, r.json()["outputs"][0]["data"] if r.ok else r.text))

        client = threading.Thread(target=load)
        client.start()
        try:
            _until(lambda: len(answers) >= 20, "answers from version 1 first")
            _copy_in(tmp_path / "v2", repo / "m" / "2")
            _until(lambda: requests.get(f"{srv.url}/v2/models/m", timeout=10).json()["versions"] == ["2"],
                   "version 2 replacing version 1", 120)
            switched = len(answers)
            _until(lambda: len(answers) >= switched + 20, "answers from version 2 after")
        finally:
            stop.set()
            client.join(60)
        answer = _lookup(srv.url, "/v2/models/m/versions/2", [1, 2, 3])
        v2 = answer.json()["outputs"][0]["data"]
        assert v2 != v1 and answer.json()["model_version"] == "2"
        # The retired version's drain is not the server's: connections stay open, ready stays 1.
        assert answer.headers.get("Connection", "").lower() != "close"
        assert "hybridgnn_ready 1.0" in requests.get(f"{srv.url}/metrics", timeout=10).text
        assert [s for s, _ in answers if s != 200] == [], "a request failed during the switch"
        kinds = ["v1" if a == v1 else "v2" if a == v2 else "?" for _, a in answers]
        assert "?" not in kinds and kinds[0] == "v1" and kinds[-1] == "v2"
        assert kinds == sorted(kinds), "answers went back to the old version after the switch"

        # A broken version 3: it fails to load, version 2 keeps serving, the index says why.
        (repo / "m" / ".incoming-3").mkdir()
        (repo / "m" / ".incoming-3" / "config.json").write_text("{}")
        (repo / "m" / ".incoming-3").rename(repo / "m" / "3")
        _until(lambda: ("m", "3") in _index(srv.url), "version 3 in the index")
        index = _index(srv.url)
        assert index[("m", "3")]["state"] == "UNAVAILABLE" and "class" in index[("m", "3")]["reason"]
        assert _lookup(srv.url, "/v2/models/m", [1, 2, 3]).json()["outputs"][0]["data"] == v2

        # Unload and load by API, behind the token.
        assert requests.post(f"{srv.url}/v2/repository/models/n/unload", timeout=30).status_code == 401
        r = requests.post(f"{srv.url}/v2/repository/models/n/unload", headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert _lookup(srv.url, "/v2/models/n", [1]).status_code == 404
        # A poll after the unload (it sees version 3 gone) leaves the unloaded model alone.
        (repo / "m" / "3").rename(repo / "m" / ".gone-3")
        _until(lambda: ("m", "3") not in _index(srv.url), "a poll after the unload")
        assert _lookup(srv.url, "/v2/models/n", [1]).status_code == 404
        r = requests.post(f"{srv.url}/v2/repository/models/n/load", headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["versions"] == ["1"], r.text
        assert _lookup(srv.url, "/v2/models/n", [1, 2, 3]).json()["outputs"][0]["data"] == v1
        r = requests.post(f"{srv.url}/v2/repository/models/zzz/load", headers=auth, timeout=30)
        assert r.status_code == 404 and "['m', 'n']" in r.json()["error"]

        # A change to a served version's configuration takes effect at the next poll.
        (repo / "n" / "config.json").write_text('{"outputs": ["predictions"]}')
        plain = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}]}
        _until(lambda: [o["name"] for o in requests.post(f"{srv.url}/v2/models/n/infer", json=plain,
                                                         timeout=30).json()["outputs"]] == ["predictions"],
               "the new configuration served")
        # A bad configuration leaves what serves in place and says why.
        (repo / "n" / "config.json").write_text('{"version_policy": {"latest": 3}}')
        r = requests.post(f"{srv.url}/v2/repository/models/n/load", headers=auth, timeout=30)
        assert r.status_code == 409 and "must be an object" in r.json()["error"]
        assert _lookup(srv.url, "/v2/models/n", [1]).status_code == 200
    finally:
        assert srv.stop() == 0


def test_statistics_count_what_each_version_answered(repo_server):
    client = httpclient.InferenceServerClient(repo_server.url.removeprefix("http://"))
    before = client.get_inference_statistics("sage", "1")["model_stats"][0]
    for _ in range(3):
        assert _lookup(repo_server.url, "/v2/models/sage/versions/1", [1, 2]).status_code == 200
    assert _lookup(repo_server.url, "/v2/models/sage/versions/1", [10**9]).status_code == 400
    body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [2], "data": [3, 4]}]}  # sampled
    assert requests.post(f"{repo_server.url}/v2/models/sage/versions/1/infer", json=body, timeout=30).ok
    after = client.get_inference_statistics("sage", "1")["model_stats"][0]
    s0, s1 = before["inference_stats"], after["inference_stats"]
    assert s1["success"]["count"] - s0["success"]["count"] == 4 and s1["fail"]["count"] - s0["fail"]["count"] == 1
    assert after["inference_count"] - before["inference_count"] == 8 and after["execution_count"] >= 1
    assert s1["success"]["ns"] > s0["success"]["ns"] and s1["compute_infer"]["count"] > s0["compute_infer"]["count"]
    everything = client.get_inference_statistics()["model_stats"]
    assert {(m["name"], m["version"]) for m in everything} == {("other", "3"), ("sage", "1"), ("sage", "2")}
    r = requests.get(f"{repo_server.url}/v2/models/sage/versions/5/stats", timeout=10)
    assert r.status_code == 404 and "versions: ['1', '2']" in r.json()["error"]


def test_the_seed_log_counts_requests_to_every_model_and_version(repo_server):
    """One count over the graph, whichever model or version a request named (the log was
    the first engine's only: requests to the others were never counted)."""
    url, counted = repo_server.url, {2990: 1, 2991: 2, 2992: 3}
    for path, ids in (("/v2/models/sage/versions/1", [2990, 2991]), ("/v2/models/sage/versions/2", [2991, 2992]),
                      ("/v2/models/other", [2992, 2992])):
        body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}]}  # sampled
        assert requests.post(f"{url}{path}/infer", json=body, timeout=30).ok

    def logged() -> bool:
        try:
            counts = np.load(repo_server.seed_log)
        except (OSError, ValueError):
            return False
        return all(counts[node] == n for node, n in counted.items())

    _until(logged, "the seed log to count the requests to every version", timeout_s=30)


def test_the_repository_over_grpc_answers_as_over_rest(repo_server):
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{repo_server.grpc_port}")
    h = httpclient.InferenceServerClient(repo_server.url.removeprefix("http://"))
    index = {(m.name, m.version): m.state for m in g.get_model_repository_index().models}
    assert index[("sage", "1")] == "READY" and index[("broken", "1")] == "UNAVAILABLE"
    config = g.get_model_config("sage", "2").config
    assert config.name == "sage" and config.input[0].name == "node_ids" and config.input[0].data_type == 9
    ids = np.array([4, 8, 15], np.int64)
    gi = grpcclient.InferInput("node_ids", [3], "INT64")
    gi.set_data_from_numpy(ids)
    hi = httpclient.InferInput("node_ids", [3], "INT64")
    hi.set_data_from_numpy(ids, binary_data=True)
    for version in ("1", "2"):
        a = g.infer("sage", [gi], model_version=version, parameters={"mode": "precomputed"}).as_numpy("logits")
        b = h.infer("sage", [hi], model_version=version, parameters={"mode": "precomputed"}).as_numpy("logits")
        assert np.array_equal(a, b)
    stats = g.get_inference_statistics("sage", "2").model_stats[0]
    assert stats.name == "sage" and stats.inference_stats.success.count >= 1
    with pytest.raises(grpcclient.InferenceServerException) as err:
        g.unload_model("other")  # no token
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    auth = {"authorization": f"Bearer {TOKEN}"}
    g.unload_model("other", headers=auth)  # routing stops before the answer; in-flight requests finish
    with pytest.raises(grpcclient.InferenceServerException) as err:
        g.infer("other", [gi], parameters={"mode": "precomputed"})
    assert err.value.status() == "StatusCode.NOT_FOUND"
    g.load_model("other", headers=auth)
    assert g.infer("other", [gi], parameters={"mode": "precomputed"}).as_numpy("logits").shape == (3, 4)
    # Triton's config override is refused, not ignored (the model was served as its files hold it)
    with pytest.raises(grpcclient.InferenceServerException) as err:
        g.load_model("other", headers=auth, config='{"max_batch_size": 8}')
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "not supported" in err.value.message()
    url = f"{repo_server.url}/v2/repository/models/other/load"
    for body, status in (({"parameters": {"config": "{}"}}, 400), ([], 400), ({"parameters": {}}, 200)):
        r = requests.post(url, json=body, headers=auth, timeout=120)
        assert r.status_code == status, r.text


def test_an_unload_whose_body_asks_what_it_cannot_do_is_refused_and_changes_nothing(repo_server):
    """The unload ignored its body: garbage, or parameters it does not take, unloaded the
    model all the same (a load's are refused)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{repo_server.url}/v2/repository/models/other/unload"
    for body in (b"\xff not json", b"[]", b'{"parameters": 7}', b'{"parameters": {"config": "{}"}}'):
        r = requests.post(url, data=body, headers=auth, timeout=60)
        assert r.status_code == 400 and r.headers["Content-Type"] == "application/json", (body, r.text)
        assert _served(repo_server.url, "other"), body
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{repo_server.grpc_port}")
    g.unload_model("other", headers={"authorization": f"Bearer {TOKEN}"}, unload_dependents=True)
    assert not _served(repo_server.url, "other")
    g.load_model("other", headers={"authorization": f"Bearer {TOKEN}"})
    client = httpclient.InferenceServerClient(repo_server.url.removeprefix("http://"))
    client.unload_model("other", headers=auth)  # tritonclient's body: {"parameters": {"unload_dependents": false}}
    assert not _served(repo_server.url, "other")
    client.load_model("other", headers=auth)
    assert _served(repo_server.url, "other")


def test_prometheus_series_carry_the_model_and_version(repo_server):
    from prometheus_client.parser import text_string_to_metric_families

    assert _lookup(repo_server.url, "/v2/models/sage/versions/2", [1]).ok
    assert _lookup(repo_server.url, "/v2/models/other", [1]).ok
    text = requests.get(f"{repo_server.url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    answered = {(s.labels["model"], s.labels["version"]) for s in families["hybridgnn_requests"].samples
                if s.name == "hybridgnn_requests_total" and s.labels["code"] == "200" and s.value > 0}
    assert {("sage", "2"), ("other", "3")} <= answered
    staged = {(s.labels["model"], s.labels["version"]) for s in families["hybridgnn_stage_seconds"].samples
              if s.labels.get("stage") == "total" and s.name.endswith("_count") and s.value > 0}
    assert {("sage", "2"), ("other", "3")} <= staged


def _two_models(tiny_model_pe, tmp_path):
    repo = tmp_path / "repo"
    for name in ("m", "n"):
        shutil.copytree(tiny_model_pe, repo / name / "1")
    return repo


def _served(url: str, model: str) -> bool:
    return _lookup(url, f"/v2/models/{model}", [1]).status_code == 200


def _listed_unloaded(url: str, model: str) -> bool:
    entry = _index(url).get((model, "1"))
    return entry is not None and (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded")


def _kill_9(srv) -> None:
    srv.proc.kill()
    srv.proc.wait(30)


def test_an_unload_survives_kill_9_and_so_does_a_load(tiny_dataset, tiny_model_pe, tmp_path):
    """An unload lived in the process's memory: a server restarted after it (or killed)
    served the model again."""
    repo = _two_models(tiny_model_pe, tmp_path)
    flags = ("--workers", "1", "--model-repository", str(repo), "--update-token", TOKEN, "--repository-poll-s", "0.2")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    srv = ServerProcess(tiny_dataset, None, *flags).wait_ready()
    try:
        r = requests.post(f"{srv.url}/v2/repository/models/n/unload", headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        _kill_9(srv)
        srv = ServerProcess(tiny_dataset, None, *flags, port=srv.port).wait_ready()
        assert not _served(srv.url, "n") and _served(srv.url, "m") and _listed_unloaded(srv.url, "n")
        r = requests.post(f"{srv.url}/v2/repository/models/n/load", headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["versions"] == ["1"], r.text
        _kill_9(srv)
        srv = ServerProcess(tiny_dataset, None, *flags, port=srv.port).wait_ready()
        assert _served(srv.url, "n") and _index(srv.url)[("n", "1")]["state"] == "READY"
    finally:
        srv.stop()


def test_an_unload_and_a_load_through_one_replica_reach_another_on_the_same_repository(tiny_dataset, tiny_model_pe,
                                                                                       tmp_path):
    repo = _two_models(tiny_model_pe, tmp_path)
    flags = ("--workers", "1", "--model-repository", str(repo), "--update-token", TOKEN, "--repository-poll-s", "0.2")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    a = ServerProcess(tiny_dataset, None, *flags)
    b = ServerProcess(tiny_dataset, None, *flags)
    try:
        a.wait_ready()
        b.wait_ready()
        r = requests.post(f"{a.url}/v2/repository/models/n/unload", headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        _until(lambda: not _served(b.url, "n") and _listed_unloaded(b.url, "n"), "the other replica to unload n",
               timeout_s=30)
        assert _served(b.url, "m")
        r = requests.post(f"{b.url}/v2/repository/models/n/load", headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        _until(lambda: _served(a.url, "n"), "the first replica to load n again", timeout_s=60)
    finally:
        a.stop()
        b.stop()


def _without_file_permission_override(tmp_path) -> list[str] | None:
    """What to run a command under so that a directory's permissions hold for it: nothing
    for a user other than root; for root, setpriv dropping the capabilities that override
    them. None when a directory without write permission is written all the same."""
    import os
    import subprocess
    import sys

    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            return None
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    probe = tmp_path / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", f"open({str(probe / 'x')!r}, 'w')"],
                              capture_output=True, timeout=60)
    finally:
        probe.chmod(0o755)
    return prefix if done.returncode != 0 else None


def test_an_unload_the_repository_cannot_record_changes_nothing_and_says_why(tiny_dataset, tiny_model_pe, tmp_path):
    import sys

    prefix = _without_file_permission_override(tmp_path)
    if prefix is None:
        pytest.skip("a directory without write permission is written all the same here (root without setpriv?)")
    repo = _two_models(tiny_model_pe, tmp_path)
    program = [*prefix, sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "serve"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    srv = ServerProcess(tiny_dataset, None, "--workers", "1", "--model-repository", str(repo), "--update-token", TOKEN,
                        "--repository-poll-s", "0.2", command=program).wait_ready()
    try:
        (repo / "n").chmod(0o555)
        r = requests.post(f"{srv.url}/v2/repository/models/n/unload", headers=auth, timeout=60)
        assert r.status_code == 409, r.text
        said = r.json()["error"]
        assert "must be recorded in the repository" in said and "restarts" in said and "every replica" in said
        assert "delete the model's directory" in said and "Permission denied" in said
        assert _served(srv.url, "n") and _index(srv.url)[("n", "1")]["state"] == "READY"
        # Unloaded while writable, then read-only: a load cannot remove the mark, and says so.
        (repo / "n").chmod(0o755)
        assert requests.post(f"{srv.url}/v2/repository/models/n/unload", headers=auth, timeout=60).status_code == 200
        (repo / "n").chmod(0o555)
        r = requests.post(f"{srv.url}/v2/repository/models/n/load", headers=auth, timeout=60)
        assert r.status_code == 409 and "must remove the mark" in r.json()["error"], r.text
        assert not _served(srv.url, "n") and _listed_unloaded(srv.url, "n")
    finally:
        (repo / "n").chmod(0o755)
        srv.stop()


def test_a_repository_whose_every_model_is_marked_unloaded_is_refused_in_one_line(tiny_dataset, tiny_model_pe,
                                                                                   tmp_path, capsys):
    from hybridgnn.cli.main import main
    from hybridgnn.serving.repository.layout import mark_unloaded

    repo = _two_models(tiny_model_pe, tmp_path)
    for name in ("m", "n"):
        mark_unloaded(repo / name, "a test")
    assert main(["serve", "--dataset", str(tiny_dataset), "--model-repository", str(repo), "--port",
                 str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "is marked unloaded" in err and err.count("\n") == 1, err
    assert str(repo / "m" / ".unloaded") in err and str(repo / "n" / ".unloaded") in err


def test_a_repository_unreadable_for_a_while_keeps_what_serves_and_answers_4xx(tiny_dataset, tiny_model_pe, tmp_path):
    """A model directory the server may not read refused the whole start (so did a bad
    config.json), and a poll while it was unreadable unloaded a served model; a load
    while the repository itself was unreadable answered 500."""
    import sys

    prefix = _without_file_permission_override(tmp_path)
    if prefix is None:
        pytest.skip("a directory without permissions is read all the same here (root without setpriv?)")
    repo = _two_models(tiny_model_pe, tmp_path)
    (repo / "bad" / "1").mkdir(parents=True)
    (repo / "bad" / "config.json").write_text("{not json")
    program = [*prefix, sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "serve"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    (repo / "n").chmod(0)
    try:
        srv = ServerProcess(tiny_dataset, None, "--workers", "1", "--model-repository", str(repo), "--update-token",
                            TOKEN, "--repository-poll-s", "0.2", command=program).wait_ready()
    finally:
        (repo / "n").chmod(0o755)
    try:
        _until(lambda: _served(srv.url, "n"), "n loaded once readable", timeout_s=60)
        index = _index(srv.url)
        assert index[("m", "1")]["state"] == "READY" and "not valid JSON" in index[("bad", "")]["reason"]
        (repo / "n").chmod(0)  # a served model's directory unreadable for a while: it serves on, the index says why
        _until(lambda: "Permission denied" in _index(srv.url).get(("n", ""), {}).get("reason", ""),
               "a poll to find n unreadable", timeout_s=30)
        assert _served(srv.url, "n") and _index(srv.url)[("n", "1")]["state"] == "READY"
        (repo / "n").chmod(0o755)
        repo.chmod(0)  # the repository itself unreadable: load and unload answer 409, not 500
        for path in ("n/load", "n/unload", "nosuch/load"):
            r = requests.post(f"{srv.url}/v2/repository/models/{path}", headers=auth, timeout=60)
            assert r.status_code == 409 and "cannot be read: Permission denied" in r.json()["error"], (path, r.text)
        assert _served(srv.url, "n") and _served(srv.url, "m")
        repo.chmod(0o755)
        _until(lambda: ("n", "") not in _index(srv.url), "the next poll to find n readable again", timeout_s=30)
        assert _served(srv.url, "n") and not (repo / "n" / ".unloaded").exists()
    finally:
        repo.chmod(0o755)
        (repo / "n").chmod(0o755)
        assert srv.stop() == 0
