"""Front-end processes around one engine (`hybridgnn serve --frontends N`, N > 1).

The engine's process (this one) holds the graph, models, batcher, router and pipelines
and starts N front-end processes (serving/frontend.py). Each listens on the server's port
(SO_REUSEPORT: the kernel spreads new connections over them) and does everything per
connection: HTTP, parsing, decoding JSON tensors into arrays, encoding answers, errors.
An inference crosses to the engine as one binary frame (serving/ipc/wire.py) over a Unix
socket, so one batch holds requests from every front end and admission sees one queue;
every other request is forwarded as received and answered by this process's Api.

What holds:
- A front end that exits while the server runs is started again (its clients' connections
  end with it; every other connection is served on). Its link's answers still pending are
  dropped here; requests it had sent are still served to completion.
- This process gone (killed, crashed): each front end sees its link end, answers what it
  waits for 503, closes and exits, so no front end accepts without an engine behind it.
- A front end silent for wire.QUIET_S while its process lives (stopped, hung) is killed,
  and so started again: it would otherwise keep its share of new connections and answer
  none of them. Any bytes from it count (a large request crosses in many reads). One
  whose event loop thread keeps running is busy, not hung (large requests can hold its
  loop for seconds each), and is waited for up to _BUSY_LIMIT_S of silence. Each front
  end hears this process's keep-alive, and goes quiet itself toward clients while this
  process is silent (frontend.py).
- stop(): each front end closes as `hybridgnn serve` does (stops accepting, answers what
  it accepted, Connection: close), then exits; this process stops its engines after.
  Front ends ignore SIGTERM, SIGINT and SIGHUP: a signal to the whole process group acts
  through this process (a drain: front ends first, then the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import sys
import time

from hybridgnn.capabilities import private_run_dir
from hybridgnn.config import ServeConfig
from hybridgnn.errors import CONNECTION_CAP, GRPC_CALL_CAP
from hybridgnn.serving.frontend_link import FrontendLink
from hybridgnn.serving.http.api import Api
from hybridgnn.serving.ipc import wire
from hybridgnn.serving.v2.lookups import lookup_specs

log = logging.getLogger("hybridgnn.serve")
_START_TIMEOUT_S = 120.0  # a front end imports numpy and httptools: seconds, not minutes
_FLUSH_TIMEOUT_S = 1.0  # a statistics read waits at most this long for the front ends' counts
_RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)  # between restarts of a front end that keeps dying at start
_COUNTED = ("requests", "cpu_s", "refused_connections")  # report keys /metrics exposes as counters
_BUSY_LIMIT_S = 60.0  # a silent front end whose event loop runs is killed after this long silent in all
# A silent front end's loop thread not seen running for this long is not running: longer than
# this process may stall without its heartbeat coming late (a late one judges none)
_STILL_S = 3 * wire.KEEPALIVE_S


def _loop_thread_cpu(pid: int) -> int | None:
    """The CPU time (clock ticks) that process pid's main thread, its event loop, has run;
    None where /proc cannot say (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    except (OSError, ValueError, IndexError):
        return None


def frontends_for(wanted: int | None, cores: int, max_connections: int | None = None) -> int:
    """How many front-end processes serve: `wanted`, or for auto one per 4 cores (those the
    process may use, within a container's CPU quota), at most 8 and at least 1 (a 2- or 4-core machine keeps HTTP in the engine's process: a second
    process would take the cores the engine's workers use); never more than max_connections,
    so each front end's share of the cap (connection_share) holds at least one."""
    count = wanted if wanted is not None else max(1, min(8, cores // 4))
    if max_connections is None or count <= max_connections:
        return count
    if wanted is not None:
        log.warning("--frontends %d: starting %d, as many as --max-connections %d gives a connection each",
                    wanted, max(1, max_connections), max_connections)
    return max(1, max_connections)


def connection_share(max_connections: int, count: int, index: int) -> int:
    """Front end `index`'s share of the server's connection cap: the shares of `count` front
    ends add up to the cap exactly (rounding each down, or to at least 1, did not)."""
    return max_connections // count + (1 if index < max_connections % count else 0)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one) with SO_REUSEPORT, not listening:
    it holds the port for the front ends, which bind beside it. Refuses a port another
    socket holds, even one that set SO_REUSEPORT (two servers must not share a port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR as every listener here: connections of an earlier server left in
        # TIME_WAIT do not hold the port. Without SO_REUSEPORT: fails if anything listens.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    finally:
        probe.close()
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host, port))
    except BaseException:
        held.close()
        raise
    return held


class Frontends:
    """N front-end processes serving `api` on host:port (see the module docstring)."""

    def __init__(self, api: Api, cfg: ServeConfig, count: int):
        self.api = api
        self.cfg = cfg
        self.count = count
        self.links: dict[int, FrontendLink] = {}
        self.restarts = [0] * count
        # each front end's counters as its earlier processes last reported them: a new
        # process counts from zero, and /metrics must not see a counter go back
        self._ended = [dict.fromkeys(_COUNTED, 0.0) for _ in range(count)]
        self.port: int | None = None
        self.draining = False
        self._procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._started_at = [0.0] * count
        self._listening: dict[int, asyncio.Future] = {}
        self._dir: str | None = None
        self._ipc: asyncio.AbstractServer | None = None
        self._held: socket.socket | None = None
        self._grpc_held: socket.socket | None = None
        self.grpc = None  # the gRPC servicer answering calls the front ends receive (with --grpc-port)
        self.grpc_port: int | None = None
        self._calls: set[asyncio.Task] = set()
        self._watchers: set[asyncio.Task] = set()
        self._stopping = False
        self._beat_at: float | None = None  # the last heartbeat
        self.lookups = lookup_specs(api.service)  # what front ends answer themselves (v2/lookups.py)

    @property
    def counts_elsewhere(self) -> bool:
        """Whether front ends answer (and count) requests themselves: statistics then flush them first."""
        return bool(self.lookups)

    async def flush(self, timeout_s: float = _FLUSH_TIMEOUT_S) -> None:
        """Return once every lookup the front ends answered so far is counted here (or after
        timeout_s: a front end too busy to say so within it is counted at its next report)."""
        waits = [link.flush() for link in list(self.links.values())]
        if waits:
            await asyncio.wait(waits, timeout=timeout_s)

    @property
    def path(self) -> str:
        return os.path.join(self._dir, "engine.sock")

    def setup(self, index: int) -> dict:
        """What front end `index` serves with (its SETUP message)."""
        s = self.cfg.server
        return {"host": s.host, "port": self.port, "max_body_bytes": s.max_body_bytes,
                "idle_timeout_s": s.idle_timeout_s, "request_timeout_s": s.request_timeout_s,
                # the cap is the server's: each front end takes its share
                "max_connections": connection_share(s.max_connections, self.count, index),
                "answers_per_turn": s.answers_per_turn, "queue_bound_s": self.api.engine.queue_bound_s,
                "shutdown_grace_s": s.shutdown_grace_s, "draining": self.draining, "grpc_port": self.grpc_port,
                "lookups": self.lookups,
                "id_limit": self._id_limit(),
                "log_level": logging.getLogger().getEffectiveLevel(), "access_log": s.access_log}

    def _id_limit(self) -> tuple[str, str, int] | None:
        """(model, version, --max-request-nodes) of the one model served, for a front end to
        refuse a request of too many ids as the engine would (None: a repository, whose
        models come and go, or a typed engine, whose requests have limits of their own)."""
        service, engine = self.api.service, self.api.engine
        if service.repository is not None or getattr(engine, "typed", False):
            return None
        [(name, version, _)] = service.models.items()
        return name, version, self.cfg.server.max_request_nodes

    async def start(self) -> None:
        """Hold the port, start the front ends and return once each listens. OSError when
        the port cannot be had; RuntimeError when a front end cannot start."""
        loop = asyncio.get_running_loop()
        s = self.cfg.server
        if s.grpc_port is not None:  # ImportError without grpcio, before anything is held
            from hybridgnn.serving.grpc.service import (
                GrpcFrontend,  # grpcio only when asked for
            )

            self.grpc = GrpcFrontend(self.api.service)
        self._held = reserve_port(s.host, s.port)
        self.port = self._held.getsockname()[1]
        if s.grpc_port is not None:
            self._grpc_held = reserve_port(s.host, s.grpc_port)
            self.grpc_port = self._grpc_held.getsockname()[1]
        self._dir = private_run_dir("engine")  # 0700: only this user reaches the engine
        self._ipc = await loop.create_unix_server(lambda: FrontendLink(self).channel, self.path)
        # keep-alives from the first: a front end up early serves while the others start
        self._keep(self._keep_alive())
        # ... /metrics included: every front end's series from then on (up 0 while it starts)
        self.api.engine.stats.frontends(self.reports)
        # the front ends' refusals past their caps (FrontendLink counts them), from zero
        self.api.engine.stats.refused(CONNECTION_CAP, 0)
        if s.grpc_port is not None:
            self.api.engine.stats.refused(GRPC_CALL_CAP, 0)
        try:
            await asyncio.gather(*(self._start_one(i) for i in range(self.count)))
        except BaseException:
            await self.stop(0.0)
            raise
        for i in range(self.count):
            self._watch(i)

    async def _start_one(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        fut = self._listening[index] = loop.create_future()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hybridgnn.serving.frontend", "--ipc", self.path, "--index", str(index),
            stdin=asyncio.subprocess.DEVNULL)
        self._procs[index] = proc
        self._started_at[index] = time.monotonic()
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait({fut, exited}, timeout=_START_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if fut not in done:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise RuntimeError(f"front end {index} did not start (exit status {proc.returncode}; its log is above)")

    def spawn(self, coro) -> None:
        """Run coro (a call answered later), kept until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def listening(self, index: int | None) -> None:
        fut = self._listening.get(index)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _watch(self, index: int) -> None:
        self._keep(self._restart_when_dead(index))

    def _keep(self, coro) -> None:
        """Run coro until stop()."""
        task = asyncio.get_running_loop().create_task(coro)
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _keep_alive(self) -> None:
        while True:
            self._heartbeat(time.monotonic())
            await asyncio.sleep(wire.KEEPALIVE_S)

    def _heartbeat(self, now: float) -> None:
        """Once a wire.KEEPALIVE_S: speak to every front end, and kill one that has been
        silent for wire.QUIET_S whose event loop thread has not run for _STILL_S (stopped,
        or stuck waiting; its watcher starts it again). One whose loop runs is busy, not
        hung (a burst of large requests holds it for seconds): killing it would reset
        every connection it holds. It is waited for up to _BUSY_LIMIT_S of silence in all.
        A late heartbeat (this process stalled: what the front ends sent may wait unread)
        judges none."""
        late = self._beat_at is not None and now - self._beat_at > 3 * wire.KEEPALIVE_S
        self._beat_at = now
        alive = wire.frame(wire.ALIVE, 0)
        for link in list(self.links.values()):
            link.channel.send(alive)
            quiet = link.quiet
            if quiet is None:
                continue
            if quiet.heard:  # it spoke since the last look
                quiet.tick(now)
                link.ran = None
                continue
            went_quiet = quiet.tick(now)
            ran = _loop_thread_cpu(link.pid)  # read only while it is silent
            if link.ran is None or late or ran != link.ran:
                link.ran_at = now  # the first look at its silence, this process stalled, or its loop ran
            link.ran = ran
            if went_quiet:
                link.quiet_since, link.waited = now, False
            if not quiet.quiet or late:
                continue
            silent_s = now - link.quiet_since + wire.QUIET_S
            running = ran is not None and now - link.ran_at < _STILL_S
            if not running or silent_s >= _BUSY_LIMIT_S:
                link.quiet = None  # judged: nothing more to watch
                self._kill_quiet(link, silent_s, running)
                continue
            if not link.waited:
                link.waited = True
                log.warning("front end %d (pid %d) has not spoken for %.0f s, but its event loop is running "
                            "(busy with large requests?): waiting for it, up to %g s", link.index, link.pid,
                            silent_s, _BUSY_LIMIT_S)

    def _kill_quiet(self, link: FrontendLink, silent_s: float = wire.QUIET_S, busy: bool = False) -> None:
        proc = self._procs[link.index]
        if proc is None or proc.pid != link.pid or proc.returncode is not None:
            return
        log.error("front end %d (pid %d) has not spoken for %.0f s%s; killing it (it would keep its share of new "
                  "connections and answer none)", link.index, link.pid, silent_s,
                  " though its event loop is running (a loop that never returns?)" if busy else "")
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    async def _restart_when_dead(self, index: int) -> None:
        failures = 0
        while not self._stopping:
            proc = self._procs[index]
            code = await proc.wait()
            if self._stopping:
                return
            lived = time.monotonic() - self._started_at[index]
            failures = failures + 1 if lived < 5.0 else 0
            wait = _RESTART_BACKOFF_S[min(failures, len(_RESTART_BACKOFF_S) - 1)] if failures else 0.0
            log.warning("front end %d (pid %d) exited with status %s; starting it again%s", index, proc.pid, code,
                        f" in {wait:g} s" if wait else "")
            await asyncio.sleep(wait)
            if self._stopping:
                return
            try:
                await self._start_one(index)
                self.restarts[index] += 1
            except (RuntimeError, OSError) as exc:
                # OSError: the process could not be made (out of processes or descriptors);
                # it ended this watcher, unlogged, and the front end was never started again.
                # Either way the next attempt backs off as after a short life.
                log.error("front end %d could not be started again: %s", index, exc)
                self._started_at[index] = time.monotonic()

    def begin_shutdown(self) -> None:
        """From now on a front end that exits is not started again."""
        self._stopping = True

    def set_draining(self) -> None:
        """Tell every front end the server drains: their answers say Connection: close."""
        self.draining = True
        for link in list(self.links.values()):
            link.channel.send(wire.json_frame(wire.STATE, 0, {"draining": True}))

    def ended(self, index: int, report: dict) -> None:
        """A process of front end `index` is gone: its last report's counts stay counted."""
        if 0 <= index < self.count:
            ended = self._ended[index]
            for key in _COUNTED:
                ended[key] += float(report.get(key, 0))

    def reports(self) -> dict[int, dict]:
        """Each front end's last report (connections, CPU, memory), with its restarts. Its
        counts (requests, CPU, refused connections) add up every process it has had, so
        they never go down across a restart."""
        out = {}
        for i in range(self.count):
            report = self.links[i].report if i in self.links else {}
            ended = self._ended[i]
            out[i] = {**report, **{key: ended[key] + float(report.get(key, 0)) for key in _COUNTED},
                      "up": i in self.links, "restarts": self.restarts[i]}
        return out

    async def stop(self, timeout_s: float) -> None:
        """Close every front end (each answers what it accepted, for up to timeout_s), then
        the link's socket and the port."""
        self.begin_shutdown()
        for task in list(self._watchers):
            task.cancel()
        live = [p for p in self._procs if p is not None and p.returncode is None]
        for link in list(self.links.values()):
            link.channel.send(wire.frame(wire.STOP, 0))
        if live:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=timeout_s + 5)
            for p in live:
                if p.returncode is None:
                    log.warning("front end pid %d did not exit in time; killing it", p.pid)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                    await p.wait()
        if self._ipc is not None:
            self._ipc.close()
        for link in list(self.links.values()):
            link.channel.close()
        for task in list(self._calls):
            task.cancel()
        for held in (self._held, self._grpc_held):
            if held is not None:
                held.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

