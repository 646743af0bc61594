"""`hybridgnn serve --frontends 2` as real processes on 127.0.0.1: requests arriving at
both front ends share the engine's batches; a front end killed under load loses nothing
acknowledged on the other's connections and comes back; a dead engine takes its front
ends down with it (nothing accepts without an engine behind it)."""

from __future__ import annotations

import http.client
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

from hybridgnn.serving.frontends import reserve_port
from hybridgnn.serving.ipc import wire
from tests.support.frontends import connection_to, frontend_pids, wait_for_frontends
from tests.support.server import ServerProcess, free_port, metrics_text, process_alive

MODEL = "hybridgnn"


def body(ids, **kw) -> bytes:
    return json.dumps({"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64",
                                   "data": list(ids)}], **kw}).encode()


def post(conn: http.client.HTTPConnection, ids, **kw) -> tuple[int, dict]:
    conn.request("POST", f"/v2/models/{MODEL}/infer", body(ids, **kw), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def post_once(sock: socket.socket, ids) -> tuple[int, dict]:
    """post() on a connection of its own, closed after the answer."""
    conn = on(sock)
    try:
        return post(conn, ids)
    finally:
        conn.close()


def on(sock: socket.socket) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", sock.getpeername()[1], timeout=30)
    conn.sock = sock
    return conn


@pytest.fixture(scope="module")
def pair(tiny_dataset, tiny_model, tmp_path_factory):
    """One server with two front ends (and gRPC on them), shared by the tests that leave
    it serving: each takes the front ends' pids afresh, counts restarts from where they
    stood, and reads only what the server printed since it began (said_since)."""
    import importlib.util

    grpc_port = free_port() if importlib.util.find_spec("grpc") else None  # the stopped engine's test asks it
    out = tmp_path_factory.mktemp("pair") / "server.log"
    srv = ServerProcess(tiny_dataset, tiny_model, "--frontends", "2", "--workers", "1",
                        *(("--grpc-port", str(grpc_port)) if grpc_port else ()), output_file=out).wait_ready()
    srv.grpc_port = grpc_port
    yield srv
    assert srv.stop() == 0, srv.output()


def said_since(srv: ServerProcess, start: int, *texts: str, timeout_s: float = 30.0) -> str:
    """What srv printed after offset `start`, once it holds every one of texts (a line is
    written a moment after what it reports)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = srv.output()[start:]
        if all(t in out for t in texts):
            return out
        assert time.monotonic() < deadline, f"the server never said {texts}:\n{out}"
        time.sleep(0.1)  # poll interval, bounded by the deadline


def restarts(url: str) -> list[float]:
    m = samples(url)
    return [m.get(("hybridgnn_frontend_restarts_total", (("frontend", str(i)),)), 0) for i in (0, 1)]


def samples(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics_text(url)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_requests_at_both_front_ends_are_batched_together(tiny_dataset, tiny_model):
    # A batch closes at 2 requests or after 10 s, even with the worker idle (--wait-when-idle):
    # two requests answered at once, in one batch of two, had to meet in the engine's one
    # batcher (a window far longer than the bound below, so that a loaded machine's slow
    # answer is never taken for a missed batch).
    srv = ServerProcess(tiny_dataset, tiny_model, "--frontends", "2", "--workers", "1", "--max-wait-ms", "10000",
                        "--wait-when-idle", "--max-batch-requests", "2", "--max-queue-delay-ms", "60000").wait_ready()
    try:
        pids = wait_for_frontends(srv.proc.pid, 2)
        conns = [on(connection_to(srv.port, i, pids)) for i in (0, 1)]
        answers = [None, None]

        def ask(i):
            answers[i] = post(conns[i], [i + 1])

        t0 = time.monotonic()
        threads = [threading.Thread(target=ask, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        took = time.monotonic() - t0
        assert [a[0] for a in answers] == [200, 200], answers
        assert took < 8, f"the two requests waited {took:.2f}s: they were not batched together"
        m = samples(srv.url)
        assert m[("hybridgnn_batch_requests_count", (("pipeline", "cpu"),))] == 1
        assert m[("hybridgnn_batch_requests_sum", (("pipeline", "cpu"),))] == 2
        # each front end reports what it sent on (its report is flushed by the scrape it serves,
        # the other's within a second)
        deadline = time.monotonic() + 5
        while True:
            m = samples(srv.url)
            sent = [m.get(("hybridgnn_frontend_requests_total", (("frontend", str(i)),)), 0) for i in (0, 1)]
            if all(s >= 1 for s in sent) or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # poll interval, bounded by the deadline
        assert all(s >= 1 for s in sent), sent
        assert m[("hybridgnn_frontend_up", (("frontend", "0"),))] == 1
        assert m[("hybridgnn_frontend_resident_memory_bytes", (("frontend", "1"),))] > 0
        for conn in conns:
            conn.close()
    finally:
        assert srv.stop() == 0, srv.output()


def test_a_front_end_killed_under_load_comes_back_and_the_other_loses_nothing(pair):
    srv, start = pair, len(pair.output())
    pids = wait_for_frontends(srv.proc.pid, 2)
    before = restarts(srv.url)
    survivors = [on(connection_to(srv.port, 1, pids)) for _ in range(3)]
    victims = [on(connection_to(srv.port, 0, pids)) for _ in range(3)]
    stop = threading.Event()
    results: dict[str, list] = {"survivor": [], "victim": []}

    def client(conn, kind, seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            ids = rng.integers(0, 3000, size=4).tolist()
            try:
                status, answer = post(conn, ids)
            except (OSError, http.client.HTTPException) as exc:
                results[kind].append(("error", repr(exc)))
                return
            results[kind].append((status, answer))

    threads = [threading.Thread(target=client, args=(c, "survivor", i)) for i, c in enumerate(survivors)]
    threads += [threading.Thread(target=client, args=(c, "victim", 10 + i)) for i, c in enumerate(victims)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while len(results["survivor"]) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval, bounded by the deadline
        os.kill(pids[0], signal.SIGKILL)
        back = wait_for_frontends(srv.proc.pid, 2, exclude={pids[0]})
        count = len(results["survivor"])
        while len(results["survivor"]) < count + 30 and time.monotonic() < deadline + 30:
            time.sleep(0.05)  # poll interval, bounded by the deadline
    finally:  # the clients stop whatever happened: the server goes on to the next test
        stop.set()
        for t in threads:
            t.join(30)
        for conn in survivors + victims:
            conn.close()
    # every request on the surviving front end's connections was answered: served, or refused
    # by admission with 429 (six clients on two cores may overload it, which is an answer too)
    served = [a for s, a in results["survivor"] if s == 200]
    assert served and all(s in (200, 429) for s, _ in results["survivor"]), [
        r for r in results["survivor"] if r[0] not in (200, 429)][:3]
    assert all(len(a["outputs"][0]["data"]) > 0 for a in served)
    # the killed one's connections ended (an error, never a hang), after answers that were answers
    assert all(r[0] in (200, 429) for r in results["victim"] if r[0] != "error"), results["victim"][-3:]
    assert back[0] != pids[0] and back[1] == pids[1]
    # the new front end serves
    status, _ = post_once(connection_to(srv.port, 0, back), [5])
    assert status == 200
    assert restarts(srv.url) == [before[0] + 1, before[1]]
    said_since(srv, start, "front end 0", "starting it again")


def test_sighup_at_readiness_and_to_every_process_stops_nothing(tiny_dataset, tiny_model):
    """SIGHUP (refresh the GPU cache) is handled from before anything listens, and front
    ends ignore it: a signal to the process group must not kill them. (A server of its
    own: the first SIGHUP comes the moment it is ready, while a front end may still be
    starting.)"""
    srv = ServerProcess(tiny_dataset, tiny_model, "--frontends", "2", "--workers", "1").wait_ready()
    try:
        srv.proc.send_signal(signal.SIGHUP)  # the other front end may still be starting
        pids = wait_for_frontends(srv.proc.pid, 2)
        for index in (0, 1):  # both serving: each has set its signals (a process just exec'd has not)
            status, _ = post_once(connection_to(srv.port, index, pids), [4])
            assert status == 200
        for pid in pids.values():
            os.kill(pid, signal.SIGHUP)
        srv.proc.send_signal(signal.SIGHUP)
        for index in (0, 1):
            status, _ = post_once(connection_to(srv.port, index, pids), [5])
            assert status == 200
        assert wait_for_frontends(srv.proc.pid, 2) == pids
        assert restarts(srv.url) == [0, 0]
    finally:
        assert srv.stop() == 0, srv.output()


def test_a_dead_engine_takes_its_front_ends_down(tiny_dataset, tiny_model):
    srv = ServerProcess(tiny_dataset, tiny_model, "--frontends", "2", "--workers", "1").wait_ready()
    pids = wait_for_frontends(srv.proc.pid, 2)
    assert requests.post(f"{srv.url}/v2/models/{MODEL}/infer", data=body([1]), timeout=30).status_code == 200
    srv.proc.kill()
    srv.proc.wait(30)
    deadline = time.monotonic() + 15
    alive = list(pids.values())
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if process_alive(p)]
        time.sleep(0.05)  # poll interval, bounded by the deadline
    assert not alive, f"front ends {alive} outlived their engine"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2)
    out = srv.output()
    assert "the engine process is gone" in out, out


def test_front_ends_hold_no_torch_and_little_memory(pair):
    pids = wait_for_frontends(pair.proc.pid, 2)
    for pid in pids.values():
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps
    assert frontend_pids(pair.proc.pid) == pids


def test_true_or_false_among_numbers_is_a_400_naming_the_input_at_a_front_end(pair):
    """A front end made an array of [true, 5] (1 and 5) and the engine served it."""
    conn = http.client.HTTPConnection("127.0.0.1", pair.port, timeout=30)
    try:
        for ids in ([True, 5], [5, False]):
            status, answer = post(conn, ids)
            assert status == 400 and answer == {
                "error": "input 'node_ids': 'data' must hold integers, not true/false"}, answer
        new_nodes = {"inputs": [{"name": "features", "shape": [1, 2], "datatype": "FP32", "data": [[0.5, True]]},
                                {"name": "edge_index", "shape": [2, 1], "datatype": "INT64", "data": [[-1], [3]]}]}
        conn.request("POST", f"/v2/models/{MODEL}/infer", json.dumps(new_nodes).encode(),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 400 and json.loads(r.read()) == {
            "error": "input 'features': 'data' must hold numbers, not true/false"}
        status, answer = post(conn, [1, 5])  # the same without them is served
        assert status == 200, answer
    finally:
        conn.close()


def test_the_held_port_refuses_a_taken_one_and_lets_front_ends_bind_beside_it():
    held = reserve_port("127.0.0.1", 0)
    try:
        port = held.getsockname()[1]
        beside = socket.socket()
        beside.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        beside.bind(("127.0.0.1", port))
        beside.listen()
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", port)  # a second server cannot join the port
        beside.close()
    finally:
        held.close()


def test_front_ends_answer_lookups_themselves_and_every_one_is_counted_at_once(tiny_dataset, tiny_model_pe):
    """Precomputed lookups are answered by the front end that parsed them (nothing goes to
    the engine), the same as a one-process server answers; a statistics read or a scrape at
    the other front end, straight after, counts every one of them."""
    lookups = [(ids, {"parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}, {"name": "embeddings"}]})
               for ids in ([1], [5, 7], [2999, 0, 3])]
    one = ServerProcess(tiny_dataset, tiny_model_pe, "--frontends", "1", "--workers", "1").wait_ready()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", one.port, timeout=30)
        reference = [post(conn, ids, **kw) for ids, kw in lookups]
        conn.close()
    finally:
        assert one.stop() == 0, one.output()
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--frontends", "2", "--workers", "1").wait_ready()
    try:
        pids = wait_for_frontends(srv.proc.pid, 2)
        first, second = on(connection_to(srv.port, 0, pids)), on(connection_to(srv.port, 1, pids))

        def scrape(conn=None) -> dict:  # at front end 1 by default: front end 0 forwards nothing more
            conn = conn or second
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}

        # what front end 0 sent the engine so far (a readiness probe may have been among it),
        # exactly: a scrape it forwards carries its report as of then
        sent_by_0 = ("hybridgnn_frontend_requests_total", (("frontend", "0"),))
        before = scrape(first).get(sent_by_0, 0)
        rounds = 20
        for _ in range(rounds):
            assert [post(first, ids, **kw) for ids, kw in lookups] == reference
        first.request("GET", f"/v2/models/{MODEL}/stats")  # the same front end reads them: 0 ms late
        mine = json.loads(first.getresponse().read())["model_stats"][0]
        second.request("GET", f"/v2/models/{MODEL}/stats")  # the other front end, the same moment
        stats = json.loads(second.getresponse().read())["model_stats"][0]
        assert mine["inference_stats"]["success"]["count"] == stats["inference_stats"]["success"]["count"] == \
            rounds * len(lookups)
        assert stats["inference_count"] == rounds * sum(len(ids) for ids, _ in lookups)
        m = scrape()
        assert m[("hybridgnn_requests_total", (("code", "200"), ("model", MODEL), ("version", "1")))] == \
            rounds * len(lookups)
        assert m[("hybridgnn_stage_seconds_count", (("model", MODEL), ("pipeline", "precomputed"),
                                                    ("stage", "total"), ("version", "1")))] == rounds * len(lookups)
        # none crossed to the engine: since `before`, front end 0 sent it only that scrape and
        # its statistics read
        assert scrape(first).get(sent_by_0, 0) == before + 2
        # a sampled request still goes to the engine
        status, answer = post(first, [4], parameters={"mode": "sampled"})
        assert status == 200 and answer["outputs"]
        first.close()
        second.close()
    finally:
        assert srv.stop() == 0, srv.output()


def test_a_stopped_engine_is_answered_for_and_serves_again_when_it_resumes(pair):
    """SIGSTOP of the engine's process (alive, silent): a request waiting for it and every
    one after, readiness included, is answered 503 with Retry-After within the quiet
    limit, never held; after SIGCONT the server serves again on the same processes, and
    counts the inferences its front ends refused meanwhile (HTTP and gRPC: they reached
    no counter, so a stalled replica's error ratio read 0)."""
    grpc = pytest.importorskip("grpc")
    from hybridgnn.serving.grpc.schema import message

    srv, grpc_port, start = pair, pair.grpc_port, len(pair.output())
    pids = wait_for_frontends(srv.proc.pid, 2)
    conn = on(connection_to(srv.port, 0, pids))
    conn.sock.settimeout(wire.QUIET_S + 20)  # longer than the engine's silence takes to be noticed
    assert post(conn, [1])[0] == 200
    code_503 = ("hybridgnn_requests_total", (("code", "503"), ("model", "hybridgnn"), ("version", "1")))
    before = samples(srv.url)[code_503]
    answered_503 = 0  # inferences answered 503 while the engine was silent or resuming
    srv.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        status, answer = post(conn, [2])  # waits for the engine until the front end gives up on it
        waited = time.monotonic() - started
        assert status == 503 and "not answering" in answer["error"], answer
        assert waited < wire.QUIET_S + 10, waited
        # a new connection may reach the other front end, which notices the silence on its own
        # within QUIET_S: it answers 503 then, so the probes wait as long as that takes
        ready = requests.get(f"{srv.url}/v2/health/ready", timeout=wire.QUIET_S + 15)
        assert ready.status_code == 503 and ready.headers.get("Retry-After")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # a front end's gRPC says so too
            live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
            with pytest.raises(grpc.RpcError) as refused:
                live(b"", timeout=wire.QUIET_S + 15)
            # an inference on the same connection: that front end knows the engine is silent
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as refused_call:
                infer(message("ModelInferRequest")(model_name="hybridgnn").SerializeToString(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert dict(refused.value.trailing_metadata() or ()).get("retry-after"), refused.value
        assert refused_call.value.code() == grpc.StatusCode.UNAVAILABLE, refused_call.value
        for _ in range(5):
            assert post(conn, [4])[0] == 503
        answered_503 += 6
    finally:
        srv.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        status, _ = post(conn, [3])
        if status == 200:
            break
        assert status == 503 and time.monotonic() < deadline, status
        answered_503 += 1  # by the front end, or the engine's own: counted either way
        time.sleep(0.1)  # poll interval, bounded by the deadline
    # [2] waited for the engine when it stopped: counted as the engine answered it (200),
    # though its answer went nowhere; the rest once the front ends' next reports arrive
    deadline = time.monotonic() + 10
    while samples(srv.url)[code_503] - before != answered_503:
        assert time.monotonic() < deadline, (samples(srv.url)[code_503] - before, answered_503)
        time.sleep(0.1)  # poll interval, bounded by the deadline
    assert requests.get(f"{srv.url}/v2/health/ready", timeout=5).status_code == 200
    assert wait_for_frontends(srv.proc.pid, 2) == pids  # nothing was restarted
    conn.close()
    said_since(srv, start, "has not spoken for", "speaks again")


def test_a_stopped_front_end_is_killed_and_started_again(pair):
    """A SIGSTOPped front end would keep its share of new connections and answer none: the
    engine kills it once it has been silent for the quiet limit, and starts it again."""
    srv, start = pair, len(pair.output())
    try:
        pids = wait_for_frontends(srv.proc.pid, 2)
        os.kill(pids[0], signal.SIGSTOP)
        back = wait_for_frontends(srv.proc.pid, 2, timeout_s=wire.QUIET_S + 30, exclude={pids[0]})
        assert back[1] == pids[1]
        status, _ = post_once(connection_to(srv.port, 0, back), [5])
        assert status == 200
    finally:
        if "pids" in locals() and process_alive(pids[0]):  # not killed (a failure above): never left stopped
            os.kill(pids[0], signal.SIGKILL)
    said_since(srv, start, "front end 0", "has not spoken for", "starting it again")
