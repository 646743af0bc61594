"""The environment a rank process runs in, as torchrun gives it: RANK, WORLD_SIZE, the
rendezvous address, thread count, and the file it writes its failure to (one line the
process that started it reads to say why it stopped)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ERROR_FILE_ENV = "HYBRIDGNN_RANK_ERROR_FILE"
PARENT_ENV = "HYBRIDGNN_RANK_PARENT"  # the server that started a rank: it exits when that one is gone
PEER_LOST = "peer lost: "  # an error line of a rank that only saw another rank fail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int, threads: int, error_file: Path) -> dict[str, str]:
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads), ERROR_FILE_ENV: str(error_file)}
