"""KServe v2 over gRPC against the real server, with tritonclient.grpc as the independent
client: the same answers as REST, the same errors as gRPC status codes, read-your-writes,
and `hybridgnn bench --protocol grpc`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

from tests.support.server import FRONTEND_IDS, FRONTENDS, ServerProcess, free_port  # noqa: E402

TOKEN = "grpc-test-token"


@pytest.fixture(scope="module", params=FRONTENDS, ids=FRONTEND_IDS)
def server(tiny_dataset, tiny_model_pe, tmp_path_factory, request):
    port = free_port()
    log = tmp_path_factory.mktemp("grpc-log") / "updates.sqlite"
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--grpc-port", str(port),
                        "--update-token", TOKEN, "--update-log", str(log), "--max-catch-up-ms", "200", "--frontends",
                        request.param, "--access-log", output_file=log.parent / "server.log").wait_ready()
    srv.grpc_port = port
    yield srv
    assert srv.stop() == 0, srv.output()


def _clients(srv):
    return (grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}"),
            httpclient.InferenceServerClient(srv.url.removeprefix("http://")))


def test_health_and_metadata(server):
    g, _ = _clients(server)
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("hybridgnn")
    assert g.get_server_metadata().name == "hybridgnn"
    meta = g.get_model_metadata("hybridgnn")
    assert meta.inputs[0].name == "node_ids" and [o.name for o in meta.outputs] == ["logits", "embeddings",
                                                                                     "predictions"]
    with pytest.raises(grpcclient.InferenceServerException) as err:
        g.get_model_metadata("hybridgnn", model_version="2")
    assert err.value.status() == "StatusCode.NOT_FOUND" and "versions" in err.value.message()


def test_grpc_and_rest_give_identical_outputs(server):
    g, h = _clients(server)
    ids = np.array([0, 17, 2999, 17], np.int64)
    gi = grpcclient.InferInput("node_ids", [4], "INT64")
    gi.set_data_from_numpy(ids)
    hi = httpclient.InferInput("node_ids", [4], "INT64")
    hi.set_data_from_numpy(ids, binary_data=True)
    for params in ({"mode": "precomputed"}, {}):  # precomputed: equal; sampled (random samples): same shapes
        outs = ["logits", "predictions"]
        a = g.infer("hybridgnn", [gi], outputs=[grpcclient.InferRequestedOutput(o) for o in outs],
                    parameters=params or None)
        b = h.infer("hybridgnn", [hi], outputs=[httpclient.InferRequestedOutput(o, binary_data=True) for o in outs],
                    parameters=params or None)
        for o in outs:
            if params:
                assert np.array_equal(a.as_numpy(o), b.as_numpy(o)), o
            else:
                assert a.as_numpy(o).shape == b.as_numpy(o).shape
    # new nodes, exact mode: the same computation either way
    feats = np.full((1, 16), 0.25, np.float32)
    edges = np.array([[3000, 5], [5, 3000]], np.int64).T.copy()
    outs = []
    for mod, kw in ((grpcclient, {}), (httpclient, {"binary_data": True})):
        f = mod.InferInput("features", [1, 16], "FP32")
        f.set_data_from_numpy(feats, **kw)
        e = mod.InferInput("edge_index", [2, 2], "INT64")
        e.set_data_from_numpy(edges, **kw)
        client = g if mod is grpcclient else h
        outs.append(client.infer("hybridgnn", [f, e], parameters={"mode": "full"}).as_numpy("logits"))
    assert np.array_equal(outs[0], outs[1])


def test_errors_are_grpc_status_codes(server):
    g, _ = _clients(server)
    bad = grpcclient.InferInput("node_ids", [1], "INT64")
    bad.set_data_from_numpy(np.array([10**9], np.int64))
    for model, inputs, code, text in [("nope", [bad], "NOT_FOUND", "unknown model"),
                                      ("hybridgnn", [bad], "INVALID_ARGUMENT", "out of range")]:
        with pytest.raises(grpcclient.InferenceServerException) as err:
            g.infer(model, inputs)
        assert err.value.status() == f"StatusCode.{code}" and text in err.value.message()
    ok = grpcclient.InferInput("node_ids", [1], "INT64")
    ok.set_data_from_numpy(np.array([1], np.int64))
    with pytest.raises(grpcclient.InferenceServerException) as err:  # ahead of this replica: retry elsewhere
        g.infer("hybridgnn", [ok], parameters={"mode": "precomputed", "min_graph_version": 10**9})
    assert err.value.status() == "StatusCode.UNAVAILABLE" and "not yet" in err.value.message()


def test_bytes_that_are_no_request_message_are_invalid_argument(server):
    """grpcio's own answer to bytes its deserializer refuses is UNKNOWN (and a traceback in
    the server's log per call): a malformed request is the client's fault, said in one line."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        for method, data in (("ModelInfer", b"\xff\xff\xff\xff"), ("ModelInfer", b"\x0a\x02\xff\xfe"),
                             ("ModelMetadata", b"\x0a\x05ab")):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            with pytest.raises(grpc.RpcError) as err:
                call(data, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
            assert err.value.details() == f"the request is not a valid inference.{method}Request protobuf message"


def test_bench_over_grpc(server):
    out = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "bench", "--url", server.url, "--protocol",
                          "grpc", "--grpc-target", f"127.0.0.1:{server.grpc_port}", "--rate", "100",
                          "--duration-s", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    # every request answered: served, or (a loaded 2-core machine) refused with 429/503, never an error
    assert res["errors"] == 0 and res["ok"] + res["rejected"] == res["sent"]
    assert res["ok"] >= 0.5 * res["sent"]


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _still_open(sock: socket.socket) -> bool:
    """Whether the server keeps this connection (what it sent is read and dropped)."""
    try:
        while sock.recv(65536):
            pass
        return False  # end of stream: closed by the server
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.parametrize("frontends", FRONTENDS, ids=FRONTEND_IDS)
def test_grpc_connections_are_capped_and_idle_ones_closed(tiny_dataset, tiny_model, frontends):
    """Connections a client opens and keeps (HTTP/2 preface, no call) are held as HTTP's
    are: at most --max-connections open, each closed after --idle-timeout-s; they were
    held without bound, until the server could open no file."""
    port = free_port()
    srv = ServerProcess(tiny_dataset, tiny_model, "--workers", "1", "--grpc-port", str(port), "--frontends",
                        frontends, "--max-connections", "4", "--idle-timeout-s", "1").wait_ready()
    socks = []
    try:
        for _ in range(12):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(_H2_PREFACE)
            sock.setblocking(False)
            socks.append(sock)
        deadline = time.monotonic() + 10
        while (held := sum(map(_still_open, socks))) > 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval, bounded by the deadline
        assert held <= 4
        deadline = time.monotonic() + 15
        while (held := sum(map(_still_open, socks))) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval, bounded by the deadline
        assert held == 0, "idle gRPC connections were not closed"
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{port}").is_server_live()  # and it still serves
    finally:
        for sock in socks:
            sock.close()
        assert srv.stop() == 0, srv.output()


def test_a_grpc_port_in_use_is_one_oserror_saying_so():
    """grpcio raises RuntimeError 'Failed to bind ...; set GRPC_VERBOSITY=debug' (older ones
    return 0): the server's start-up line says the port is in use instead."""
    from concurrent import futures

    import grpc

    from hybridgnn.serving.grpc.schema import bind_grpc

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = grpc.server(futures.ThreadPoolExecutor(1))
        with pytest.raises(OSError, match=f"cannot listen for gRPC on 127.0.0.1:{port} \\(the port is in use"):
            bind_grpc(server, "127.0.0.1", port)
        server.stop(None)


def test_the_access_log_has_a_line_per_http_and_grpc_answer(server):
    """--access-log: each answer, REST or gRPC, in the engine's process or a front end's, is
    one line naming its peer, request, status, time and the client's request id."""
    import re
    import urllib.error
    import urllib.request

    g, _ = _clients(server)
    tag = f"t{time.monotonic_ns()}"
    x = grpcclient.InferInput("node_ids", [1], "INT64")
    x.set_data_from_numpy(np.array([3], np.int64))
    g.infer("hybridgnn", [x], headers={"x-request-id": f"{tag}-g"})
    with pytest.raises(grpcclient.InferenceServerException):
        g.infer("nosuch", [x], headers={"x-request-id": f"{tag}-nf"})
    body = json.dumps({"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [3]}]}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{server.url}/v2/models/hybridgnn/infer", body,
                                                       headers={"X-Request-Id": f"{tag}-h"}), timeout=30) as r:
        assert r.status == 200
        size = len(r.read())
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v2/nosuch", headers={"X-Request-Id": f"{tag}-404"}),
                               timeout=30)
    deadline = time.monotonic() + 30
    while True:  # a line is written a moment after its answer (a front end's own process)
        out = server.output()
        if all(f"{tag}-{k}" in out for k in ("g", "nf", "h", "404")):
            break
        assert time.monotonic() < deadline, out[-3000:]
        time.sleep(0.1)  # poll interval, bounded by the deadline
    peer = r"INFO (?:frontend-\d+ )?hybridgnn\.access: 127\.0\.0\.1:\d+"  # a front end names its logger too
    assert re.search(rf'{peer} "gRPC /inference.GRPCInferenceService/ModelInfer" OK - [\d.]+ms {tag}-g\n', out)
    assert re.search(rf'{peer} "gRPC /inference.GRPCInferenceService/ModelInfer" NOT_FOUND - [\d.]+ms {tag}-nf\n', out)
    # the HTTP line's bytes are the whole answer: its body and head
    m = re.search(rf'{peer} "POST /v2/models/hybridgnn/infer HTTP/1.1" 200 (\d+) [\d.]+ms {tag}-h\n', out)
    assert m and int(m.group(1)) > size
    assert re.search(rf'{peer} "GET /v2/nosuch HTTP/1.1" 404 \d+ [\d.]+ms {tag}-404\n', out)


def _rejected(url: str, reason: str) -> float:
    """hybridgnn_rejected_requests_total{reason} as a server's /metrics shows it (None: no such series)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.server import metrics_text

    return next((s.value for f in text_string_to_metric_families(metrics_text(url)) for s in f.samples
                 if s.name == "hybridgnn_rejected_requests_total" and s.labels == {"reason": reason}), None)


# Two ways a call is refused for overload: admission (here one request in flight at most,
# and a 2 s batching window holds it, long enough for all six calls to arrive on a loaded
# machine), and the cap on gRPC calls in flight (half of
# --max-connections in one process: 2 here, or each front end's share), which grpcio
# answered itself, without retry-after.
OVERLOADS = {"admission": ("--max-pending", "1"), "calls": ("--max-connections", "4")}


@pytest.mark.parametrize("frontends", FRONTENDS, ids=FRONTEND_IDS)
@pytest.mark.parametrize("overload", list(OVERLOADS))
def test_overload_is_resource_exhausted_with_retry_after(tiny_dataset, tiny_model, frontends, overload):
    """Overload over gRPC says when to retry, as REST's 429 does (Retry-After) and gRPC's
    UNAVAILABLE does: `retry-after` in the trailing metadata, in whole seconds."""
    import threading

    import grpc

    port = free_port()
    srv = ServerProcess(tiny_dataset, tiny_model, "--workers", "1", "--grpc-port", str(port), "--frontends",
                        frontends, "--max-wait-ms", "2000", "--wait-when-idle", "--max-batch-seeds", "100000",
                        *OVERLOADS[overload]).wait_ready()
    try:
        request = grpcclient.service_pb2.ModelInferRequest(model_name="hybridgnn")
        request.inputs.add(name="node_ids", datatype="INT64", shape=[1])
        request.raw_input_contents.append(np.array([1], np.int64).tobytes())
        outcomes, lock = [], threading.Lock()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # one connection: one front end
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                       request_serializer=lambda m: m.SerializeToString())
            grpc.channel_ready_future(channel).result(timeout=30)
            barrier = threading.Barrier(6)

            def one():
                barrier.wait()
                try:
                    call(request, timeout=60)
                    outcome = (grpc.StatusCode.OK, "", {})
                except grpc.RpcError as exc:
                    outcome = (exc.code(), exc.details(), dict(exc.trailing_metadata() or ()))
                with lock:
                    outcomes.append(outcome)

            threads = [threading.Thread(target=one) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        codes = [code for code, _, _ in outcomes]
        assert len(codes) == 6 and set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, outcomes
        assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, outcomes
        for code, details, trailing in outcomes:
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "overloaded" in details, details
                assert int(trailing.get("retry-after", "0")) >= 1, (details, trailing)
        # the cap's refusals are counted (with front ends, from their reports: within a second)
        capped = sum("gRPC calls are in flight" in details for _, details, _ in outcomes)
        assert (capped > 0) == (overload == "calls"), outcomes
        deadline = time.monotonic() + 10
        while (counted := _rejected(srv.url, "grpc_call_cap")) is not None and counted < capped \
                and time.monotonic() < deadline:
            time.sleep(0.1)  # poll interval, bounded by the deadline
        assert counted == capped, (counted, outcomes)  # a series from the first scrape, at zero too
    finally:
        assert srv.stop() == 0, srv.output()
