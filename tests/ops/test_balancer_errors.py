"""The balancers' own errors answered as a replica answers them: one line of JSON, with
Retry-After where a retry may succeed. A replica that drops a request it cannot have
retried (one that died mid-request) is a 502, and no replica ready is a 503; both were
HAProxy's and nginx's HTML pages without Retry-After."""

from __future__ import annotations

import http.client
import http.server
import json
import subprocess
import time

import pytest

from hybridgnn.deploy.balancer import balancer_command, render
from tests.support.ops_tools import ReadyReplica, fake_replica, require_tool
from tests.support.server import free_port, stop_process

pytestmark = [pytest.mark.ops]


class _Dropping(ReadyReplica):
    """Ready to a health check; every POST dropped unanswered, as by a replica killed with -9."""

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.close_connection = True  # closed with nothing sent


def _answer(port: int) -> tuple[int, str | None, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v2/models/hybridgnn/infer", body=b'{"inputs": []}',
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Retry-After"), r.read()
    finally:
        conn.close()


def _poll(port: int, want: int, deadline_s: float) -> tuple[int, str | None, dict]:
    """The balancer's answer once its status is `want` (the balancer starting, or seeing a
    replica go): status, Retry-After and the body as JSON."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            got = _answer(port)
            if got[0] == want:
                assert got[2].endswith(b"}") or got[2].endswith(b"}\n"), got  # one line of JSON
                assert got[2].count(b"\n") <= 1, got
                return got[0], got[1], json.loads(got[2])
        except (OSError, http.client.HTTPException):
            got = None
        assert time.monotonic() < deadline, f"no {want} in time; last {got}"
        time.sleep(0.1)  # poll interval, bounded by the deadline


@pytest.mark.parametrize("balancer", ["haproxy", "nginx"])
def test_the_balancers_own_errors_are_json_with_retry_after(balancer, tmp_path):
    require_tool(balancer)
    port = free_port(2)
    replica = fake_replica(port + 1, _Dropping)
    config = tmp_path / "balancer.conf"
    config.write_text(render(balancer, f"127.0.0.1:{port}", [f"127.0.0.1:{port + 1}"], tmp_path))
    proc = subprocess.Popen(balancer_command(balancer, config), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        status, retry_after, body = _poll(port, 502, 30.0)  # the replica dropped it, even after retries
        assert retry_after == "1" and "went away" in body["error"], (status, retry_after, body)
        replica.shutdown()
        replica.server_close()
        # HAProxy's checks take the replica out (503, no replica); nginx finds it refusing (502)
        status, retry_after, body = _poll(port, 503 if balancer == "haproxy" else 502, 30.0)
        assert retry_after == "1" and set(body) == {"error"}, (status, retry_after, body)
    finally:
        stop_process(proc)
        replica.server_close()
