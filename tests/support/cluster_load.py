"""A closed-loop load driver for the ops tests: C keep-alive clients send inference
requests back to back and record every outcome; actions (signals) fire at set times."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from tests.support.ops_tools import DEPLOY
from tests.support.server import free_port


@dataclass(frozen=True)
class Outcome:
    start_s: float  # since the load began
    end_s: float
    status: int  # HTTP status, or 0 when the connection failed
    detail: str = ""


def infer_body(ids: list[int]) -> bytes:
    return json.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}]}).encode()


async def _drive(url: str, *, concurrency: int, duration_s: float, num_nodes: int,
                 actions: list[tuple[float, Callable[[], None]]], bad_every: int = 0) -> list[Outcome]:
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    for at, action in actions:
        loop.call_later(at, action)

    async def client(k: int, session: aiohttp.ClientSession) -> None:
        rng = np.random.default_rng(k)
        n = 0
        while time.monotonic() - t0 < duration_s:
            n += 1
            ids = rng.integers(0, num_nodes, size=4).tolist()
            if bad_every and n % bad_every == 0:
                ids[0] = num_nodes + 5  # an unknown node: must be a 400, never a failure
            start = time.monotonic() - t0
            try:
                async with session.post(url, data=infer_body(ids), headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    status, detail = r.status, ""
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                status, detail = 0, f"{type(exc).__name__}: {exc}"
            outcomes.append(Outcome(start, time.monotonic() - t0, status, detail))

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        await asyncio.gather(*(client(k, session) for k in range(concurrency)))
    return outcomes


def drive(url: str, **kw) -> list[Outcome]:
    return asyncio.run(_drive(url, **kw))


class Cluster:
    """deploy/launch-local.sh as a real process tree: N replicas and a balancer."""

    def __init__(self, run_dir: Path, dataset: Path, model: Path, *, replicas: int, balancer: str,
                 serve_args: tuple[str, ...] = ()):
        self.run_dir = run_dir
        base = free_port(replicas + 1)  # the balancer's port, then one per replica
        self.port, base = base, base + 1
        self.backends = [f"127.0.0.1:{base + i}" for i in range(replicas)]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ["bash", str(DEPLOY / "launch-local.sh"), "--replicas", str(replicas), "--balancer", balancer,
               "--port", str(self.port), "--base-port", str(base), "--run-dir", str(run_dir),
               "--", "--dataset", str(dataset), "--model", str(model), "--workers", "1", *serve_args]
        env = {**os.environ, "HYBRIDGNN_BIN": str(Path(sys.executable).parent / "hybridgnn"), "PYTHONUNBUFFERED": "1"}
        self.log = open(run_dir.parent / f"{run_dir.name}-launcher.log", "wb")  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> Cluster:
        deadline = time.monotonic() + timeout_s
        while not (self.run_dir / "ready").exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}:\n{self.launcher_log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"cluster not ready within {timeout_s}s:\n{self.launcher_log()}")
            time.sleep(0.1)  # poll interval; bounded by the deadline
        return self

    def replica_pid(self, i: int) -> int:
        return int((self.run_dir / f"replica-{i}.pid").read_text())

    def signal_replica(self, i: int, sig: int) -> None:
        os.kill(self.replica_pid(i), sig)

    def replica_exit(self, i: int, timeout_s: float = 60.0) -> int:
        """Exit code the launcher recorded for replica i (negative: killed by that signal)."""
        path = self.run_dir / f"replica-{i}.exit"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {i} still running after {timeout_s}s")
            time.sleep(0.05)  # poll interval; bounded by the deadline
        return int(path.read_text())

    def launcher_log(self) -> str:
        self.log.flush()
        return (self.run_dir.parent / f"{self.run_dir.name}-launcher.log").read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
