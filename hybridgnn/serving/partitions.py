"""The partition ranks behind a partitioned engine (`serve --partitions N`) and the link to
rank 0.

Started here: N processes (`python -m hybridgnn.distributed.rank_server`) on this
machine, in torchrun's environment (RANK, WORLD_SIZE, a rendezvous port), rank 0
listening on a Unix socket in a private directory. With --ranks: ranks started
elsewhere (torchrun), reached at rank 0's host:port.

A supervisor thread keeps the group whole: when a rank dies (its process exits, or the
link or a ping fails) the group is down at once, so readiness fails and calls get 503;
the remaining ranks are stopped and the whole group restarted (a process group cannot
take one rank back), with a growing wait between attempts. Ranks started elsewhere are
restarted by their launcher (torchrun --max-restarts); the link is reopened when rank 0
is back. A call is blocking and one at a time: run it off the event loop.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np

from hybridgnn.capabilities import CPU_COUNT, private_run_dir
from hybridgnn.config import ServeConfig
from hybridgnn.errors import ConfigError, ServiceUnavailable, ServingError
from hybridgnn.runtime.ranks import PARENT_ENV, HostedStore, rank_environment
from hybridgnn.serving.ipc import ranks as wire
from hybridgnn.serving.ipc.wire import WireError

log = logging.getLogger("hybridgnn.serve")
MAX_BACKOFF_S = 30.0
UPDATE_WAIT_FACTOR = 10  # an update call waits this many times a request's bound for rank 0's answer
DEAD_RANK_POLL_S = 0.1  # while a call waits for rank 0, the local rank processes are checked this often


class RankGroup:
    """Implements types.PartitionRanks for a partitioned engine."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg.partitions
        self.world = self.cfg.partitions
        self._dataset, self._model = cfg.dataset_dir, cfg.model_dir
        self._expected: dict | None = None  # what rank 0's HELLO must say (made at the first)
        self._local = self.cfg.ranks is None
        self._dir: str | None = None  # made at start (0700: only this user reaches rank 0)
        self.address = self.cfg.ranks or ""
        self._lock = threading.Lock()  # one call on the link at a time
        self._link: wire.Link | None = None
        self._procs: list[subprocess.Popen] = []
        self._store: HostedStore | None = None  # where ranks started here meet
        self._rid = 0
        self._last_call = time.monotonic()
        self._waiting_since: float | None = None  # when the call on the link now (not an update) was sent
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.info: dict = {}
        # Called with a call function and rank 0's HELLO each time the group is formed (or
        # relinked), before it serves: a partitioned engine replays its update log there.
        self.prepare: Callable[[Callable, dict], None] | None = None
        self.up = False
        self.generation = 0  # counts the groups formed (and relinks): a call may name the one it is for
        self.why_down = "starting"
        self.restarts = 0

    # --- start and stop ----------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> dict:
        """Start (or reach) the ranks and wait for rank 0's HELLO: the group's description.
        ConfigError with the failing rank's own line when the group cannot start."""
        if self._local and self._dir is None:
            self._dir = private_run_dir("ranks")
            self.address = f"unix:{os.path.join(self._dir, 'rank0.sock')}"
        self._bring_up(time.monotonic() + timeout_s)
        self._thread = threading.Thread(target=self._supervise, name="partition-ranks", daemon=True)
        self._thread.start()
        return self.info

    def _bring_up(self, deadline: float) -> None:
        if self._local:
            self._spawn()
        link = self._connect(deadline)
        try:
            left = max(0.1, deadline - time.monotonic())
            _, _, payload = link.recv(left, left, kinds=(wire.HELLO,))
            info, _ = wire.decode(payload)
        except (OSError, WireError) as exc:  # no HELLO: whatever listens there is not a rank 0
            link.close()
            hint = "" if self._local else "; start the ranks with `hybridgnn rank` under torchrun"
            raise ConfigError(f"what answers at {self.address} did not greet as partition rank 0 ({exc}){hint}") \
                from None
        try:
            self._check_hello(info)
        except BaseException:
            link.close()
            raise
        with self._lock:
            self._link, self.info = link, info
            self.generation += 1
            self._last_call = time.monotonic()
        if self.prepare is not None:
            try:
                self.prepare(self._call_preparing, {**info, "generation": self.generation})
            except Exception as exc:  # the group failed (or the replay did): start it again
                with self._lock:
                    self._down(f"preparing the ranks failed: {exc}")
                raise ConfigError(f"partition ranks could not be prepared: {exc}") from None
        with self._lock:
            if self._link is None:  # lost while preparing
                raise ConfigError(f"partition ranks went down while being prepared: {self.why_down}")
            self.up, self.why_down = True, ""

    def _check_hello(self, info: dict) -> None:
        """ConfigError unless rank 0's group is this server's: as many ranks, the same
        dataset and model. Ranks elsewhere (--ranks) may have been started with others, and
        their answers (and a replay of this server's update log into them) would be wrong."""
        from hybridgnn.graph.store import GraphStore
        from hybridgnn.updates.snapshot import model_fingerprint

        if self._expected is None:
            self._expected = {"ranks": self.world, "dataset_fingerprint": GraphStore.open(self._dataset).fingerprint,
                              "model_fingerprint": model_fingerprint(self._model)}
        wrong = [f"{key} {info.get(key)!r}, not {want!r}" for key, want in self._expected.items()
                 if info.get(key) != want]
        if wrong:
            raise ConfigError(f"the partition ranks at {self.address} are not this server's ({'; '.join(wrong)}): "
                              f"start them with this server's --dataset {self._dataset} and --model {self._model}, "
                              "and as many ranks as --partitions")

    def _spawn(self) -> None:
        if self._store is not None:
            self._store.close()  # a store of ranks started before
        self._store = HostedStore(timedelta(seconds=self.cfg.timeout_s))
        port = self._store.port
        threads = max(1, CPU_COUNT // self.world)
        self._errors = [Path(self._dir) / f"rank-{r}.txt" for r in range(self.world)]
        for e in self._errors:
            e.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "hybridgnn.distributed.rank_server", "--dataset", str(self._dataset),
                "--model", str(self._model), "--listen", self.address, "--partition", self.cfg.method,
                "--timeout-s", str(self.cfg.timeout_s), "--heartbeat-s", str(self.cfg.heartbeat_s),
                "--device", self.cfg.device,
                "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]
        env = {PARENT_ENV: str(os.getpid())}
        self._procs = [subprocess.Popen(argv, env={**rank_environment(r, self.world, port, threads, self._errors[r],
                                                                   self._store.key),
                                                   **env},
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=None if r == 0 else subprocess.DEVNULL,
                                        start_new_session=True)  # a terminal's Ctrl-C is the server's to handle
                       for r in range(self.world)]

    def _dead_rank(self) -> str | None:
        """'rank r exited ...' for the first rank process that ended (local ranks), else None."""
        for r, p in enumerate(self._procs):
            code = p.poll()
            if code is not None:
                said = self._errors[r].read_text().strip() if self._errors[r].is_file() else ""
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"rank {r} of {self.world} {how}" + (f": {said}" if said else "")
        return None

    def _connect(self, deadline: float) -> wire.Link:
        note_at = time.monotonic() + 2.0  # ranks elsewhere (--ranks): say what the server waits for
        while True:
            if self._local:
                dead = self._dead_rank()
                if dead is not None:
                    self._stop_procs(grace_s=0.0)
                    raise ConfigError(f"partition ranks could not start: {dead}")
            try:
                return wire.connect(self.address, 1.0)
            except OSError as exc:
                now = time.monotonic()
                if now > deadline:
                    self._stop_procs(grace_s=0.0)
                    raise ConfigError(f"partition rank 0 did not answer at {self.address}: {exc}") from None
                if not self._local and now >= note_at:
                    log.warning("waiting for partition rank 0 at %s (%s; start the ranks with `hybridgnn rank` "
                                "under torchrun); giving up in %.0f s", self.address, exc, deadline - now)
                    note_at = now + 30.0
            if self._stopping.wait(0.05):  # poll interval while ranks load their parts
                raise ConfigError("stopped while the partition ranks started")

    def close(self) -> None:
        """Stop the supervisor and (ranks started here) the ranks; idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            link, self._link, self.up = self._link, None, False
            if link is not None:
                if self._local:  # ranks started elsewhere outlive this server: the next one reconnects
                    try:
                        link.send(wire.encode(wire.STOP, 0, {}))
                    except OSError:
                        pass
                link.close()
        self._stop_procs(grace_s=5.0)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_procs(self, grace_s: float = 2.0) -> None:
        """Wait up to grace_s for the ranks to exit (after a STOP), then kill those left: ranks
        started here ignore SIGTERM (rank_server.py)."""
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for p in self._procs:
            p.wait()
        self._procs = []

    # --- calls ---------------------------------------------------------------------------
    def call(self, name: str, head: dict, arrays: tuple[np.ndarray, ...], *,
             generation: int | None = None) -> tuple[dict, list[np.ndarray]]:
        """One call (new_nodes, existing, lookup, ping, update) on every rank; rank 0's answer
        as (head, arrays). ServiceUnavailable when the group is down or goes down meanwhile
        (nothing is answered from a partial group), or is not the group `generation` names;
        the request's own error otherwise."""
        if not self.up:  # at once, not after a replay that holds the link
            raise self._unavailable()
        return self._call(name, head, arrays, preparing=False, generation=generation)

    def _call_preparing(self, name: str, head: dict, arrays: tuple[np.ndarray, ...]) -> tuple[dict, list[np.ndarray]]:
        """A call on a group that is formed but not yet serving (prepare's)."""
        return self._call(name, head, arrays, preparing=True)

    def _call(self, name: str, head: dict, arrays: tuple[np.ndarray, ...], *, preparing: bool,
              generation: int | None = None) -> tuple[dict, list[np.ndarray]]:
        with self._lock:
            if (not self.up and not preparing) or self._link is None:
                raise self._unavailable()
            if generation is not None and generation != self.generation:
                raise ServiceUnavailable("the partition ranks were restarted meanwhile; retry",
                                         retry_after_s=max(1.0, self.cfg.restart_backoff_s))
            self._rid = (self._rid + 1) & 0xFFFFFFFF
            self._waiting_since = time.monotonic() if name != "update" else None
            try:
                self._link.send(wire.encode(wire.CALLS[name], self._rid, head, arrays))
                # An update's embedding refresh may run long; each of its collectives is
                # still bounded by the ranks' own timeout, so a dead rank ends it anyway.
                wait_s = (self.cfg.timeout_s + 5.0) * (UPDATE_WAIT_FACTOR if name == "update" else 1)
                self._await_answer(wait_s)
                kind, rid, payload = self._link.recv(wait_s, wait_s, kinds=(wire.RESULT, wire.ERROR))
                if rid != self._rid:
                    raise WireError(f"answer {kind} for call {rid}, expected one for {self._rid}")
                out, rows = wire.decode(payload)
            except (OSError, WireError) as exc:  # ConnectionError and TimeoutError are OSErrors
                self._down(f"the link to rank 0 failed: {exc}")
                raise self._unavailable() from None
            finally:
                self._last_call = time.monotonic()
                self._waiting_since = None
        if kind == wire.ERROR:
            raise ServingError(str(out.get("message")), status=int(out.get("status", 500)))
        return out, rows

    def stalled_s(self) -> float:
        """How long the call on the link now has waited (0: none, or an update's, which may
        run long by design). A rank stopped (SIGSTOP) or stuck holds it until the ranks'
        timeout; readiness uses this to route away long before."""
        since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    def _await_answer(self, wait_s: float) -> None:
        """Return once rank 0's answer starts to arrive, watching the local rank processes
        meanwhile: with a rank dead, rank 0 waits in a collective until the ranks' timeout,
        and the call (a heartbeat ping included, which the supervisor itself makes) would
        hide the failure that long. WireError naming the dead rank; TimeoutError past wait_s."""
        if not self._local:
            return
        deadline = time.monotonic() + wait_s
        while not select.select([self._link.sock], [], [], DEAD_RANK_POLL_S)[0]:
            dead = self._dead_rank()
            if dead is not None:
                raise WireError(dead)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not answer within {wait_s:.0f} s")

    def _unavailable(self) -> ServiceUnavailable:
        """The 503 a request gets while the group is down. It names what happened ("rank 1 of
        2 was killed by signal 9"), not the detail after it: a rank's own last line (a gloo
        error quoting torch's source paths) is for the log and the model metadata."""
        what = self.why_down.split(": ", 1)[0]
        return ServiceUnavailable(f"partition ranks are down ({what}); the server restarts them, retry",
                                  retry_after_s=max(1.0, self.cfg.restart_backoff_s))

    def _down(self, why: str) -> None:
        """Mark the group down (callers hold the lock or the group has no link)."""
        if self.up:
            log.error("partitioned serving is down: %s", why)
        self.up, self.why_down = False, why
        if self._link is not None:
            self._link.close()
            self._link = None

    # --- supervision ---------------------------------------------------------------------
    def _supervise(self) -> None:
        backoff = self.cfg.restart_backoff_s
        while not self._stopping.wait(0.1):  # poll interval: a dead rank is seen within 0.1 s
            if self.up:
                dead = self._dead_rank() if self._local else self._link_closed()
                if dead is not None:
                    with self._lock:
                        self._down(dead)
                elif time.monotonic() - self._last_call > self.cfg.heartbeat_s:
                    self._ping()
                if self.up:
                    backoff = self.cfg.restart_backoff_s
                continue
            self._stop_procs(grace_s=0.0)  # the rest wait in a collective that cannot finish
            if self._stopping.wait(backoff):
                return
            backoff = min(MAX_BACKOFF_S, backoff * 2)
            try:
                self._bring_up(time.monotonic() + max(60.0, self.cfg.timeout_s))
            except (ConfigError, OSError, WireError) as exc:
                if self._stopping.is_set():  # the server stopped it (closing the log under a replay)
                    return
                log.error("partition ranks did not restart: %s; next attempt in %.0f s", exc, backoff)
                continue
            self.restarts += 1
            log.info("partition ranks restarted (%d of %d up); serving again", self.world, self.world)

    def _link_closed(self) -> str | None:
        """Why the idle link to rank 0 is gone (it closed: rank 0 or its group failed), else None."""
        if not self._lock.acquire(blocking=False):
            return None  # a call is on the link: it sees a failure itself
        try:
            link = self._link
            if link is None:
                return None
            readable, _, _ = select.select([link.sock], [], [], 0)
            if readable and not link.sock.recv(1, socket.MSG_PEEK):  # nothing is due between calls: EOF
                return "the link to rank 0 closed"
            return None
        except OSError as exc:
            return f"the link to rank 0 failed: {exc}"
        finally:
            self._lock.release()

    def _ping(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # a call is on the link: it checks the group itself
        self._lock.release()
        try:
            self.call("ping", {}, ())
        except ServingError:
            pass  # call() marked the group down
