"""`hybridgnn cluster`'s supervisor: killed with -9 it leaves nothing behind, and it never
mistakes another process on its ports for its own replicas."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridgnn.deploy.cluster import port_in_use
from tests.support.ops_tools import ReadyReplica, require_tool
from tests.support.server import free_port, process_alive

pytestmark = [pytest.mark.ops, pytest.mark.slow]


def _cluster(run_dir: Path, port: int, dataset: Path, model: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hybridgnn.cli.main", "cluster", "--replicas", "2", "--port", str(port),
           "--base-port", str(port + 1), "--run-dir", str(run_dir), "--ready-timeout-s", "120",
           "--", "--dataset", str(dataset), "--model", str(model), "--workers", "1"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_ready(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "ready").exists():
        assert proc.poll() is None, f"cluster exited with {proc.returncode}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "cluster not ready in time"
        time.sleep(0.1)  # poll interval; bounded by the deadline


def test_a_supervisor_killed_with_9_takes_its_replicas_and_balancer_along(tiny_dataset, tiny_model, tmp_path):
    require_tool("haproxy")
    port = free_port(3)
    run_dir = tmp_path / "run"
    first = _cluster(run_dir, port, tiny_dataset, tiny_model)
    children: list[int] = []
    try:
        _wait_ready(first, run_dir)
        children = [int((run_dir / f"replica-{i}.pid").read_text()) for i in range(2)]
        children += [int(p) for p in subprocess.run(["pgrep", "-P", str(first.pid), "haproxy"],
                                                     capture_output=True, text=True).stdout.split()]
        assert len(children) == 3
        first.kill()
        first.wait()
        deadline = time.monotonic() + 60
        while any(process_alive(pid) for pid in children) or any(port_in_use("127.0.0.1", port + k) for k in range(3)):
            assert time.monotonic() < deadline, f"left behind: {[p for p in children if process_alive(p)]}"
            time.sleep(0.1)  # poll interval; bounded by the deadline
        second = _cluster(tmp_path / "run2", port, tiny_dataset, tiny_model)
        try:
            _wait_ready(second, tmp_path / "run2")
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0
    finally:
        for pid in children:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_stranger_on_a_replica_port_is_refused_not_taken_for_a_replica(tiny_dataset, tiny_model, tmp_path):
    require_tool("haproxy")
    port = free_port(3)
    stranger = http.server.ThreadingHTTPServer(("127.0.0.1", port + 2), ReadyReplica)  # answers every readiness check
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        proc = _cluster(tmp_path / "run", port, tiny_dataset, tiny_model)
        try:
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        assert proc.returncode == 2, out[-3000:]
        assert f"port {port + 2} on 127.0.0.1 is in use" in out.strip().splitlines()[-1]
        assert not (tmp_path / "run" / "ready").exists()
    finally:
        stranger.shutdown()
        stranger.server_close()
