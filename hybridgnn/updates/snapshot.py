"""Snapshots: the updated graph and its embeddings written as a new dataset version, so a
replica starts from the newest one and replays only the log after it.

<snapshot dir>/<position, 12 digits>-<log id>-<model fingerprint>/
    indptr.npy indices.npy features.npy meta.json   the current graph, as a dataset
    alive.npy          which nodes exist (removed ones keep their ids, without edges)
    added_ids.npy      external ids of the nodes updates added (datasets with an id map)
    layer_1.npy ..     embeddings of every layer (output.npy: jumping-knowledge output)
    aggregate_1.npy .. the incremental aggregates as the deltas left them
    keys.json          idempotency keys and their answers
    snapshot.json      log position and id, base dataset and model; written last: a
                       directory without it is not a snapshot

Written atomically: into a temporary directory beside the final one, every file and the
directory fsynced, renamed into place, the parent fsynced. A snapshot belongs to one
log (its id), one base dataset and one model; others are ignored. The newest `keep` of
this log and model are kept; older ones are removed once a newer one is in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.config import read_json
from hybridgnn.graph.store import write_dataset
from hybridgnn.models.checkpoint import CONFIG, WEIGHTS, hash_file, weights_fingerprint

log = logging.getLogger("hybridgnn.updates")

FORMAT = 1


def model_fingerprint(model_dir: Path) -> str:
    """What identifies a model's embeddings: its config and weights (their values, not
    the weights file's bytes, which differ each time the same weights are saved)."""
    h = _config_hash(model_dir)
    if (Path(model_dir) / WEIGHTS).is_file():
        h.update(weights_fingerprint(model_dir).encode())
    return h.hexdigest()[:16]


def legacy_model_fingerprint(model_dir: Path) -> str:
    """What snapshots written before model_fingerprint named a model by (its config and
    its weights file's bytes): they are still found."""
    h = _config_hash(model_dir)
    weights = Path(model_dir) / WEIGHTS
    return (hash_file(h, weights) if weights.is_file() else h).hexdigest()[:16]


def _config_hash(model_dir: Path):
    h = hashlib.sha256()
    config = Path(model_dir) / CONFIG
    if config.is_file():
        h.update(config.read_bytes())
    return h


@dataclass
class Snapshot:
    """The state at one log position: captured from the live graph (copies, to write;
    path None) or read back from disk (arrays memory-mapped)."""

    path: Path | None
    position: int
    graph_version: int
    indptr: np.ndarray
    indices: np.ndarray
    features: np.ndarray
    alive: np.ndarray
    added_ids: np.ndarray | None
    layers: list[np.ndarray] | None
    output: np.ndarray | None
    aggregates: list[np.ndarray | None] | None
    keys: list[tuple[str, str, dict]]


class Snapshots:
    def __init__(self, root: Path, *, base_fingerprint: str, model_fingerprint: str, log_id: str,
                 every: int, keep: int = 2, also_model: str | None = None):
        """also_model: another model fingerprint whose snapshots are this model's too (one
        written before model_fingerprint changed: legacy_model_fingerprint)."""
        self.root = Path(root)
        self.base_fingerprint = base_fingerprint
        self.model_fingerprint = model_fingerprint
        self._models = {model_fingerprint} | ({also_model} if also_model else set())
        self.log_id = log_id
        self.every = every  # log entries between snapshots (0: never write one)
        self.keep = max(1, keep)
        self.last_position = 0

    def _mine(self, any_model: bool = False) -> list[tuple[int, Path]]:
        """(position, path) of the complete snapshots of this log and model (any_model: of
        this log, whatever model wrote them), oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for path in self.root.iterdir():
            info = path / "snapshot.json"
            if not path.is_dir() or path.name.startswith(".") or not info.is_file():
                continue
            try:
                meta = read_json(info)
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict):
                continue
            if (meta.get("format") == FORMAT and meta.get("log_id") == self.log_id
                    and meta.get("base_fingerprint") == self.base_fingerprint
                    and (any_model or meta.get("model_fingerprint") in self._models)):
                position = meta.get("position")
                if isinstance(position, bool) or not isinstance(position, int) or position < 0:
                    # int("x") or int(None) was a traceback at start, every start
                    log.warning("snapshot %s names log position %r, not a whole number: passed over", path,
                                position)
                    continue
                out.append((position, path))
        return sorted(out)

    def oldest_position(self) -> int | None:
        """The log position of the oldest kept snapshot of this log and model (None: none)."""
        mine = self._mine()
        return mine[0][0] if mine else None

    def latest(self, *, with_embeddings: bool) -> Snapshot | None:
        """The newest snapshot that loads, to start from, or None. One that does not load
        (pruned by another replica as this one opened it, a disk error) is passed over for
        the one before it: the log keeps every entry any kept snapshot needs (a trim stops at
        the oldest), so an older start only replays more."""
        for position, path in reversed(self._mine()):
            try:
                return self._load(position, path, with_embeddings)
            except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
                log.warning("snapshot %s does not load (%s: %s); trying an older one", path, type(exc).__name__, exc)
        return None

    def latest_graph(self, at_least: int) -> Snapshot | None:
        """The newest snapshot of this log at position `at_least` or later that loads,
        whichever model wrote it, without embeddings (a graph to start from; this model's
        embeddings are then computed over it), or None."""
        for position, path in reversed(self._mine(any_model=True)):
            if position < at_least:
                break
            try:
                return self._load(position, path, with_embeddings=False)
            except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
                log.warning("snapshot %s does not load (%s: %s); trying an older one", path, type(exc).__name__, exc)
        return None

    def _load(self, position: int, path: Path, with_embeddings: bool) -> Snapshot:
        """The snapshot at path, checked (_check_snapshot); ValueError (or OSError,
        KeyError, TypeError, EOFError) when it does not load."""
        meta = read_json(path / "snapshot.json")
        num_layers = meta.get("num_layers")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 <= num_layers <= 1000:
            raise ValueError(f"snapshot.json's num_layers is {num_layers!r}")

        def load(name: str) -> np.ndarray:
            return np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)

        layers = output = aggregates = None
        if with_embeddings and meta["num_layers"]:
            layers = [load(f"layer_{i + 1}") for i in range(meta["num_layers"])]
            output = load("output") if meta.get("output") else None
            aggregates = [load(f"aggregate_{i + 1}") if (path / f"aggregate_{i + 1}.npy").is_file() else None
                          for i in range(meta["num_layers"])]
        snap = Snapshot(path=path, position=position, graph_version=int(meta["graph_version"]),
                        indptr=np.load(path / "indptr.npy", allow_pickle=False),
                        indices=np.load(path / "indices.npy", allow_pickle=False),
                        features=load("features"), alive=np.load(path / "alive.npy", allow_pickle=False),
                        added_ids=load("added_ids") if meta.get("added_ids") else None,
                        layers=layers, output=output, aggregates=aggregates,
                        keys=[tuple(k) for k in read_json(path / "keys.json")])
        _check_snapshot(snap)
        self.last_position = position
        return snap

    def due(self, position: int) -> bool:
        """Whether a snapshot at `position` is wanted: `every` entries past the newest one,
        whoever wrote it (replicas sharing the directory take turns, not each its own)."""
        if self.every <= 0 or position - self.last_position < self.every:
            return False
        mine = self._mine()
        if mine:
            self.last_position = max(self.last_position, mine[-1][0])
        return position - self.last_position >= self.every

    def capture(self, position: int, graph, incremental, keys) -> Snapshot:
        """Copy what a snapshot at `position` holds (call between entries, from the
        follower: the graph's read lock keeps it consistent against compaction)."""
        with graph.lock.read():
            n = graph.num_nodes
            indptr, indices = graph.to_csr()
            features = graph.features(np.arange(n, dtype=np.int64))
            alive = graph.alive[:n].copy()
            id_map = graph.base.id_map
            added = id_map.to_external(np.arange(graph.base.num_nodes, n)) if id_map is not None else None
            layers = [np.array(a[:n]) for a in incremental.layers] if incremental is not None else None
            output = (np.array(incremental.output[:n]) if incremental is not None and incremental.output is not None
                      else None)
            aggregates = ([None if a is None else np.array(a[:n]) for a in incremental.aggregates]
                          if incremental is not None else None)
            version = graph.version
        return Snapshot(None, position, version, indptr, indices, features, alive, added, layers, output, aggregates,
                        [(k, d, a) for k, (d, a) in keys.items()])

    def write(self, c: Snapshot) -> Path | None:
        """Write a captured state; returns its directory (None: one for this position was
        already there, e.g. written by another replica)."""
        final = self.root / f"{c.position:012d}-{self.log_id[:12]}-{self.model_fingerprint}"
        if final.exists():
            self.last_position = max(self.last_position, c.position)
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        write_dataset(tmp, indptr=c.indptr, indices=c.indices, features=c.features,
                      name=f"snapshot-{c.position}", extra={"snapshot_of": self.base_fingerprint})
        np.save(tmp / "alive.npy", c.alive)
        if c.added_ids is not None:
            np.save(tmp / "added_ids.npy", c.added_ids, allow_pickle=False)
        for i, layer in enumerate(c.layers or []):
            np.save(tmp / f"layer_{i + 1}.npy", layer)
        if c.output is not None:
            np.save(tmp / "output.npy", c.output)
        for i, agg in enumerate(c.aggregates or []):
            if agg is not None:
                np.save(tmp / f"aggregate_{i + 1}.npy", agg)
        (tmp / "keys.json").write_text(json.dumps(c.keys))  # beside, not inside: snapshot.json stays small
        meta = {"format": FORMAT, "position": c.position, "graph_version": c.graph_version, "log_id": self.log_id,
                "base_fingerprint": self.base_fingerprint, "model_fingerprint": self.model_fingerprint,
                "num_nodes": int(len(c.alive)), "num_layers": len(c.layers or []), "output": c.output is not None,
                "added_ids": c.added_ids is not None, "created_unix_s": time.time()}
        (tmp / "snapshot.json").write_text(json.dumps(meta))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another replica put the same snapshot in place first
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        _fsync(self.root)
        self.last_position = max(self.last_position, c.position)
        log.info("snapshot at log position %d written to %s in %.1fs", c.position, final, time.perf_counter() - t0)
        self.prune()
        return final

    def prune(self) -> None:
        """Remove all but the newest `keep` snapshots of this log and model, and temporary
        directories a crash left."""
        for _, path in self._mine()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        if self.root.is_dir():
            for path in self.root.glob(".tmp-*"):
                if path.name.endswith(f"-{os.getpid()}"):
                    continue  # our own, being written
                if time.time() - path.stat().st_mtime > 3600:  # another process's, abandoned
                    shutil.rmtree(path, ignore_errors=True)


def _check_snapshot(snap: Snapshot) -> None:
    """ValueError unless a snapshot read from disk holds what one writes: a CSR whose
    indptr never falls and whose every index names one of its nodes (the samplers, and
    scipy building the reverse adjacency, read rows without bounds checks: a damaged
    indices.npy was a segmentation fault at every start), and per node one alive flag,
    one feature row and one row of every embedding array. Reads each index once."""
    from hybridgnn.graph.store import check_csr, check_index_dtypes

    indptr, indices = snap.indptr, snap.indices
    if indptr.ndim != 1 or indices.ndim != 1 or indptr.shape[0] < 1:
        raise ValueError(f"indptr and indices must be 1-D, got shapes {indptr.shape} and {indices.shape}")
    check_index_dtypes(indptr, indices)
    if int(indptr[0]) != 0 or int(indptr[-1]) != indices.shape[0]:
        raise ValueError(f"indptr must run from 0 to the {indices.shape[0]} indices, runs from {int(indptr[0])} to "
                         f"{int(indptr[-1])}")
    n = indptr.shape[0] - 1
    check_csr(indptr, indices, n)
    if snap.alive.shape != (n,) or snap.alive.dtype != np.bool_:
        raise ValueError(f"alive.npy must hold one bool per node ({n}), got {snap.alive.dtype} {snap.alive.shape}")
    rows = {"features": snap.features, "output": snap.output, **{f"layer_{i + 1}": a for i, a in
                                                                  enumerate(snap.layers or [])},
            **{f"aggregate_{i + 1}": a for i, a in enumerate(snap.aggregates or [])}}
    for name, a in rows.items():
        if a is not None and (a.ndim != 2 or a.shape[0] != n or a.dtype.kind != "f"):
            raise ValueError(f"{name}.npy must hold a float row per node ({n}), got {a.dtype} {a.shape}")
    if isinstance(snap.graph_version, bool) or snap.graph_version < 0:
        raise ValueError(f"graph_version must be a whole number >= 0, got {snap.graph_version!r}")
    if not all(len(k) == 3 and isinstance(k[0], str) and isinstance(k[1], str) and isinstance(k[2], dict)
               for k in snap.keys):
        raise ValueError("keys.json must list [key, digest, answer] triples")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
