"""The environment a rank process runs in, as torchrun gives it: RANK, WORLD_SIZE, the
rendezvous address, thread count, and the file it writes its failure to (one line the
process that started it reads to say why it stopped); and the rendezvous store.

Ranks started here meet at a store the starting process holds (HostedStore): it binds
its port itself (port 0), so no other process can take the port between its choice and
the bind, as one could when a free port was picked, closed, and bound again by rank 0
(and the other ranks then met whatever had taken it)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

# Internal: set only in the environment of ranks this package starts (the --nprocs
# launcher's and a partitioned server's), never by users, so not in the docs.
ERROR_FILE_ENV = "HYBRIDGNN_RANK_ERROR_FILE"  # where a rank writes its one-line failure for its starter
PARENT_ENV = "HYBRIDGNN_RANK_PARENT"  # the server that started a rank: it exits when that one is gone
PEER_LOST = "peer lost: "  # an error line of a rank that only saw another rank fail
HOSTED_STORE_ENV = "HYBRIDGNN_HOSTED_STORE"  # set: the store at MASTER_PORT is the starter's (join as a client)
_HOSTED_PREFIX = "hybridgnn/hosted"


class HostedStore:
    """The rendezvous store of ranks this process starts, on a port it bound itself; it
    lives as long as this object (close() ends it)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)):
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
        self.port = self._store.port

    def close(self) -> None:
        self._store = None  # the store's server ends with its last reference


def rank_environment(rank: int, world: int, port: int, threads: int, error_file: Path) -> dict[str, str]:
    """The environment of rank `rank` of ranks meeting at this machine's HostedStore on `port`."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads), ERROR_FILE_ENV: str(error_file), HOSTED_STORE_ENV: "1"}


def join_group(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """This rank's process group, met at: the store of the process that started it (a
    HostedStore); under torchrun, the agent's store with keys of this attempt only (the
    default rendezvous re-forms no group after a restart: a rank reads the address a rank
    of the failed attempt left, torch 2.13); else the environment's (env://, rank 0 the
    store)."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get(HOSTED_STORE_ENV):
        prefix = _HOSTED_PREFIX
    elif attempt is not None:
        prefix = f"hybridgnn/attempt_{attempt}"
    else:
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timeout)
