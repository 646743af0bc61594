"""One partition rank of a partitioned server (`serve --partitions N`, or `hybridgnn rank`
under torchrun).

Every rank loads only its part (serving_part.py) and runs the same loop: take the next
call from rank 0 (a broadcast of its kind and payload), run it collectively
(PartitionedEvaluator), and, on rank 0, send the answer back over the engine's link.
Rank 0 listens for the engine; while no call comes it broadcasts a PING every
heartbeat, so an idle group still notices a rank that died (the broadcast fails) and
followers never wait past the process group's timeout. A rank that fails exits non-zero:
the group is restarted whole (by the server, or torchrun's --max-restarts), as a
process group cannot take back one rank.
"""

from __future__ import annotations

import os
import signal

from hybridgnn.runtime.ranks import ERROR_FILE_ENV, PARENT_ENV, join_group

if __name__ == "__main__" and os.environ.get(PARENT_ENV):
    # First, before torch: a rank a server started stops when the server says so (STOP) or is
    # gone (_orphaned). A SIGTERM to every process of the service (systemd's default
    # KillMode=control-group) killed the ranks while the server still drained, failing its
    # admitted requests with 503. Ranks under torchrun keep the default: it stops them so.
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, signal.SIG_IGN)

import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridgnn import __version__
from hybridgnn.distributed.agreement import check_agreement
from hybridgnn.distributed.cgp import PartitionedEvaluator
from hybridgnn.distributed.collectives import broadcast
from hybridgnn.distributed.driver import environment
from hybridgnn.distributed.part_updates import PartUpdater
from hybridgnn.distributed.partition import Partition, compute_partition, resolve_method
from hybridgnn.distributed.serving_part import open_serving_part
from hybridgnn.embeddings.newnodes import MODES, POLICIES, unique_ints
from hybridgnn.errors import BadRequest, ConfigError, RemovedNode, ServingError
from hybridgnn.graph.dynamic import UpdateBatch
from hybridgnn.graph.idmap import namer
from hybridgnn.serving.ipc import ranks as wire
from hybridgnn.serving.ipc.wire import WireError

log = logging.getLogger("hybridgnn.rank")


@dataclass(frozen=True)
class RankOptions:
    dataset: Path
    model: Path
    listen: str                  # rank 0's address for the engine (unix:<path> or host:port)
    method: str = "auto"         # partitioning: auto, metis, ranges
    timeout_s: float = 60.0      # the process group's timeout (a hung step fails)
    heartbeat_s: float = 1.0     # rank 0 pings every rank this often while idle
    device: str = "cpu"          # cpu: gloo; cuda: NCCL, one GPU per rank (by local rank)


def open_rank(opts: RankOptions, rank: int, world: int) -> tuple[PartitionedEvaluator, dict]:
    """This rank's evaluator over its part, and (on every rank) the group's description."""
    from hybridgnn.embeddings.store import EmbeddingStore, features_fingerprint
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import load_checkpoint
    from hybridgnn.models.gnn import embedding_width
    from hybridgnn.updates.snapshot import model_fingerprint

    graph = GraphStore.open(opts.dataset)
    model, _ = load_checkpoint(opts.model)
    if model.in_dim != graph.feature_dim:
        raise ConfigError(f"model {opts.model} expects {model.in_dim}-dim features but dataset {opts.dataset} "
                          f"has {graph.feature_dim}")
    features = features_fingerprint(graph)
    store = EmbeddingStore.open(opts.model, graph.fingerprint, graph.num_nodes, features=features, model=model)
    method, model_fp = resolve_method(opts.method), model_fingerprint(opts.model)
    # the group's first collective: ranks that differ here would go out of step in the next
    # ones and wait out the timeout, at every restart
    check_agreement({"hybridgnn": __version__, "ranks": world, "partition": method,
                     "dataset": graph.fingerprint, "features": features, "model": model_fp,
                     "embeddings": store.fingerprint if store else None},
                    "partition ranks", "give every rank the same --dataset, --model and --partition, with the same "
                    "files (and precomputed embeddings) on every machine, and the same hybridgnn")
    partition = _partition(graph, method, rank, world, store.root if store else None)
    def stored_part():
        return open_serving_part(graph, partition, rank, store.layers if store else None,
                                 store.output if store else None)

    part = stored_part()
    ev = PartitionedEvaluator(part, model)  # ConfigError: a layer without a merge function
    ev.updater = PartUpdater(ev, reopen=stored_part, names=graph.id_map)
    memory = [None] * world
    dist.all_gather_object(memory, part.memory_bytes())
    info = {"ranks": world, "partition": partition.method, "num_nodes": graph.num_nodes,
            "dataset_fingerprint": graph.fingerprint, "model_fingerprint": model_fp,
            "num_edges": graph.num_edges, "feature_dim": graph.feature_dim, "out_dim": model.out_dim,
            "embedding_dim": embedding_width(model), "precomputed": store is not None,
            "memory_bytes": memory, "pid": os.getpid()}
    return ev, info


def _partition(graph, method: str, rank: int, world: int, cache_root: Path | None) -> Partition:
    """Rank 0 makes the partition (METIS reads its cache beside the embeddings) and the
    others receive the owner array: no shared filesystem needed, one result everywhere."""
    if method == "ranges":
        return compute_partition(graph, method, world, None)
    owner = torch.empty(graph.num_nodes, dtype=torch.int64)
    if rank == 0:
        owner = torch.from_numpy(np.asarray(compute_partition(graph, method, world, cache_root).owner,
                                            dtype=np.int64).copy())
    return Partition(method, world, owner=broadcast(owner).numpy())


def _checked(ev: PartitionedEvaluator, kind: int, payload) -> tuple[dict, list[np.ndarray]]:
    """The call's head and arrays; BadRequest when they are not what its kind takes. Every
    rank checks the same bytes against the same state before any collective, so a broken
    call (another build's, or not the engine's) is one error answer on every rank, never a
    rank that exits and takes its group with it."""
    try:
        head, arrays = wire.decode(payload)
    except WireError as exc:
        raise BadRequest(f"a broken call to the partition ranks: {exc}") from None

    def ids_in(a, bound: int, shape_ok: bool) -> bool:
        return shape_ok and a.dtype.kind in "iu" and (a.size == 0 or (int(a.min()) >= 0 and int(a.max()) < bound))

    n = ev.part.num_nodes
    if kind in (wire.EXISTING, wire.LOOKUP):
        ok = len(arrays) == 1 and ids_in(arrays[0], n, arrays[0].ndim == 1)
        ok = ok and (kind == wire.EXISTING or isinstance(head.get("with_embeddings"), bool))
    elif kind == wire.NEW_NODES:
        named_from = head.get("num_nodes", n)
        ok = (len(arrays) == 2 and isinstance(named_from, int) and 0 <= named_from <= n
              and head.get("mode") in MODES and head.get("policy") in POLICIES
              and isinstance(head.get("gamma"), (int, float)) and isinstance(head.get("seed", 0), int)
              and arrays[0].ndim == 2 and arrays[0].dtype.kind == "f"
              and arrays[0].shape[1] == ev.part.features.shape[1])
        fanouts = head.get("fanouts")
        ok = ok and (head["mode"] != "sampled" or (isinstance(fanouts, list) and len(fanouts) >= ev.model.num_layers
                                                   and all(isinstance(f, int) for f in fanouts)))
        ok = ok and ids_in(arrays[1], named_from + len(arrays[0]), arrays[1].ndim == 2 and arrays[1].shape[0] == 2)
    elif kind == wire.UPDATE:
        ok = (len(arrays) in (6, 7) and all(a.dtype.kind == k for a, k in zip(arrays, "iifiif", strict=False))
              and (len(arrays) == 6 or (arrays[6].dtype.kind in "iU" and arrays[6].ndim == 1)))
        names = ev.updater.names if ev.updater is not None else None
        if ok and len(arrays) == 7 and names is not None:  # one name per new node, of the dataset's kind
            ok = names.same_kind(arrays[6]) and arrays[2].ndim == 2 and len(arrays[6]) == len(arrays[2])
    else:
        ok = kind == wire.RESET
    if not ok:
        raise BadRequest(f"a call of kind {kind} with a head {sorted(head)} and arrays "
                         f"{[(a.dtype.str, list(a.shape)) for a in arrays]} is not one the partition ranks take")
    return head, arrays


def run(ev: PartitionedEvaluator, kind: int, payload, rid: int = 0) -> bytes | None:
    """One call on this rank; rank 0's answer frame (a result or the request's error)."""
    t0 = time.perf_counter()
    try:
        head, arrays = _checked(ev, kind, payload)
        if kind == wire.UPDATE:
            return _update(ev, head, arrays, rid)
        if kind == wire.RESET:
            ev.updater.reset()
            return wire.encode(wire.RESULT, rid, {"updates_applied": 0}) if ev.rank == 0 else None
        removed = None
        if kind == wire.NEW_NODES:
            edges, n = arrays[1], ev.part.num_nodes
            named_from = int(head.get("num_nodes", n))  # query ids were numbered from the node count then
            if named_from != n:
                edges = np.where(edges >= named_from, edges + (n - named_from), edges)
            dead = _removed(ev, edges[edges < n])  # an edge to a removed node: 404, as on one process
            if len(dead):
                raise RemovedNode.among(dead, namer(ev.updater.names))
            res = ev.infer_new(arrays[0], edges, mode=head["mode"], gamma=float(head["gamma"]),
                               policy=head["policy"], seed=int(head.get("seed", 0)), fanouts=head.get("fanouts"),
                               count_bytes=True)
        elif kind in (wire.EXISTING, wire.LOOKUP):
            # The engine checked these ids when it decoded their requests; an update applied
            # since may have removed some (their rows are stale, their neighbourhoods empty).
            # The call may carry several requests: the engine fails those naming one (404).
            removed = _removed(ev, arrays[0])
            if kind == wire.EXISTING:
                res = ev.infer_existing(arrays[0], count_bytes=True)
            else:
                res = ev.lookup(arrays[0], with_embeddings=bool(head["with_embeddings"]), count_bytes=True)
    except ServingError as exc:  # the request's own fault: every rank finds it the same way
        return wire.encode(wire.ERROR, rid, {"status": exc.status, "message": exc.message})
    if res is None:
        return None
    out = {"recomputed": res.recomputed, "bytes_moved": res.bytes_moved, "compute_s": time.perf_counter() - t0}
    if removed is not None and len(removed):
        out["removed"] = removed.tolist()
    return wire.encode(wire.RESULT, rid, out, (res.logits, res.embeddings))


def _removed(ev: PartitionedEvaluator, ids: np.ndarray) -> np.ndarray:
    """The distinct ids among `ids` that a graph update removed (every rank holds which
    nodes exist, so every rank finds the same)."""
    ids = np.asarray(ids, dtype=np.int64)
    alive = ev.part.alive
    ids = ids[(ids >= 0) & (ids < len(alive))]
    return unique_ints(ids[~alive[ids]])


def _update(ev: PartitionedEvaluator, head: dict, arrays: list[np.ndarray], rid: int) -> bytes | None:
    """A graph-update batch, checked only or applied (then the embeddings refreshed); the
    report, or the error refusing the batch, is the same on every rank. A failure past the
    check propagates: this rank's state is half-applied, so it exits and the group restarts."""
    try:
        batch = UpdateBatch.from_arrays(arrays[:6])  # _checked saw six arrays of the right kinds
    except ValueError as exc:  # lengths that do not fit together: refused on every rank, nothing applied
        raise BadRequest(f"a broken graph-update call to the partition ranks: {exc}") from None
    if head.get("check_only"):
        report = {"new_nodes": ev.updater.check(batch)}
    else:
        report = ev.updater.apply(batch, arrays[6] if len(arrays) == 7 else None)  # the new nodes' names
    return wire.encode(wire.RESULT, rid, report) if ev.rank == 0 else None


def _share(kind: int, payload: bytes | memoryview = b"") -> None:
    """Rank 0: every rank gets this call's kind and payload."""
    broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64))
    if len(payload):
        broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def _next_call() -> tuple[int, memoryview]:
    """A follower: the next call rank 0 shares."""
    header = broadcast(torch.empty(2, dtype=torch.int64), idle=True)  # waits while the group is idle
    kind, size = int(header[0]), int(header[1])
    buf = broadcast(torch.empty(size, dtype=torch.uint8)) if size else torch.empty(0, dtype=torch.uint8)
    return kind, memoryview(buf.numpy()).cast("B")


def follow(ev: PartitionedEvaluator) -> None:
    """A rank other than 0: run every shared call until STOP."""
    while True:
        kind, payload = _next_call()
        if kind == wire.STOP:
            return
        if kind != wire.PING:
            run(ev, kind, payload)


def lead(ev: PartitionedEvaluator, info: dict, opts: RankOptions) -> None:
    """Rank 0: serve the engine's calls (one link at a time) until STOP."""
    server = wire.listen(opts.listen)
    server.settimeout(opts.heartbeat_s)
    log.info("partition rank 0 of %d listening on %s", info["ranks"], opts.listen)
    try:
        while True:
            try:
                conn, _ = server.accept()
            except (TimeoutError, socket.timeout):
                if _orphaned():
                    _share(wire.STOP)
                    return
                _share(wire.PING)
                continue
            link = wire.Link(conn)
            try:
                # what this group applied since it started: a server linking to ranks that
                # outlived its predecessor resets them before replaying its log
                link.send(wire.encode(wire.HELLO, 0, {**info, "updates_applied": ev.updater.version}))
                if _serve_link(ev, link, opts):
                    return
            except (ConnectionError, OSError, WireError) as exc:
                log.warning("engine link closed: %s", exc)
            finally:
                link.close()
    finally:
        server.close()
        if opts.listen.startswith("unix:"):
            try:
                os.unlink(opts.listen[5:])
            except OSError:
                pass


def _orphaned() -> bool:
    """Whether the server that started these ranks is gone (killed without stopping them)."""
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and os.getppid() != int(parent)


def _serve_link(ev: PartitionedEvaluator, link: wire.Link, opts: RankOptions) -> bool:
    """Calls from one engine link until it closes (False) or says STOP (True)."""
    while True:
        try:
            # a frame cut short must not hold rank 0 past the followers' timeout: they wait
            # in the broadcast of the next call
            kind, rid, payload = link.recv(opts.heartbeat_s, opts.timeout_s / 2)
        except (TimeoutError, socket.timeout):
            if _orphaned():
                _share(wire.STOP)
                return True
            _share(wire.PING)
            continue
        _share(kind, payload)
        if kind == wire.STOP:
            return True
        if kind == wire.PING:
            link.send(wire.encode(wire.RESULT, rid, {}))
            continue
        link.send(run(ev, kind, payload, rid))


def _backend(device: str, local_rank: int) -> str:
    """gloo on CPU; NCCL with this rank's GPU (its local rank) made current."""
    if device != "cuda":
        return "gloo"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= visible:
        raise ConfigError(f"--device cuda needs one GPU per rank on a machine: local rank {local_rank}, "
                          f"{visible} GPU(s) visible")
    torch.cuda.set_device(local_rank)
    return "nccl"


def serve_rank(opts: RankOptions) -> None:
    """Join the process group (torchrun's or the server's environment) and serve as this rank."""
    rank, world, local_rank = environment()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    join_group(_backend(opts.device, local_rank), rank, world, timedelta(seconds=opts.timeout_s))
    try:
        ev, info = open_rank(opts, rank, world)
        if rank == 0:
            lead(ev, info, opts)
        else:
            follow(ev)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m hybridgnn.distributed.rank_server")
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--partition", default="auto", choices=("auto", "metis", "ranges"))
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = RankOptions(a.dataset, a.model, a.listen, a.partition, a.timeout_s, a.heartbeat_s, a.device)
    return serve(opts)


def serve(opts: RankOptions) -> int:
    """serve_rank, with a failure as one line in the rank's error file (the server reads
    it to say why the group stopped) and exit code 1."""
    try:
        serve_rank(opts)
        return 0
    except KeyboardInterrupt:
        return 1
    except (ConfigError, OSError, RuntimeError, ValueError, WireError) as exc:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        where = os.environ.get(ERROR_FILE_ENV)
        if where:
            Path(where).write_text(text + "\n")
        log.error("rank %s: %s", os.environ.get("RANK", "?"), text)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
