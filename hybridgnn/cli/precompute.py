"""`hybridgnn precompute`: layer-wise embeddings of every node, stored beside the model."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from pathlib import Path

from hybridgnn.capabilities import check_local_ranks
from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path


def add_parser(sub) -> None:
    p = sub.add_parser("precompute", help="precompute every node's per-layer embeddings (layer-wise inference)",
                       description="Runs the model layer by layer over all nodes and writes each layer's "
                                   "embeddings to <model>/embeddings/<dataset fingerprint>/layer_<i>.npy. "
                                   "An interrupted run resumes where it stopped.",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=user_path, required=True, help="dataset directory")
    p.add_argument("--model", type=user_path, required=True, help="model directory (the embeddings are written beside it)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="stored embedding precision")
    p.add_argument("--batch-size", type=int, default=16384,
                   help="initial targets per batch (adapts; on a heterogeneous graph: targets per batch, fewer where "
                        "their in-edges pass 1M, and a run cut short starts over)")
    p.add_argument("--order", choices=["natural", "rcm"], default="natural",
                   help="rcm: reverse Cuthill-McKee order so batches share inputs")
    d = p.add_argument_group("distributed (torch.distributed: gloo on CPU, NCCL on GPUs)")
    d.add_argument("--nprocs", type=int, default=1,
                   help="ranks to start on this machine; under torchrun its environment says how many")
    d.add_argument("--partition", choices=["auto", "metis", "ranges"], default="auto",
                   help="how nodes are split over ranks: metis cuts fewer edges (needs pymetis), ranges "
                        "are contiguous id ranges of equal edge counts; auto: metis when installed")
    d.add_argument("--threads-per-rank", type=int, default=0,
                   help="torch threads per rank; 0: this machine's cores divided by --nprocs")
    d.add_argument("--timeout-s", type=float, default=1800.0,
                   help="how long a rank waits for the others in a collective before failing the run")
    d.add_argument("--chunk-mb", type=float, default=4.0, help="halo rows per message, in MB")
    p.set_defaults(run=run)


def _distributed(args) -> int:
    """This process is one rank (under torchrun, or started by --nprocs)."""
    import torch

    from hybridgnn.distributed.driver import DistributedConfig, run_rank
    from hybridgnn.errors import ConfigError
    from hybridgnn.runtime.ranks import ERROR_FILE_ENV, PEER_LOST

    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    lock = contextlib.nullcontext()
    if os.environ.get(ERROR_FILE_ENV) is None and os.environ.get("RANK") == "0":
        # under torchrun rank 0 holds the store's lock for the run's ranks, as the --nprocs
        # launcher does for its own (they must not take it: the launcher holds it); the
        # others wait for rank 0 in the rendezvous, up to --timeout-s
        from hybridgnn.graph.store import GraphStore

        lock = _store_lock(args, GraphStore.open(args.dataset))
    try:
        with lock:
            report = run_rank(args.dataset, args.model, _config(args),
                              DistributedConfig(partition=args.partition, timeout_s=args.timeout_s,
                                                chunk_bytes=max(1, int(args.chunk_mb * (1 << 20)))))
    except Exception as exc:
        # gloo prefixes its errors with its source file ([.../unbound_buffer.cc:129]): not the user's
        line = re.sub(r"^\[[^\]]*:\d+\] ", "", " ".join(str(exc).split())) or type(exc).__name__
        # a rank that timed out waiting for a peer is as much a lost peer as one whose peer closed
        lost = isinstance(exc, torch.distributed.DistError) or any(
            said in line.lower() for said in ("closed by peer", "reset by peer", "timed out"))
        where = os.environ.get(ERROR_FILE_ENV)
        if where:  # started by --nprocs: the launcher says one line for the run
            Path(where).write_text((PEER_LOST if lost else "") + line[:500])
            # 2: the input's fault (a setting, the data), which running again will not mend
            return 2 if isinstance(exc, (ConfigError, ValueError)) and not lost else 1
        raise
    if report is not None:
        print(json.dumps(report, indent=2))
    return 0


def _store_lock(args, graph):
    """The lock of the store this run writes (capabilities.exclusive), held by the one
    process that stands for the run. --model is read first: the lock's folder is made
    when missing, and a mistyped --model made a model directory of it."""
    from hybridgnn.capabilities import exclusive
    from hybridgnn.embeddings.store import embeddings_dir, store_lock
    from hybridgnn.models.checkpoint import read_config

    read_config(args.model)
    root = embeddings_dir(args.model, graph.fingerprint)
    return exclusive(store_lock(root), f"waiting for another process precomputing {root}")


def _config(args):
    from hybridgnn.embeddings.precompute import PrecomputeConfig

    # the flag is where batches start, not a bound: they grow to the default ceiling, or
    # from a larger start stay there
    return PrecomputeConfig(batch_size=args.batch_size, max_batch_size=max(args.batch_size,
                                                                          PrecomputeConfig.max_batch_size),
                            dtype=args.dtype, device=args.device, order=args.order)


def _hetero(args) -> int:
    """A heterogeneous dataset: every node type's rows after every layer (and its head)."""
    from hybridgnn.embeddings.hetero import hetero_precompute
    from hybridgnn.graph.hetero import HeteroGraphStore
    from hybridgnn.models.hetero_checkpoint import open_hetero_model

    if args.nprocs > 1 or args.device != "cpu" or args.order != "natural" or "WORLD_SIZE" in os.environ:
        raise ValueError("a heterogeneous graph is precomputed in one process on the CPU, in natural order "
                         "(no --nprocs, torchrun, --device or --order)")
    graph = HeteroGraphStore.open(args.dataset)
    model, _ = open_hetero_model(args.model, graph)
    store = hetero_precompute(model, graph, args.model, batch_size=args.batch_size, dtype=args.dtype)
    print(json.dumps({"embeddings": str(store.root),
                      "node_types": {t: {str(i): list(a.shape) for i, a in layers.items()}
                                     for t, layers in store.layers.items()},
                      "precompute_s": round(store.state["precompute_s"], 2),
                      "computed_unix_s": store.computed_unix_s}, indent=2))
    return 0


def check_device(device: str) -> None:
    """--device in one line: a name torch parses, and a CUDA device this machine has."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device must be cpu or cuda[:i], got {device!r}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:i], got {device!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is visible (torch.cuda.is_available() is False)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")



MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_distributed_flags(args) -> None:
    """The distributed flags, each refused in one line before any rank starts: the ranks
    found a NaN or infinite one only once all had started, and took --chunk-mb 0 (one row
    per message) and a negative --threads-per-rank (ignored) as given."""
    if not (math.isfinite(args.chunk_mb) and args.chunk_mb > 0):
        raise ValueError(f"--chunk-mb must be a number > 0, got {args.chunk_mb}")
    # at most a week: torch.distributed's timeout is a timedelta, which 1e20 s overflowed
    if not (math.isfinite(args.timeout_s) and 0 < args.timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"--timeout-s must be a number > 0 and at most {MAX_TIMEOUT_S:.0f} (a week), got "
                         f"{args.timeout_s}")
    if args.threads_per_rank < 0:
        raise ValueError(f"--threads-per-rank must be >= 0, got {args.threads_per_rank}")
    if args.order != "natural" and (args.nprocs != 1 or "WORLD_SIZE" in os.environ):
        # each rank computes its partition's rows whole, layer by layer: there are no
        # batches for an order to share inputs between
        raise ValueError(f"--order {args.order} orders one process's batches; ranks (--nprocs, torchrun) compute "
                         "each partition whole, so leave it out")


def check_nprocs(nprocs: int, num_nodes: int, cores: int, device: str = "cpu") -> None:
    """--nprocs N ranks this machine can run, each owning at least one node (and, on CUDA,
    a GPU of its own: rank i computes on cuda:i)."""
    if nprocs < 1:
        raise ValueError(f"--nprocs must be >= 1, got {nprocs}")
    check_local_ranks("--nprocs", nprocs, cores, "start them with torchrun")
    if nprocs > num_nodes:
        raise ValueError(f"--nprocs {nprocs}: the graph has {num_nodes} nodes; a rank needs at least one")
    import torch

    if device.startswith("cuda") and nprocs > (visible := torch.cuda.device_count()):
        # else the ranks past the last GPU failed at start in torch's words, and the rest waited for them
        raise ValueError(f"--nprocs {nprocs} --device cuda: each rank needs a GPU of its own; this machine has "
                         f"{visible} (lower --nprocs)")


def run(args) -> int:
    from hybridgnn.graph.store import GraphStore, dataset_kind

    if args.batch_size < 1:  # the config's own check names its fields, not the flag
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if dataset_kind(args.dataset) == "hetero":  # also under torchrun: refused in one line there
        return _hetero(args)
    check_device(args.device)
    check_distributed_flags(args)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _distributed(args)
    if args.nprocs != 1:
        from hybridgnn.capabilities import usable_cores
        from hybridgnn.distributed.launch import launch

        graph = GraphStore.open(args.dataset)
        check_nprocs(args.nprocs, graph.num_nodes, usable_cores(), args.device)
        threads = args.threads_per_rank or max(1, usable_cores() // args.nprocs)
        # the store's one writer, as a single process takes it (the ranks are its children)
        with _store_lock(args, graph) as waited:
            if (store := _complete_store(args, graph, waited)) is not None:
                # at once: the ranks took 10-20 s to start before they found it complete
                print(_report(store, already_complete=True))
                return 0
            return launch(args.argv, args.nprocs, threads)
    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.models.checkpoint import load_checkpoint

    graph = GraphStore.open(args.dataset)
    model, model_cfg = load_checkpoint(args.model)
    trained_on = model_cfg.get("dataset_fingerprint")
    if trained_on and trained_on != graph.fingerprint:  # as serve warns: allowed, but rarely meant
        logging.getLogger("hybridgnn.precompute").warning(
            "model was trained on dataset %s, precomputing for dataset %s", trained_on, graph.fingerprint)
    if model.in_dim != graph.feature_dim:
        raise ValueError(f"model expects {model.in_dim}-dim features, dataset has {graph.feature_dim}")
    store = precompute(graph, model, args.model, _config(args))
    print(_report(store))
    return 0


def _report(store, **extra) -> str:
    """What precompute prints for the store it made or found complete."""
    return json.dumps({"embeddings": str(store.root), "layers": [list(a.shape) for a in store.layers],
                       "precompute_s": round(store.state.get("precompute_s", 0.0), 2),
                       "computed_unix_s": store.computed_unix_s, **extra}, indent=2)


def _complete_store(args, graph, waited: bool):
    """The complete store that leaves a --nprocs run nothing to do (None: the ranks have
    work), read under the store's lock: one made with these weights, features, dtype and
    order, which the ranks would find complete (starting_state's test); or, after
    waiting for another writer, whatever complete store it made (as precompute's one
    process keeps it)."""
    from hybridgnn.embeddings.store import (
        EmbeddingStore,
        features_fingerprint,
        weights_of,
    )

    store = EmbeddingStore.for_graph(args.model, graph)
    if store is None or waited:
        return store
    wanted = {"dtype": args.dtype, "order": args.order, "model_fingerprint": weights_of(args.model),
              "features_fingerprint": features_fingerprint(graph)}
    return store if all(store.state.get(k) == v for k, v in wanted.items()) else None
