"""`hybridgnn serve --partitions N` as a user runs it: a real server with real partition
rank processes on 127.0.0.1, asked over HTTP. Answers equal one process's; a killed rank
turns readiness off and requests get 503 (never a wrong answer) until the group is back."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import requests

from hybridgnn.embeddings.newnodes import NewNodeEvaluator
from hybridgnn.embeddings.store import EmbeddingStore, hidden_rows
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import load_checkpoint
from tests.support.partitioned import random_query, torchrun_ranks
from tests.support.reference import full_graph_forward
from tests.support.server import (
    ServerProcess,
    children_of,
    exit_codes_within,
    poll_ready,
    process_alive,
    stop_process,
)

URL = "/v2/models/hybridgnn/infer"


def _ids_body(ids, mode=None) -> dict:
    body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": [int(i) for i in ids]}]}
    if mode is not None:
        body["parameters"] = {"mode": mode}
    return body


def _new_body(features: np.ndarray, edge_index: np.ndarray, mode: str, gamma: float) -> dict:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(features.shape),
                        "data": features.ravel().tolist()},
                       {"name": "edge_index", "datatype": "INT64", "shape": list(edge_index.shape),
                        "data": edge_index.ravel().tolist()}],
            "parameters": {"mode": mode, "gamma": gamma}}


def _outputs(response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in response.json()["outputs"]}


@pytest.fixture(scope="module")
def partitioned_server(tiny_dataset, tiny_model_pe):
    server = ServerProcess(tiny_dataset, tiny_model_pe, "--partitions", "2", "--partition", "ranges",
                           "--max-wait-ms", "1").wait_ready(180)
    yield server
    assert server.stop() == 0, server.output()
    assert not children_of(server.proc.pid)


def test_answers_equal_one_process(partitioned_server, tiny_dataset, tiny_model_pe):
    url = partitioned_server.url
    graph = GraphStore.open(tiny_dataset)
    model = load_checkpoint(tiny_model_pe)[0].eval()
    store = EmbeddingStore.open(tiny_model_pe, graph.fingerprint)
    ids = np.array([0, 17, 2999, 17, 1500, 42])

    full = _outputs(requests.post(url + URL, json=_ids_body(ids), timeout=60))  # mode full: the default
    np.testing.assert_allclose(full["logits"], full_graph_forward(graph, model)[ids], atol=1e-4)

    looked = _outputs(requests.post(url + URL, json=_ids_body(ids, "precomputed"), timeout=60))
    np.testing.assert_allclose(looked["logits"], store.lookup(ids), atol=1e-6)
    np.testing.assert_allclose(looked["embeddings"], hidden_rows(model, store.layers, graph.features.__getitem__,
                                                                 ids), atol=1e-6)

    single = NewNodeEvaluator(graph, model, store)
    feats, ei = random_query(graph.num_nodes, graph.feature_dim, 3, 4, seed=5)
    fanouts = requests.get(url + "/v2/models/hybridgnn", timeout=30).json()["parameters"]["fanouts"]
    for mode in ("full", "pe", "srpe", "sampled"):
        got = _outputs(requests.post(url + URL, json=_new_body(feats, ei, mode, 0.5), timeout=60))
        want = single.infer(feats, ei, mode=mode, gamma=0.5, fanouts=tuple(fanouts))
        np.testing.assert_allclose(got["logits"], want.logits, atol=1e-4, err_msg=mode)
        np.testing.assert_allclose(got["embeddings"], want.embeddings, atol=1e-4, err_msg=mode)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(partitioned_server, tiny_dataset,
                                                                   tiny_model_pe):
    from concurrent.futures import ThreadPoolExecutor

    graph = GraphStore.open(tiny_dataset)
    store = EmbeddingStore.open(tiny_model_pe, graph.fingerprint)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, graph.num_nodes, size=int(rng.integers(1, 40))) for _ in range(24)]

    def ask(ids):
        return ids, requests.post(partitioned_server.url + URL, json=_ids_body(ids, "precomputed"), timeout=60)

    answered = 0
    with ThreadPoolExecutor(8) as pool:
        for ids, r in pool.map(ask, batches):
            if r.status_code == 429:  # admission under a loaded machine: refused, never wrong
                continue
            np.testing.assert_allclose(_outputs(r)["logits"], store.lookup(ids), atol=1e-6)
            answered += 1
    assert answered, "every request was refused: nothing was checked"  # the first one, on an empty queue, is admitted


def test_what_a_partitioned_graph_cannot_serve_exactly_is_refused(partitioned_server):
    url = partitioned_server.url
    r = requests.post(url + URL, json=_ids_body([1, 2], "sampled"), timeout=30)
    assert r.status_code == 400 and "full" in r.json()["error"]
    feats, ei = random_query(3000, 16, 1, 2, seed=1)
    r = requests.post(url + URL, json=_new_body(feats, ei, "bogus", 0.1), timeout=30)
    assert r.status_code == 400 and "srpe" in r.json()["error"]
    r = requests.post(url + URL, json=_ids_body([3000]), timeout=30)
    assert r.status_code == 400
    meta = requests.get(url + "/v2/models/hybridgnn", timeout=30).json()["parameters"]
    assert meta["partitions"]["ranks"] == 2 and meta["modes"] == ["full", "precomputed"]


def test_the_seed_log_of_a_partitioned_server_feeds_workload_build(tmp_path, tiny_dataset, tiny_model_pe):
    """--seed-log on a partitioned server wrote nothing: its engine counted no requests.
    Now the ids of full requests are counted per node (lookups are not), written while
    serving every --seed-log-interval-s and at SIGTERM, as the .counts.npy `workload build
    --seeds` takes for the dataset."""
    import json
    import subprocess
    import sys

    from hybridgnn.workload.tables import WorkloadTables

    graph = GraphStore.open(tiny_dataset)
    log = tmp_path / "seeds.counts.npy"
    server = ServerProcess(tiny_dataset, tiny_model_pe, "--partitions", "2", "--partition", "ranges",
                           "--max-wait-ms", "1", "--seed-log", str(log), "--seed-log-interval-s", "0.2"
                           ).wait_ready(180)
    want = np.zeros(graph.num_nodes, np.int64)
    hot = np.arange(2900, 2910)
    try:
        session = requests.Session()
        for ids, mode in [(hot, None)] * 3 + [(np.array([5, 5]), "full"), (np.array([7]), "precomputed")]:
            r = session.post(server.url + URL, json=_ids_body(ids, mode), timeout=60)
            assert r.status_code == 200, r.text
            if mode != "precomputed":
                np.add.at(want, ids, 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # written while serving (replaced whole: never a torn read)
            if log.is_file() and np.array_equal(np.load(log), want):
                break
            time.sleep(0.05)  # poll interval, bounded by the deadline
        else:
            raise AssertionError(f"the seed log never held the requests' counts:\n{log.is_file()}")
    finally:
        assert server.stop() == 0, server.output()  # SIGTERM: written once more at stop
    counts = np.load(log)
    assert counts.dtype == np.int64 and np.array_equal(counts, want)
    assert [p.name for p in tmp_path.iterdir()] == [log.name]  # no temporary left beside it
    done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "workload", "build",
                           "--dataset", str(tiny_dataset), "--fanouts", "4,2", "--seeds", str(log)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tables = WorkloadTables.load_or_build(graph, [4, 2], log, save=False)
    assert json.loads(done.stdout)["fap"].endswith(f"_{tables.seed_key}.npy")
    uniform = WorkloadTables.build(graph, [4, 2], "uniform")
    fap, flat = np.asarray(tables.fap), np.asarray(uniform.fap)
    assert fap[hot].sum() / fap.sum() > 5 * flat[hot].sum() / flat.sum()  # the requested nodes are read most


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_turns_readiness_off_and_the_group_rejoins(partitioned_server, tiny_dataset, tiny_model_pe,
                                                                 victim):
    url = partitioned_server.url
    graph = GraphStore.open(tiny_dataset)
    store = EmbeddingStore.open(tiny_model_pe, graph.fingerprint)
    ids = np.array([3, 1999, 2500])
    poll_ready(url, 200, 60)
    ranks = children_of(partitioned_server.proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[victim], signal.SIGKILL)
    statuses = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # every answer is 503 or the right rows, until the group is back
        r = requests.post(url + URL, json=_ids_body(ids, "precomputed"), timeout=60)
        statuses.add(r.status_code)
        if r.status_code == 503:
            assert "Retry-After" in r.headers and "partition ranks are down" in r.json()["error"]
        else:
            np.testing.assert_allclose(_outputs(r)["logits"], store.lookup(ids), atol=1e-6)
            if 503 in statuses:
                break
        time.sleep(0.05)  # poll interval, bounded by the deadline
    assert statuses >= {503, 200}, statuses
    poll_ready(url, 200, 5)
    assert len(children_of(partitioned_server.proc.pid)) == 2
    meta = requests.get(url + "/v2/models/hybridgnn", timeout=30).json()["parameters"]["partitions"]
    assert meta["up"] and meta["restarts"] >= 1


def test_a_stopped_rank_turns_readiness_off_while_a_call_waits_for_it(partitioned_server, tiny_dataset,
                                                                      tiny_model_pe):
    """A rank stopped with SIGSTOP holds the call on the ranks (and every request behind
    it) until the ranks' timeout, 60 s, and readiness said 200 meanwhile: it now says 503
    once the call has waited 5 s, so a balancer routes away, and new requests get 503 at
    once; after SIGCONT the call ends with the right rows and readiness comes back."""
    import threading

    url = partitioned_server.url
    graph = GraphStore.open(tiny_dataset)
    store = EmbeddingStore.open(tiny_model_pe, graph.fingerprint)
    ids = np.array([4, 2600])
    poll_ready(url, 200, 60)
    rank = children_of(partitioned_server.proc.pid)[1]
    os.kill(rank, signal.SIGSTOP)
    answers = []
    try:
        held = threading.Thread(target=lambda: answers.append(
            requests.post(url + URL, json=_ids_body(ids, "precomputed"), timeout=60)))
        held.start()
        poll_ready(url, 503, 30)
        meta = requests.get(url + "/v2/models/hybridgnn", timeout=30).json()["parameters"]["partitions"]
        assert meta["up"] and meta["stalled_s"] >= 5, meta
        # a new request is refused at once, not queued behind the held call
        t0 = time.monotonic()
        late = requests.post(url + URL, json=_ids_body(ids, "precomputed"), timeout=30)
        assert late.status_code == 503 and late.headers["Retry-After"], late.text
        assert "have not answered" in late.json()["error"] and time.monotonic() - t0 < 5
    finally:
        os.kill(rank, signal.SIGCONT)
    held.join(60)
    np.testing.assert_allclose(_outputs(answers[0])["logits"], store.lookup(ids), atol=1e-6)
    poll_ready(url, 200, 30)


@pytest.fixture(scope="module")
def torchrun_group(tiny_dataset, tiny_model_pe):
    """Two ranks under torchrun (which starts them again, twice at most), shared by the
    tests of `serve --ranks`: ranks outlive the servers that link to them, and one
    refused at start leaves them as they were."""
    torchrun, listen = torchrun_ranks(tiny_dataset, tiny_model_pe, "--max-restarts", "2")
    yield torchrun, listen
    os.killpg(torchrun.pid, signal.SIGTERM)
    stop_process(torchrun, 30)


def test_ranks_of_another_model_or_group_size_are_refused_at_start_in_one_line(tmp_path, tiny_dataset, tiny_model_pe,
                                                                            torchrun_group):
    """--ranks may reach ranks started with another model: the server served their answers
    under its own model's name (and would replay its update log into them)."""
    import subprocess
    import sys

    import torch

    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.gnn import GNN, ModelSpec

    torch.manual_seed(7)
    other = tmp_path / "other"
    save_checkpoint(GNN(ModelSpec("sage", 16, 16, 4, num_layers=2)).eval(), other)
    _, listen = torchrun_group
    for model, partitions, wrong in ((other, "2", "model_fingerprint"), (tiny_model_pe, "3", "ranks 2, not 3")):
        done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "ERROR", "serve",
                               "--dataset", str(tiny_dataset), "--model", str(model), "--partitions", partitions,
                               "--ranks", listen, "--port", "0"], capture_output=True, text=True, timeout=150)
        assert done.returncode == 2, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("hybridgnn serve: error: the partition ranks at") and wrong in last, last


def test_ranks_started_by_torchrun_serve_and_rejoin_after_torchrun_restarts_them(tiny_dataset, tiny_model_pe,
                                                                                  torchrun_group):
    graph = GraphStore.open(tiny_dataset)
    store = EmbeddingStore.open(tiny_model_pe, graph.fingerprint)
    torchrun, listen = torchrun_group
    server = None
    try:
        server = ServerProcess(tiny_dataset, tiny_model_pe, "--partitions", "2", "--ranks", listen).wait_ready(180)
        ids = np.array([4, 2222])
        r = requests.post(server.url + URL, json=_ids_body(ids, "precomputed"), timeout=60)
        np.testing.assert_allclose(_outputs(r)["logits"], store.lookup(ids), atol=1e-6)
        agent_children = children_of(torchrun.pid)
        assert len(agent_children) == 2
        os.kill(agent_children[-1], signal.SIGKILL)
        poll_ready(server.url, 503, 30)
        poll_ready(server.url, 200, 120)  # torchrun started the group again; the server linked to its rank 0
        r = requests.post(server.url + URL, json=_ids_body(ids, "precomputed"), timeout=60)
        np.testing.assert_allclose(_outputs(r)["logits"], store.lookup(ids), atol=1e-6)
    finally:
        if server is not None:
            assert server.stop() == 0, server.output()


def test_ranks_pointing_at_what_is_no_rank_0_is_refused_at_start_in_one_line(tiny_dataset, tiny_model_pe):
    """Its first bytes read as a frame of up to 2 GB: the server waited for the rest for ever."""
    import contextlib
    import socket
    import subprocess
    import sys
    import threading

    with socket.create_server(("127.0.0.1", 0)) as other:  # say, an SSH server
        def greet():
            conn, _ = other.accept()
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.recv(1)  # until the server hangs up

        threading.Thread(target=greet, daemon=True).start()
        done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "ERROR", "serve", "--dataset",
                               str(tiny_dataset), "--model", str(tiny_model_pe), "--partitions", "2", "--ranks",
                               f"127.0.0.1:{other.getsockname()[1]}", "--port", "0"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridgnn serve: error: what answers at") and "did not greet as partition rank 0" in last


def test_a_model_without_merge_functions_is_refused_at_start_in_one_line(tmp_path, tiny_dataset):
    import subprocess
    import sys

    from torch_geometric.nn.models import GIN

    from hybridgnn.models.checkpoint import save_model

    save_model(GIN(16, 8, 2, 4).eval(), tmp_path / "gin")
    done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "ERROR", "serve", "--dataset",
                           str(tiny_dataset), "--model", str(tmp_path / "gin"), "--partitions", "2", "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridgnn serve: error:") and "GINConv" in last and "without --partitions" in last


def test_a_call_waiting_on_rank_0_sees_a_local_rank_die_at_once(tmp_path):
    """With a rank dead, rank 0 waits in a collective until the ranks' timeout; the call
    (a heartbeat ping included) must not hide the failure that long."""
    import socket
    import subprocess
    import sys
    import time

    from hybridgnn.serving.ipc.ranks import Link
    from hybridgnn.serving.ipc.wire import WireError
    from hybridgnn.serving.partitions import RankGroup

    group = object.__new__(RankGroup)
    ours, rank0 = socket.socketpair()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    group._local, group._link, group.world = True, Link(ours), 2
    group._procs, group._errors = [alive, dead], [tmp_path / "rank-0.txt", tmp_path / "rank-1.txt"]
    try:
        t0 = time.monotonic()
        with pytest.raises(WireError, match="rank 1 of 2 exited with code 0"):
            group._await_answer(60.0)  # rank 0 never answers
        assert time.monotonic() - t0 < 5.0
        group._procs = [alive]
        rank0.send(b"x")  # an answer that starts arriving ends the wait
        group._await_answer(60.0)
    finally:
        alive.kill()
        alive.wait()
        ours.close()
        rank0.close()


def test_a_sigterm_to_every_process_of_the_server_drains_through_the_ranks(tiny_dataset, tiny_model_pe):
    """systemd's default KillMode=control-group sends SIGTERM to every process of the
    service at once: the ranks died of it while the server drained, and its admitted
    requests got 503 "partition ranks are down". Ranks a server started stop when it
    stops them: every request is answered, or refused as the drain refuses."""
    import threading

    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--partitions", "2", "--partition", "ranges",
                        "--max-wait-ms", "20", own_group=True).wait_ready(180)
    outcomes, stop = [], threading.Event()

    def client(seed: int) -> None:
        rng, session = np.random.default_rng(seed), requests.Session()
        while not stop.is_set():
            try:
                r = session.post(srv.url + URL, json=_ids_body(rng.integers(0, 3000, 4), "precomputed"), timeout=60)
            except requests.ConnectionError:
                return  # the listener closed
            outcomes.append((r.status_code, r.text))

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    try:
        for t in clients:
            t.start()
        deadline = time.monotonic() + 60
        while len(outcomes) < 20:
            assert time.monotonic() < deadline, "clients made no progress"
            time.sleep(0.05)  # poll interval, bounded by the deadline
        ranks = children_of(srv.proc.pid)
        assert len(ranks) == 2
        for pid in [srv.proc.pid, *ranks]:
            os.kill(pid, signal.SIGTERM)
        code = srv.proc.wait(60)
    finally:
        stop.set()
        for t in clients:
            t.join(30)
        if srv.proc.poll() is None:
            srv.stop()
    out = srv.output()
    assert code == 0, out
    assert "partitioned serving is down" not in out, out
    # a 429 is admission's queueing-delay bound on a loaded machine: a clean answer too
    refused = [(status, text) for status, text in outcomes if status not in (200, 429)]
    assert all(status == 503 and "shutting down" in text for status, text in refused), refused
    assert not any(process_alive(pid) for pid in ranks)


@pytest.mark.parametrize("differ", ["embeddings", "partition"])
def test_ranks_that_disagree_exit_at_once_in_one_line_naming_what_differs(tmp_path, tiny_dataset, tiny_model_pe,
                                                                          differ):
    """Ranks under torchrun on two machines, one of which lacks the precomputed embeddings
    (or resolves `--partition auto` to another method): their collectives went out of step
    and they served wrong rows, or waited out the ranks' timeout at every restart. Every
    rank now exits at start with the one line naming the field and each rank's value."""
    import shutil
    import subprocess
    import sys

    from hybridgnn.distributed.partition import metis_available
    from hybridgnn.runtime.ranks import HostedStore, rank_environment

    if differ == "partition" and not metis_available():
        pytest.skip("needs pymetis for a second partition method")
    bare = tmp_path / "bare"  # the same weights, without the embeddings
    shutil.copytree(tiny_model_pe, bare, ignore=shutil.ignore_patterns("embeddings"))
    models = (tiny_model_pe, bare) if differ == "embeddings" else (tiny_model_pe, tiny_model_pe)
    methods = ("ranges", "ranges") if differ == "embeddings" else ("metis", "ranges")
    store = HostedStore()  # where the ranks meet, as a server's ranks do
    port, listen = store.port, f"unix:{tmp_path / 'rank0.sock'}"
    errors = [tmp_path / f"rank-{r}.txt" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "hybridgnn.distributed.rank_server", "--dataset",
                               str(tiny_dataset), "--model", str(models[r]), "--listen", listen,
                               "--partition", methods[r], "--timeout-s", "600", "--log-level", "WARNING"],
                              env=rank_environment(r, 2, port, 1, errors[r]), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    codes = exit_codes_within(procs, 120)  # well inside the ranks' 600 s timeout
    assert codes == [1, 1]
    want = ("embeddings '" if differ == "embeddings" else "partition 'metis' on rank 0, 'ranges' on rank 1")
    for r in range(2):
        said = errors[r].read_text().strip()
        assert said.startswith("ConfigError: the 2 partition ranks do not agree on ") and want in said, said
        if differ == "embeddings":
            assert said.endswith("none on rank 1: give every rank the same --dataset, --model and --partition, "
                                 "with the same files (and precomputed embeddings) on every machine, and the same "
                                 "hybridgnn"), said
        assert "\n" not in said
        assert said.split(": ", 1)[1] in procs[r].stderr.read()


def test_ranks_of_a_server_killed_as_they_start_stop_within_seconds(tiny_dataset, tiny_model_pe):
    """A server killed with -9 as its ranks started took their rendezvous store with it; the
    ranks retried its port for minutes (torch's client retries a refused connection for
    about twice the 60 s timeout), outliving the server, and might meet whatever bound the
    port next. A rank now gives up as soon as a try fails with its starter gone."""
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--partitions", "2", "--partition", "ranges")
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2:  # killed before the ranks reach the store (they import torch first)
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.output()
            ranks = children_of(srv.proc.pid)
            time.sleep(0.02)  # poll interval, bounded by the deadline
    finally:
        srv.proc.kill()
        srv.proc.wait(30)
    deadline = time.monotonic() + 30
    while any(process_alive(pid) for pid in ranks):
        if time.monotonic() > deadline:
            for pid in ranks:
                if process_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError("the ranks of a server killed with -9 were still running 30 s later")
        time.sleep(0.05)  # poll interval, bounded by the deadline
