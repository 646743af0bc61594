"""`hybridgnn cluster`'s stop lets the balancer answer what it holds: a request in flight
through it when the cluster stops gets its answer (a hard stop reset its connection)."""

from __future__ import annotations

import http.client
import http.server
import subprocess
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
