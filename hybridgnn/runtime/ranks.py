"""The environment a rank process runs in, as torchrun gives it: RANK, WORLD_SIZE, the
rendezvous address, thread count, and the file it writes its failure to (one line the
process that started it reads to say why it stopped); and the rendezvous store.

Ranks started here meet at a store the starting process holds (HostedStore): it binds
its port itself (port 0), so no other process can take the port between its choice and
the bind, as one could when a free port was picked, closed, and bound again by rank 0
(and the other ranks then met whatever had taken it)."""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta
from pathlib import Path

# Internal: set only in the environment of ranks this package starts (the --nprocs
# launcher's and a partitioned server's), never by users, so not in the docs.
ERROR_FILE_ENV = "HYBRIDGNN_RANK_ERROR_FILE"  # where a rank writes its one-line failure for its starter
PARENT_ENV = "HYBRIDGNN_RANK_PARENT"  # the server that started a rank: it exits when that one is gone
PEER_LOST = "peer lost: "  # an error line of a rank that only saw another rank fail
HOSTED_STORE_ENV = "HYBRIDGNN_HOSTED_STORE"  # "<starter pid>/<key>": the store at MASTER_PORT is the starter's
_HOSTED_PREFIX = "hybridgnn/hosted"
CONNECT_ATTEMPT_S = 1.0  # a rank tries the starter's store this long at a time, checking the starter between tries


class HostedStore:
    """The rendezvous store of ranks this process starts, on a port it bound itself; it
    lives as long as this object (close() ends it)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)):
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
        self.port = self._store.port
        # the ranks' keys live under this store's own prefix: a rank of another starter that
        # reaches this port (its store gone, the port given out again) never meets these
        self.key = secrets.token_hex(8)

    def close(self) -> None:
        self._store = None  # the store's server ends with its last reference


def rank_environment(rank: int, world: int, port: int, threads: int, error_file: Path,
                     store_key: str = "") -> dict[str, str]:
    """The environment of rank `rank` of ranks that this process starts, meeting at its
    HostedStore on `port` (whose key is `store_key`)."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads), ERROR_FILE_ENV: str(error_file),
            HOSTED_STORE_ENV: f"{os.getpid()}/{store_key}"}


def join_group(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """This rank's process group, met at: the store of the process that started it (a
    HostedStore); under torchrun, the agent's store with keys of this attempt only (the
    default rendezvous re-forms no group after a restart: a rank reads the address a rank
    of the failed attempt left, torch 2.13); else the environment's (env://, rank 0 the
    store)."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    hosted = os.environ.get(HOSTED_STORE_ENV)
    if hosted:
        starter, _, key = hosted.partition("/")
        prefix = f"{_HOSTED_PREFIX}/{key}"
        store = _starters_store(world, timeout, int(starter) if starter.isdigit() else None)
    elif attempt is not None:
        prefix = f"hybridgnn/attempt_{attempt}"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
        return
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timeout)


def _starters_store(world: int, timeout: timedelta, starter: int | None):
    """A client of the HostedStore of the process that started this rank (pid `starter`).
    It is there before the rank starts, so a connection that fails means the starter is
    gone (killed with -9 while its ranks started): RuntimeError then, within about
    CONNECT_ATTEMPT_S. torch's client retries a refused connection for about twice its
    timeout, so the ranks of a killed server lived on for minutes, trying the port another
    process might bind next."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                  timeout=timedelta(seconds=max(0.1, min(CONNECT_ATTEMPT_S, left))))
        except dist.DistError:
            if starter is not None and os.getppid() != starter:
                raise RuntimeError("the process that started this rank is gone, and its rendezvous store with it") \
                    from None
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timeout)  # the rendezvous' waits get the whole timeout
        return store
