"""`hybridgnn rank`: one partition rank of a partitioned server, for ranks started by
torchrun (across machines); `hybridgnn serve --partitions N --ranks HOST:PORT` then
serves through them. `serve --partitions N` alone starts its ranks itself."""

from __future__ import annotations

from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path
from hybridgnn.config import PartitionConfig


def add_parser(sub) -> None:
    p = sub.add_parser("rank", help="run one partition rank (under torchrun) for `serve --partitions N --ranks`",
                       description="Run one partition rank of a partitioned server. Start one per rank under "
                                   "torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from it); rank 0 "
                                   "listens on --listen for the server (`hybridgnn serve --partitions N --ranks "
                                   "HOST:PORT`). Every rank loads only its part of the dataset, features and "
                                   "precomputed embeddings. A rank that fails exits non-zero; torchrun's "
                                   "--max-restarts starts the group again and the server reconnects.",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=user_path, required=True, help="dataset directory (the same path on every machine)")
    p.add_argument("--model", type=user_path, required=True,
                   help="model directory, with its precomputed embeddings (the same path on every machine)")
    p.add_argument("--listen", default="0.0.0.0:7700",
                   help="where rank 0 listens for the server (host:port); only rank 0 uses it")
    p.add_argument("--partition", default=PartitionConfig.method, choices=("auto", "metis", "ranges"),
                   help="how the graph is split (every rank must be given the same)")
    p.add_argument("--timeout-s", type=float, default=PartitionConfig.timeout_s,
                   help="how long a rank waits for the others in one step before it fails")
    p.add_argument("--device", default=PartitionConfig.device, choices=("cpu", "cuda"),
                   help="cpu: exchange over gloo; cuda: over NCCL, one GPU per rank (by LOCAL_RANK)")
    p.set_defaults(run=run)


def run(args) -> int:
    import os

    from hybridgnn.errors import ConfigError

    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:  # a usage mistake, said before any work (a rank's own failures exit 1)
        raise ConfigError(f"{' and '.join(missing)} not set: start ranks with torchrun, e.g. `torchrun "
                          "--nproc-per-node 2 --no-python hybridgnn rank --dataset D --model M --listen 127.0.0.1:7700`")
    from hybridgnn.distributed.rank_server import RankOptions, serve

    return serve(RankOptions(args.dataset, args.model, args.listen, args.partition, args.timeout_s,
                             device=args.device))
