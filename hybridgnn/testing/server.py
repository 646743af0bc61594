"""Start `hybridgnn serve` as a real subprocess and wait (by polling) until it is ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from hybridgnn.serving.cluster import http_ready


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait up to timeout_s, then SIGKILL; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def await_ready(server, label: str, timeout_s: float) -> None:
    """Poll server.url's readiness until 200, server.proc exits (RuntimeError) or the
    deadline passes (server.stop(), TimeoutError); errors carry server.output()."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{label} exited with {server.proc.returncode}:\n{server.output()}")
        if http_ready(server.url):  # garbled answers too count as "not yet"
            return
        time.sleep(0.05)  # poll interval, bounded by the deadline above
    server.stop()
    raise TimeoutError(f"{label} not ready within {timeout_s}s:\n{server.output()}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

class ServerProcess:
    """`hybridgnn serve --dataset D --model M --port P *extra`; `command` replaces the
    program (it still gets the same flags), e.g. the naive baseline server in bench/."""

    def __init__(self, dataset, model, *extra: str, port: int | None = None, command: list[str] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        program = command or [sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "serve"]
        cmd = [*program, "--dataset", str(dataset), "--model", str(model), "--port", str(self.port), *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 120.0) -> "ServerProcess":
        await_ready(self, "server", timeout_s)
        return self

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop_process(self.proc, timeout_s)
