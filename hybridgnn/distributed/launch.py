"""Start N rank processes on this machine, as torchrun would, and watch them.

Each rank is the same command line run with RANK, WORLD_SIZE and a rendezvous address
in its environment. Rank 0 keeps the terminal (progress, the report); the others are
quiet. When a rank fails, the rest are stopped and one line says which rank and why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridgnn.capabilities import die_with_parent, libc, temporary_run_dir
from hybridgnn.runtime.ranks import PEER_LOST, HostedStore, rank_environment

# How long the other ranks get to fail too once every rank that failed only lost a peer:
# those that time out waiting for the same silent rank do so within about this long.
HUNG_GRACE_S = 5.0


def _why(code: int | None, error_file: Path) -> str:
    said = error_file.read_text().strip() if error_file.is_file() else ""
    if code is None:
        return "stopped answering: the others timed out or lost their connection waiting for it"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (f" ({said})" if said else "")
    return f"exited with code {code}" + (f": {said}" if said else "")


def _lost_peer(error_file: Path) -> bool:
    return error_file.is_file() and error_file.read_text().startswith(PEER_LOST)


def _culprit(failed: list[tuple[int, int]], errors: list[Path],
             running: list[int] = ()) -> tuple[int, int | None]:
    """The rank most likely to be the cause: a failed one killed by a signal, else one
    whose error is its own rather than a lost peer, else one still running that the
    others lost (it hangs: code None), else the first seen."""
    for rank, code in failed:
        if code < 0:
            return rank, code
    for rank, code in failed:
        if not _lost_peer(errors[rank]):
            return rank, code
    if running:
        return running[0], None
    return failed[0]


def _as_rank(parent: int, c) -> None:
    """In a rank, before it runs: it ends with the launcher, and leaves Ctrl-C to it."""
    # a launcher killed with -9 takes its ranks with it: left running, they wrote the
    # store beside the next run's ranks
    die_with_parent(parent, c)
    # Ctrl-C reaches the terminal's whole process group: each rank said "interrupted"
    # beside the launcher's line (Python keeps a SIGINT ignored at its start ignored);
    # the launcher stops them with SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def launch(argv: list[str], world: int, threads: int, *, poll_s: float = 0.05) -> int:
    """Run `hybridgnn <argv>` as ranks 0..world-1 and return 0, or 1 with one line on stderr."""
    store = HostedStore()
    try:
        return _launch(argv, world, threads, store, poll_s)
    finally:
        store.close()


def _launch(argv: list[str], world: int, threads: int, store: HostedStore, poll_s: float) -> int:
    parent, c = os.getpid(), libc()  # loaded here: the child only calls it
    with temporary_run_dir("launch") as tmp:
        errors = [Path(tmp) / f"rank-{r}.txt" for r in range(world)]
        procs = []
        try:
            for rank in range(world):
                quiet = subprocess.DEVNULL if rank else None
                procs.append(subprocess.Popen([sys.executable, "-m", "hybridgnn.cli.main", *argv],
                                              env=rank_environment(rank, world, store.port, threads, errors[rank], store.key),
                                              stdout=quiet, stderr=quiet,
                                              preexec_fn=lambda: _as_rank(parent, c)))
        except OSError as exc:  # out of processes or memory: those started would wait for the rest
            for p in procs:
                p.kill()
                p.wait()
            print(f"hybridgnn precompute: could not start rank {len(procs)} of {world}: {exc}; the ranks "
                  "started were stopped", file=sys.stderr)
            return 1
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        stopping = []

        def stop(signum, _frame):
            stopping.append(signum)

        for s in previous:
            signal.signal(s, stop)
        try:
            failed: list[tuple[int, int]] = []
            while not stopping:
                codes = [p.poll() for p in procs]
                failed += [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in dict(failed)]
                if failed or all(c == 0 for c in codes):
                    break
                time.sleep(poll_s)  # poll interval: ranks run for minutes
            if stopping and all(p.poll() == 0 for p in procs):
                stopping.clear()  # the signal came as the run ended: the store is complete
            running = []
            if failed and not stopping and all(c > 0 and _lost_peer(errors[r]) for r, c in failed):
                # they only lost a peer: one still running when the rest have failed too is
                # the one that stopped answering (a rank that times out first named none)
                deadline = time.monotonic() + HUNG_GRACE_S
                while time.monotonic() < deadline and not stopping:
                    running = [r for r, p in enumerate(procs) if p.poll() is None]
                    if len(running) <= 1:
                        break
                    time.sleep(poll_s)
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                failed += [(r, p.poll()) for r, p in enumerate(procs)
                           if p.poll() not in (None, 0) and r not in dict(failed)]
            if failed or stopping:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = time.monotonic() + 10
                for p in procs:
                    try:
                        p.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            if stopping or failed:
                # rank 0 shares this stderr and may have been stopped mid-way through a progress
                # bar's line: the verdict starts a line of its own
                print(file=sys.stderr)
            if stopping:
                print(f"hybridgnn precompute: stopped by {signal.Signals(stopping[0]).name}; the store is "
                      "not complete; run the same command again to resume from its last finished layer",
                      file=sys.stderr)
                return 1
            if failed:
                rank, code = _culprit(failed, errors, running)
                # a rank exits 2 on a fault of the input (a setting, the data): running again will not mend it
                advice = ("fix that and run the command again" if code == 2 else
                          "run the same command again to resume from its last finished layer")
                print(f"hybridgnn precompute: rank {rank} of {world} {_why(code, errors[rank])}; the other ranks "
                      f"were stopped and the store is not complete; {advice}", file=sys.stderr)
                return 2 if code == 2 else 1
            return 0
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
