"""N replicas of `hybridgnn serve` and a load balancer on one machine (`hybridgnn cluster`).

Everything lives in a run directory: the balancer config, one log per process, and
replica-<i>.pid / replica-<i>.exit files, so an operator (or a test) can signal one
replica and see how it ended. The balancer stays up while replicas come and go; a stop
signal drains the replicas (SIGTERM), then stops the balancer.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hybridgnn.capabilities import allowed_cores, die_with_parent, libc
from hybridgnn.config import parse_cpus
from hybridgnn.deploy.balancer import (
    READY_PATH,
    balancer_command,
    check_command,
    render,
)

log = logging.getLogger("hybridgnn.cluster")


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 3
    balancer: str = "haproxy"
    host: str = "127.0.0.1"
    port: int = 8000  # the balancer's
    base_port: int = 8001  # replica i listens on base_port + i
    run_dir: Path = Path("run/cluster")
    serve_args: tuple[str, ...] = ()
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    # A replica that exits while the cluster runs is started again after restart_backoff_s,
    # doubling per crash up to RESTART_BACKOFF_MAX_S (reset once it has stayed up a minute).
    restart: bool = True
    restart_backoff_s: float = 1.0

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not 0 < self.port < 65536 or not 0 < self.base_port <= 65536 - self.replicas:
            raise ValueError(f"ports out of range: port {self.port}, base_port {self.base_port}")
        if self.port in range(self.base_port, self.base_port + self.replicas):
            raise ValueError(f"balancer port {self.port} collides with replica ports "
                             f"{self.base_port}..{self.base_port + self.replicas - 1}")
        if not self.ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        if not self.restart_backoff_s > 0:
            raise ValueError(f"restart_backoff_s must be > 0, got {self.restart_backoff_s}")
        for flag in ("--port", "--host"):
            if flag in self.serve_args:
                raise ValueError(f"{flag} is set per replica by the cluster; leave it out of the serve arguments")

        self.worker_cpus_split()  # a --worker-cpus that cannot be split is refused here

    @property
    def backends(self) -> list[str]:
        return [f"{self.host}:{self.base_port + i}" for i in range(self.replicas)]

    def _worker_cpus_at(self) -> int | None:
        """Index in serve_args of the --worker-cpus flag (its value follows, or it is
        written --worker-cpus=VALUE); None without it."""
        for k, arg in enumerate(self.serve_args):
            if arg == "--worker-cpus" or arg.startswith("--worker-cpus="):
                return k
        return None

    def worker_cpus_split(self) -> list[tuple[int, ...]] | None:
        """--worker-cpus in the serve arguments, split into one contiguous share per
        replica (as even as the count allows), or None without the flag. Every replica
        given the same cores would put all their workers on them; ValueError when there
        are fewer cores than replicas, or the list does not parse."""
        at = self._worker_cpus_at()
        if at is None:
            return None
        arg = self.serve_args[at]
        if "=" in arg:
            text = arg.split("=", 1)[1]
        elif at + 1 < len(self.serve_args):
            text = self.serve_args[at + 1]
        else:
            raise ValueError("--worker-cpus needs a value, e.g. 2-9")
        cores = parse_cpus(text)
        if len(cores) < self.replicas:
            raise ValueError(f"--worker-cpus {text} gives {len(cores)} core(s) for {self.replicas} replicas: "
                             "each replica's workers need at least one of their own")
        bounds = [len(cores) * i // self.replicas for i in range(self.replicas + 1)]
        return [cores[bounds[i]:bounds[i + 1]] for i in range(self.replicas)]

    def replica_serve_args(self, i: int) -> tuple[str, ...]:
        """serve arguments for replica i: its own share of --worker-cpus, if given."""
        split = self.worker_cpus_split()
        if split is None:
            return self.serve_args
        at = self._worker_cpus_at()
        args = list(self.serve_args)
        mine = ",".join(map(str, split[i]))
        if "=" in args[at]:
            args[at] = f"--worker-cpus={mine}"
        else:
            args[at + 1] = mine
        return tuple(args)

    def replica_cores(self, i: int, allowed: set[int] | None = None) -> set[int] | None:
        """The cores replica i may run on: its own workers' share and every allowed core
        that is no replica's worker core (where its event loop and threads go), so one
        replica's loop never lands on another's workers; None without --worker-cpus."""
        split = self.worker_cpus_split()
        if split is None:
            return None
        allowed = allowed_cores() if allowed is None else allowed
        workers = {c for share in split for c in share}
        return (allowed - workers) | set(split[i])


def http_ready(url: str, timeout_s: float = 1.0) -> bool:
    """Whether url answers its readiness check with 200. Anything else is "not yet": a
    refused connection, a timeout, or a garbled answer (on loopback, a connection to a
    port nobody listens on yet can connect to itself and read back its own request)."""
    try:
        with urllib.request.urlopen(url + READY_PATH, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError):
        return False


def child_setup(cores: set[int] | None = None):
    """preexec_fn for a replica or the balancer: pin it to `cores` (if any) and have the
    kernel send it SIGTERM when the supervisor dies (Linux), so a supervisor killed with
    -9 leaves no replica or balancer holding its port; one whose supervisor is already
    gone exits at once."""
    parent, c = os.getpid(), libc()  # loaded here: the child only calls it

    def setup() -> None:
        die_with_parent(parent, c)
        if cores:
            os.sched_setaffinity(0, cores)
    return setup


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port (a bind as a server would make it fails)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# The signal that stops a balancer gracefully (haproxy -db, nginx with daemon off).
SOFT_STOP = {"haproxy": signal.SIGUSR1, "nginx": signal.SIGQUIT}
RESTART_BACKOFF_MAX_S = 30.0
STABLE_UPTIME_S = 60.0  # up this long, a replica's earlier crashes no longer lengthen its backoff


def restart_delay(previous_s: float | None, uptime_s: float, base_s: float) -> float:
    """Seconds to wait before starting a replica that has just exited: base_s the first
    time or after a stable run, else double the last wait, at most RESTART_BACKOFF_MAX_S."""
    if previous_s is None or uptime_s >= STABLE_UPTIME_S:
        return base_s
    return min(previous_s * 2, RESTART_BACKOFF_MAX_S)


class _StopRequested(Exception):
    """SIGTERM or SIGINT arrived while the cluster was starting."""


def last_line(path: Path, limit: int = 4096) -> str:
    """The last non-empty line of a log (what a replica that exited at start said last:
    its one-line refusal), or '' when there is none to read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@dataclass
class LocalCluster:
    cfg: ClusterConfig
    replicas: list[subprocess.Popen] = field(default_factory=list)
    balancer: subprocess.Popen | None = None
    restarts: list[int] = field(default_factory=list)  # per replica
    _started_at: dict[int, float] = field(default_factory=dict)
    _last_delay: dict[int, float] = field(default_factory=dict)
    _restart_at: dict[int, float] = field(default_factory=dict)
    _recorded: set[int] = field(default_factory=set)  # pids whose exit is recorded
    stop_requested: bool = False  # set by SIGTERM/SIGINT: a start in progress gives up at once

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def replica_url(self, i: int) -> str:
        return f"http://{self.cfg.backends[i]}"

    def write_balancer_config(self) -> Path:
        """Render the balancer config into the run directory and have the balancer check it."""
        cfg = self.cfg
        if shutil.which(cfg.balancer) is None:
            raise FileNotFoundError(f"{cfg.balancer} is not installed (Debian: apt-get install "
                                    f"{'haproxy' if cfg.balancer == 'haproxy' else 'nginx-light'})")
        state = (cfg.run_dir / cfg.balancer).resolve()
        state.mkdir(parents=True, exist_ok=True)
        path = state / ("haproxy.cfg" if cfg.balancer == "haproxy" else "nginx.conf")
        path.write_text(render(cfg.balancer, f"{cfg.host}:{cfg.port}", cfg.backends, state))
        check = subprocess.run(check_command(cfg.balancer, path), capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"{cfg.balancer} rejected {path}:\n{check.stdout}{check.stderr}")
        return path

    def start(self) -> None:
        cfg = self.cfg
        # Anything already on these ports (say, an earlier cluster's replica) would answer the
        # readiness checks in place of this cluster's own processes.
        for port in (cfg.port, *range(cfg.base_port, cfg.base_port + cfg.replicas)):
            if port_in_use(cfg.host, port):
                raise RuntimeError(f"port {port} on {cfg.host} is in use (a replica or balancer of another "
                                   "cluster still running?)")
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in cfg.run_dir.glob("replica-*.*"):
            stale.unlink()
        config = self.write_balancer_config()
        for i in range(cfg.replicas):
            self.replicas.append(self._spawn(i))
            self.restarts.append(0)
        self._wait_replicas_ready()
        with open(cfg.run_dir / f"{cfg.balancer}.log", "wb") as logf:
            # In a session of its own: a Ctrl-C or SIGTERM to the cluster's process group (a
            # terminal, `timeout`, `kill -- -PGID`) is a hard stop for HAProxy and nginx, which
            # reset the requests they held and refused new ones while the replicas still
            # drained. The supervisor stops it after them (SOFT_STOP), or the kernel when the
            # supervisor dies (child_setup).
            self.balancer = subprocess.Popen(balancer_command(cfg.balancer, config), stdout=logf,
                                             stderr=subprocess.STDOUT, preexec_fn=child_setup(),
                                             start_new_session=True)
        self._wait(lambda: http_ready(self.url), "the balancer to route to a ready replica", self.balancer)
        (cfg.run_dir / "ready").write_text(self.url + "\n")
        log.info("cluster ready: %s -> %s (%s)", self.url, ", ".join(cfg.backends), cfg.balancer)

    def _spawn(self, i: int) -> subprocess.Popen:
        """Start replica i (its log appended to, its pid file rewritten)."""
        cfg = self.cfg
        cmd = [sys.executable, "-m", "hybridgnn.cli.main", "serve", *cfg.replica_serve_args(i),
               "--host", cfg.host, "--port", str(cfg.base_port + i)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        setup = child_setup(cfg.replica_cores(i))
        with open(cfg.run_dir / f"replica-{i}.log", "ab") as logf:  # the child keeps its own descriptor
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=setup)
        # written whole and renamed: a reader polling it never sees it empty (a restart rewrites it)
        pid_file = cfg.run_dir / f"replica-{i}.pid"
        tmp = pid_file.with_suffix(".pid.tmp")
        tmp.write_text(str(proc.pid))
        os.replace(tmp, pid_file)
        self._started_at[i] = time.monotonic()
        return proc

    def restart_dead(self, now: float | None = None) -> None:
        """Schedule each replica that has exited for a restart after its backoff, and start
        those whose time has come; the balancer's health checks route to it once ready."""
        if not self.cfg.restart:
            return
        now = time.monotonic() if now is None else now
        for i, proc in enumerate(self.replicas):
            if proc.poll() is None:
                continue
            due = self._restart_at.get(i)
            if due is None:
                delay = restart_delay(self._last_delay.get(i), now - self._started_at.get(i, now),
                                      self.cfg.restart_backoff_s)
                self._last_delay[i] = delay
                self._restart_at[i] = now + delay
                log.warning("replica %d restarts in %.0f s", i, delay)
            elif now >= due:
                del self._restart_at[i]
                self.replicas[i] = self._spawn(i)
                self.restarts[i] += 1
                log.info("replica %d started again (pid %d, restart %d)", i, self.replicas[i].pid, self.restarts[i])

    def _wait_replicas_ready(self) -> None:
        pending = set(range(self.cfg.replicas))
        t0 = time.monotonic()
        deadline = t0 + self.cfg.ready_timeout_s
        # each replica loads its dataset and model first (seconds, more for a large graph):
        # said as it goes, so the wait is not silent
        log.info("starting %d replicas (their logs: %s)", self.cfg.replicas, self.cfg.run_dir / "replica-*.log")
        while pending:
            self._check_stop()
            for i in sorted(pending):
                if self.replicas[i].poll() is not None:
                    log_path = self.cfg.run_dir / f"replica-{i}.log"
                    said = last_line(log_path)
                    raise RuntimeError(f"replica {i} exited with {self.replicas[i].returncode} while starting"
                                       f"{f': {said}' if said else ''} (its log: {log_path})")
                if http_ready(self.replica_url(i)):
                    pending.discard(i)
                    log.info("replica %d ready on %s (%.1fs; %d of %d)", i, self.replica_url(i),
                             time.monotonic() - t0, self.cfg.replicas - len(pending), self.cfg.replicas)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"replicas {sorted(pending)} not ready within {self.cfg.ready_timeout_s}s")
            time.sleep(0.1)  # poll interval; the deadline above bounds the wait

    def _wait(self, ok, what: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not ok():
            self._check_stop()
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def _check_stop(self) -> None:
        if self.stop_requested:
            raise _StopRequested

    def reap(self, stopping: bool = False) -> None:
        """Record how replicas that have ended exited (replica-<i>.exit: the latest exit
        code), once per process."""
        for i, proc in enumerate(self.replicas):
            if proc.poll() is not None and proc.pid not in self._recorded:
                self._recorded.add(proc.pid)
                code = proc.returncode
                (self.cfg.run_dir / f"replica-{i}.exit").write_text(str(code))
                how = f"signal {-code}" if code < 0 else f"code {code}"
                if stopping:
                    log.info("replica %d (pid %d) stopped with %s", i, proc.pid, how)
                else:
                    log.warning("replica %d (pid %d) ended with %s; the balancer routes around it", i, proc.pid, how)

    def stop(self) -> None:
        """Drain every replica (SIGTERM, wait), then stop the balancer."""
        for proc in self.replicas:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        for proc in self.replicas:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.reap(stopping=True)
        if self.balancer is not None and self.balancer.poll() is None:
            # A soft stop: it stops listening and answers what it holds (a 503 now that no
            # replica is left) before exiting; SIGTERM, a hard stop for both, reset the
            # connections of requests that reached it while the replicas drained.
            self.balancer.send_signal(SOFT_STOP[self.cfg.balancer])
            try:
                self.balancer.wait(10)
            except subprocess.TimeoutExpired:
                self.balancer.kill()
                self.balancer.wait()
        (self.cfg.run_dir / "ready").unlink(missing_ok=True)

    def run_until_signal(self) -> int:
        """Start, then supervise until SIGTERM/SIGINT or the balancer dies; returns an exit code."""
        def _stop(signum, frame):
            self.stop_requested = True

        old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self.start()
            except _StopRequested:
                log.info("stopped while starting")
                return 0
            replicas = f"{self.cfg.replicas} replica{'s' if self.cfg.replicas != 1 else ''}"
            print(f"cluster ready on {self.url} ({replicas} behind {self.cfg.balancer}); "
                  f"Ctrl-C stops it", flush=True)
            while not self.stop_requested:
                self.reap()
                self.restart_dead()
                if self.balancer is not None and self.balancer.poll() is not None:
                    log.error("%s exited with %s", self.cfg.balancer, self.balancer.returncode)
                    return 1
                time.sleep(0.2)  # supervision tick
            return 0
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)
