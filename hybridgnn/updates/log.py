"""A durable log of applied graph-update batches (SQLite in WAL mode).

Each record is one batch exactly as it was applied: node ids already resolved, and the
graph's node count before it (so replay can check it lands where it landed live). A
batch is appended inside its apply, after every in-memory write and before the writer
lock is released: if the append fails the batch rolls back, and the client is answered
only after the append committed (synchronous=FULL: the commit is on disk). A crash
between commit and answer leaves an applied batch nobody was told about; a crash before
the commit leaves nothing. Replaying the log over the stored dataset therefore rebuilds
exactly the acknowledged state, batch by batch in the order they were applied.

Records are numpy .npz blobs read with allow_pickle=False: the log holds arrays, never
code.
"""

from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hybridgnn.errors import ConfigError
from hybridgnn.graph.dynamic import UpdateBatch

SCHEMA = 1
_FIELDS = ("add_edges", "remove_edges", "add_node_features", "remove_nodes", "update_ids", "update_features")


def encode_batch(batch: UpdateBatch, base_nodes: int, feature_dim: int,
                 new_external_ids: np.ndarray | None = None) -> bytes:
    """The batch's arrays (None rows as empty [0, F]), the node count it applied to and,
    on a dataset with an id map, the external ids its new nodes were given (int64, or
    fixed-width unicode: no pickle either way)."""
    arrays = {}
    for name in _FIELDS:
        value = getattr(batch, name)
        if value is None:
            value = np.empty((0, feature_dim), np.float32)
        arrays[name] = np.ascontiguousarray(value)
    buf = io.BytesIO()
    ext = np.empty(0, np.int64) if new_external_ids is None else np.asarray(new_external_ids)
    np.savez(buf, base_nodes=np.int64(base_nodes), new_external_ids=ext, **arrays)
    return buf.getvalue()


def decode_batch(blob: bytes) -> tuple[UpdateBatch, int, np.ndarray]:
    """(batch, the node count it applied to, its new nodes' external ids or empty)."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        arrays = {name: z[name] for name in _FIELDS}
        base_nodes = int(z["base_nodes"])
        ext = z["new_external_ids"]
    for name in ("add_node_features", "update_features"):
        if len(arrays[name]) == 0:
            arrays[name] = None
    return UpdateBatch(**arrays), base_nodes, ext


def parse_log_url(url: str | None, dataset_dir: Path) -> Path | None:
    """sqlite:///abs/path, a plain path, "off" (no log: updates live only in memory), or
    None for the default <dataset>/updates.sqlite."""
    if url is None:
        return Path(dataset_dir) / "updates.sqlite"
    if url == "off":
        return None
    if url.startswith("sqlite://"):
        path = url[len("sqlite://"):]
        if not path:
            raise ConfigError(f"update log {url!r}: give a path, e.g. sqlite:///var/lib/hybridgnn/updates.sqlite")
        return Path(path)
    if "://" in url:
        raise ConfigError(f"update log {url!r}: this build supports sqlite:///<path>, a path, or off")
    return Path(url)


class UpdateLog:
    """Append-only, ordered batches; positions are 1, 2, 3, ... in apply order."""

    def __init__(self, path: Path, dataset_fingerprint: str, feature_dim: int):
        self.path = Path(path)
        self.feature_dim = feature_dim
        self._lock = threading.Lock()  # one writer; applies run on worker threads
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before append returns
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS batches (position INTEGER PRIMARY KEY, "
                             "applied_unix_s REAL NOT NULL, body BLOB NOT NULL)")
            # Idempotency keys of the requests a batch carried, with the answer each got, so a
            # retry (after a lost answer, a timeout, a kill) is answered again, not applied again.
            self._db.execute("CREATE TABLE IF NOT EXISTS request_keys (key TEXT PRIMARY KEY, "
                             "position INTEGER NOT NULL, body_sha256 TEXT NOT NULL, answer TEXT NOT NULL)")
            # Lookups of keys come from the event loop while an append may hold the writer
            # connection through its fsync: a second connection reads (WAL lets it).
            self._reader = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError(f"cannot open the update log {self.path}: {exc} (graph updates need a "
                              "writable log; --update-log off keeps them in memory only)") from exc
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not meta:
            self._db.executemany("INSERT INTO meta VALUES (?, ?)",
                                 [("schema", str(SCHEMA)), ("dataset_fingerprint", dataset_fingerprint)])
        elif meta.get("schema") != str(SCHEMA):
            raise ConfigError(f"update log {self.path} has schema {meta.get('schema')}; this build reads {SCHEMA}")
        elif meta.get("dataset_fingerprint") != dataset_fingerprint:
            raise ConfigError(f"update log {self.path} belongs to dataset {meta.get('dataset_fingerprint')}, not "
                              f"{dataset_fingerprint}; point --update-log elsewhere or remove it")
        self.last_position = self.position  # kept up to date by append: metrics read it from any thread

    @property
    def position(self) -> int:
        """The last appended position (0: empty)."""
        row = self._db.execute("SELECT MAX(position) FROM batches").fetchone()
        return int(row[0] or 0)

    def append(self, batch: UpdateBatch, base_nodes: int, new_external_ids: np.ndarray | None = None,
               keyed_answers: Callable[[int], list[tuple[str, str, dict]]] | None = None) -> int:
        """Commit one applied batch durably, with the idempotency keys of its requests and
        their answers (keyed_answers(position) -> [(key, body sha256, answer)]), in one
        transaction; returns its position."""
        blob = encode_batch(batch, base_nodes, self.feature_dim, new_external_ids)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute("INSERT INTO batches (applied_unix_s, body) VALUES (?, ?)",
                                       (time.time(), blob))
                position = int(cur.lastrowid)
                for key, digest, answer in (keyed_answers(position) if keyed_answers else []):
                    self._db.execute("INSERT INTO request_keys VALUES (?, ?, ?, ?)",
                                     (key, position, digest, json.dumps(answer)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self.last_position = position
            return position

    def answer_for(self, key: str) -> tuple[str, dict] | None:
        """(body sha256, answer) of the request that carried this idempotency key, if any
        was committed."""
        row = self._reader.execute("SELECT body_sha256, answer FROM request_keys WHERE key = ?", (key,)).fetchone()
        return None if row is None else (row[0], json.loads(row[1]))

    def entries(self, after: int = 0) -> Iterator[tuple[int, UpdateBatch, int, np.ndarray]]:
        """(position, batch, base_nodes, new external ids) after `after`, in order."""
        rows = self._db.execute("SELECT position, body FROM batches WHERE position > ? ORDER BY position", (after,))
        for position, body in rows:
            yield int(position), *decode_batch(body)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM batches").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._reader.close()


def open_update_log(url: str | None, graph) -> UpdateLog | None:
    """The log a server with updates on writes (None for "off"), for a GraphStore."""
    path = parse_log_url(url, graph.root)
    return None if path is None else UpdateLog(path, graph.fingerprint, graph.feature_dim)
