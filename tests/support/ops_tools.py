"""Shared helpers of the ops tests: where things are, and skipping (or failing, in CI)
when a real tool is missing."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent


def require_tool(name: str) -> str:
    """Path of `name` on PATH or in this venv. Missing: skip, or fail when
    HYBRIDGNN_REQUIRE_OPS_TOOLS=1 (CI sets it, so these tests can never silently not run there)."""
    path = shutil.which(name) or shutil.which(name, path=str(VENV_BIN))
    if path is None:
        message = f"{name} is not installed (Debian: apt-get install haproxy nginx-light prometheus)"
        if os.environ.get("HYBRIDGNN_REQUIRE_OPS_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_tool(*cmd: str, cwd: Path | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


class ReadyReplica(http.server.BaseHTTPRequestHandler):
    """A stand-in replica's handler: ready (200) to a health check, silent in the log; a
    subclass answers POST as its test needs."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def fake_replica(port: int, handler):
    """An http.server on 127.0.0.1:port answering with `handler` (a BaseHTTPRequestHandler
    class) in a thread of its own: a stand-in replica behind a real balancer. The caller
    shuts it down and closes it."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
