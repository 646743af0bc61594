"""`hybridgnn cluster`'s stop lets the balancer answer what it holds: a request in flight
through it when the cluster stops gets its answer (a hard stop reset its connection)."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hybridgnn.deploy.balancer import balancer_command
from hybridgnn.deploy.cluster import ClusterConfig, LocalCluster
from tests.support.ops_tools import fake_replica, require_tool
from tests.support.server import free_port, stop_process

pytestmark = [pytest.mark.ops]
ANSWER_AFTER_S = 1.5


class _Slow(http.server.BaseHTTPRequestHandler):
    """Ready to a health check; a POST answered 200 after ANSWER_AFTER_S."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self._send()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.got_post.set()
        time.sleep(ANSWER_AFTER_S)  # the request stays in flight through the balancer
        self._send(b'{"outputs": []}')

    def _send(self, body: bytes = b""):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _poll_ready(port: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        assert time.monotonic() < deadline, "balancer not routing in time"
        time.sleep(0.05)  # poll interval, bounded by the deadline


@pytest.mark.parametrize("balancer", ["haproxy", "nginx"])
def test_a_request_in_flight_through_the_balancer_at_stop_is_answered(balancer, tmp_path):
    require_tool(balancer)
    port = free_port(2)
    replica = fake_replica(port + 1, _Slow)
    replica.got_post = threading.Event()
    cluster = LocalCluster(ClusterConfig(replicas=1, balancer=balancer, port=port, base_port=port + 1,
                                         run_dir=tmp_path))
    cluster.balancer = subprocess.Popen(balancer_command(balancer, cluster.write_balancer_config()),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _poll_ready(port, 30.0)
        answer: dict = {}

        def ask():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("POST", "/v2/models/hybridgnn/infer", body=b'{"inputs": []}')
                r = conn.getresponse()
                answer["status"], answer["body"] = r.status, r.read()
            except (OSError, http.client.HTTPException) as exc:
                answer["error"] = repr(exc)
            finally:
                conn.close()

        client = threading.Thread(target=ask)
        client.start()
        assert replica.got_post.wait(30), "the request never reached the replica"
        cluster.stop()  # no replicas of its own here: it stops the balancer at once
        client.join(30)
        assert answer.get("status") == 200 and answer["body"] == b'{"outputs": []}', answer
        assert cluster.balancer.returncode is not None
    finally:
        stop_process(cluster.balancer)
        replica.shutdown()
        replica.server_close()


def test_a_ctrl_c_to_the_clusters_process_group_stops_the_balancer_after_the_replicas(tiny_dataset, tiny_model,
                                                                                      tmp_path):
    """Ctrl-C in a terminal (or `timeout`, `kill -- -PGID`) signals the whole process group:
    HAProxy took it as a hard stop, resetting what it held and refusing connections while
    the replicas still drained. It now stops after them: a request through it while the
    replica drains is answered (200 while the replica still serves, or a clean 503)."""
    require_tool("haproxy")
    port = free_port(2)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybridgnn.cli.main", "cluster", "--replicas", "1", "--port", str(port),
           "--base-port", str(port + 1), "--run-dir", str(run_dir), "--ready-timeout-s", "120", "--",
           "--dataset", str(tiny_dataset), "--model", str(tiny_model), "--workers", "1", "--unready-delay-s", "3"]
    cluster = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not (run_dir / "ready").exists():
            assert cluster.poll() is None, cluster.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "cluster not ready in time"
            time.sleep(0.1)  # poll interval, bounded by the deadline
        os.killpg(cluster.pid, signal.SIGINT)  # SIGTERM to the group acts alike
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:  # within the replica's 3 s of serving on while not ready
            conn.request("POST", "/v2/models/hybridgnn/infer", body=json.dumps(
                {"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [1]}]}))
            status = conn.getresponse().status
        finally:
            conn.close()
        assert status in (200, 503)
        assert cluster.wait(90) == 0
        assert (run_dir / "replica-0.exit").read_text() == "0"
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.wait()
        cluster.stdout.close()
