"""Start `hybridgnn serve` as a real subprocess and wait (by polling) until it is ready."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from hybridgnn.deploy.cluster import http_ready

# Front-end process counts a server runs with in tests that hold for both: HTTP in the
# engine's process, and two front-end processes around it.
FRONTENDS = ("1", "2")
FRONTEND_IDS = ("frontends1", "frontends2")


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


def exit_codes_within(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Every process's exit code, all within timeout_s (TimeoutExpired past it); those left
    running then are stopped (stop_process) either way."""
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            stop_process(p, 5)


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


def metrics_text(url: str, timeout_s: float = 5.0) -> str:
    """A server's Prometheus exposition (GET /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152, above it anyway


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def process_alive(pid: int) -> bool:
    """Whether process pid runs: a zombie (dead, not yet reaped) does not, and holds no port."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_HANDED_OUT: set[int] = set()


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that were free a moment ago.

    Chosen below the kernel's ephemeral range on purpose: a port from that range can be
    taken at any time by some client's outgoing connection, including a readiness
    probe that connects to the very port a server is about to bind (a loopback
    self-connect holds the port, and the server then fails with "address in use").
    Never a port this process was given before: a test that takes a second port before
    its server binds the first would otherwise get the same one now and then (1 in
    12,000 draws; it failed a CI run)."""
    high = _ephemeral_low() - count
    low = 20000 if high > 21000 else 1024  # a runner whose ephemeral range starts low
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        base = rng.randrange(low, high)
        ports = range(base, base + count)
        if _HANDED_OUT.isdisjoint(ports) and all(_bindable(p) for p in ports):
            _HANDED_OUT.update(ports)
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}..{high + count}")


class ServerProcess:
    """`hybridgnn serve --dataset D --model M --port P *extra`; `command` replaces the
    program (it still gets the same flags), e.g. the naive baseline server in bench/.
    `output_file`: what the server prints goes there, and output() reads it while the
    server runs too (a server shared by several tests, each checking what it said)."""

    def __init__(self, dataset, model, *extra: str, port: int | None = None, command: list[str] | None = None,
                 output_file: Path | None = None, own_group: bool = False):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        program = command or [sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "serve"]
        model_args = ["--model", str(model)] if model is not None else []  # None: extra names a --model-repository
        cmd = [*program, "--dataset", str(dataset), *model_args, "--port", str(self.port), *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.output_file = output_file
        # own_group: in a session of its own, so a signal to its process group (os.killpg)
        # reaches the server and its children, never the tests
        if output_file is None:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=own_group)
        else:
            with open(output_file, "wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=own_group)
        self._output: str | None = None

    def wait_ready(self, timeout_s: float = 120.0) -> "ServerProcess":
        await_ready(self, "server", timeout_s)
        return self

    def output(self) -> str:
        """Everything the exited server printed (read once, then kept); with an
        output_file, what it printed so far."""
        if self.output_file is not None:
            return self.output_file.read_bytes().decode(errors="replace")
        if self.proc.poll() is None:
            return "(still running)"
        if self._output is None:
            self._output = ""
            if self.proc.stdout:
                with self.proc.stdout:
                    self._output = read_until_closed(self.proc.stdout).decode(errors="replace")
        return self._output

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop_process(self.proc, timeout_s)

    def __del__(self):  # output() was never asked for: the pipe goes with us, not to a warning
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def read_until_closed(pipe, timeout_s: float = 30.0) -> bytes:
    """What `pipe` holds until every writer closed it, or what came within timeout_s: a
    child the server left behind (a stopped one never exits) holds the pipe open, and a
    plain read() waited for it forever."""
    import select

    chunks, deadline = [], time.monotonic() + timeout_s
    fd = pipe.fileno()
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    return b"".join(chunks) + b"\n(output cut: a process the server started still holds its pipe)\n"


def children_of(pid: int) -> list[int]:
    """Processes whose parent is pid (the server's partition ranks)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return sorted(out)


def poll_ready(url: str, want: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    import requests

    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/v2/health/ready", timeout=2).status_code == want:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)  # poll interval, bounded by the deadline
    raise AssertionError(f"readiness never answered {want} within {deadline_s}s")
