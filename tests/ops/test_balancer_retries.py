"""What the balancers retry on another replica: an inference (idempotent) that a replica
refused with 503 or dropped, and a request that changes state (a graph update, a
repository load or unload) only when it never reached a replica. Once a replica has it,
an update may be logged whatever the replica answers (a 503 "logged but not applied here
yet", a connection cut after the append), and the same update sent to another replica
would be logged again: applied twice unless the client gave an Idempotency-Key."""

from __future__ import annotations

import contextlib
import http.client
import subprocess
import time
from pathlib import Path

import pytest

from hybridgnn.deploy.balancer import balancer_command, render
from tests.support.ops_tools import ReadyReplica, fake_replica, require_tool
from tests.support.server import free_port, stop_process

pytestmark = [pytest.mark.ops]


def _replica(how: str, seen: list):
    """A replica that is ready to a health check and answers every POST as `how` says
    (503: refused, "drop": the connection closed with nothing sent), noting its path."""

    class Handler(ReadyReplica):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.path)
            if how == "drop":
                self.close_connection = True
                return
            body = b'{"error": "the update was logged but could not be applied here yet"}'
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def _post(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", path, body=b'{"inputs": []}', headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def _until_it_reaches_a_replica(port: int, path: str, seen: list, retried: bool = False):
    """POST path until it reaches a replica (the balancer starting, nginx's passive checks
    holding a replica out after a failure): its status, asserting that one request never
    reached two replicas; retried: until one did, returning the paths seen."""
    deadline = time.monotonic() + 30
    while True:
        seen.clear()
        try:
            status = _post(port, path)
        except (OSError, http.client.HTTPException):
            status = None
        if retried:
            if len(seen) >= 2:
                return list(seen)
        else:
            assert len(seen) <= 1, f"one {path} reached {len(seen)} replicas (answered {status})"
            if seen:
                return status
        assert time.monotonic() < deadline, f"no {path} reached a replica{' twice' if retried else ''} in time"
        time.sleep(0.1)  # poll interval, bounded by the deadline


@contextlib.contextmanager
def _behind(balancer: str, tmp_path: Path, port: int, handlers: list, config: str | None = None):
    """Stand-in replicas on port+1, port+2, ... (a handler each) behind a real balancer on
    port, configured as render() makes it, or with `config`; all stopped after the block."""
    replicas = [fake_replica(port + 1 + i, handler) for i, handler in enumerate(handlers)]
    path = tmp_path / "balancer.conf"
    path.write_text(config if config is not None else render(
        balancer, f"127.0.0.1:{port}", [f"127.0.0.1:{port + 1 + i}" for i in range(len(handlers))], tmp_path))
    proc = subprocess.Popen(balancer_command(balancer, path), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        stop_process(proc)
        for r in replicas:
            r.shutdown()
            r.server_close()


@pytest.mark.parametrize("how", ["503", "drop"])
@pytest.mark.parametrize("balancer", ["haproxy", "nginx"])
def test_a_request_that_changes_state_is_sent_to_one_replica_and_an_inference_is_retried(balancer, how, tmp_path):
    require_tool(balancer)
    port = free_port(3)
    seen: list[str] = []
    with _behind(balancer, tmp_path, port, [_replica(how, seen)] * 2):
        for path in ("/v2/models/m/graph", "/v2/models/m/versions/2/graph", "/v2/repository/models/m/load",
                     "/v2/repository/models/m/unload"):
            status = _until_it_reaches_a_replica(port, path, seen)
            assert status == (503 if how == "503" else 502), (path, status)
        assert len(_until_it_reaches_a_replica(port, "/v2/models/m/infer", seen, retried=True)) >= 2


@pytest.mark.parametrize("balancer", ["haproxy", "nginx"])
def test_an_inference_that_timed_out_is_not_sent_to_another_replica(balancer, tmp_path):
    """A replica that takes longer than the balancer's read timeout may still be serving,
    and a cluster that hangs would get each such request once per replica (nginx's
    "timeout" retried it on up to four): the client gets the balancer's 504 after one."""
    from hybridgnn.deploy.balancer import render_haproxy, render_nginx

    require_tool(balancer)
    port = free_port(3)
    seen: list[str] = []

    class Slow(ReadyReplica):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.path)
            time.sleep(4)  # past the balancer's read timeout of 2 s
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    backends = [f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}"]
    config = (render_haproxy(f"127.0.0.1:{port}", backends, read_timeout_s=2) if balancer == "haproxy"
              else render_nginx(f"127.0.0.1:{port}", backends, state_dir=tmp_path, read_timeout_s=2, retry_window_s=1))
    with _behind(balancer, tmp_path, port, [Slow, Slow], config):
        status = _until_it_reaches_a_replica(port, "/v2/models/m/infer", seen)
        assert status == 504, status
        # a retry comes before the balancer answers: had there been one, the other replica
        # would have seen it already
        assert len(seen) == 1, seen


@pytest.mark.parametrize("balancer", ["haproxy", "nginx"])
def test_a_503_from_a_replica_whose_engine_went_quiet_is_retried_on_another(balancer, tmp_path):
    """A front end whose engine process stopped answers what waited for it 503 (with
    Retry-After) once the engine has been silent for the quiet limit: a request in
    flight then hears it up to a keep-alive later. nginx retried only within 10 s of the
    first try, so it passed exactly those 503s to the client; HAProxy retried them."""
    from hybridgnn.serving.ipc import wire

    require_tool(balancer)
    port = free_port(3)
    seen: list[str] = []

    def replica(name: str, wait_s: float, status: int):
        class Handler(ReadyReplica):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                seen.append(name)
                time.sleep(wait_s)
                body = b"{}" if status == 200 else b'{"error": "the engine process is gone or not answering"}'
                self.send_response(status)
                if status == 503:
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    quiet_s = wire.QUIET_S + wire.KEEPALIVE_S
    with _behind(balancer, tmp_path, port, [replica("stopped", quiet_s, 503), replica("up", 0, 200)]):
        deadline = time.monotonic() + 60
        while True:  # round robin: until a request reaches the stopped one first
            seen.clear()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=quiet_s + 20)
                conn.request("POST", "/v2/models/m/infer", body=b'{"inputs": []}',
                             headers={"Content-Type": "application/json"})
                status = conn.getresponse().status
                conn.close()
            except (OSError, http.client.HTTPException):
                status = None
            if seen[:1] == ["stopped"]:
                break
            assert time.monotonic() < deadline, "no inference reached the stopped replica first"
            time.sleep(0.1)  # poll interval, bounded by the deadline
        assert (status, seen) == (200, ["stopped", "up"])
