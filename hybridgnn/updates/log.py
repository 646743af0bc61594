"""The ordered, durable log of graph-update entries that every replica applies.

An accepted update is appended to the log first; append returns once the entry is
durable and has its position (1, 2, 3, ...: the one order every replica applies entries
in, so node ids assigned in that order agree everywhere). Each replica's follower reads
entries after the position it has applied and applies them (updates/follower.py); a
request is answered once its entry is applied on the replica that accepted it.

Backends: SQLite in WAL mode (the embedded default, beside the dataset; replicas on one
machine may share the file), Redis Streams (updates/redis_log.py: replicas on several
machines), and memory (--update-log off: nothing survives a restart). Each log records
the dataset it belongs to and a random id of its own, so a snapshot taken from one log
is never replayed against another.

Trimming (`--update-log-retain N`): entries every kept snapshot covers, beyond the newest
N, may be dropped (trim). The last entry is never dropped, so positions go on; a reader
that asks for entries from before the first one still held is refused (LogTrimmed), never
handed a gap.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import itertools
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hybridgnn.errors import ConfigError, LogTrimmed, ServiceUnavailable

SCHEMA = 2
# A log's schema once it has been trimmed: builds from before trimming read only SCHEMA
# and would not notice the missing entries, so they refuse it; this build reads both.
TRIMMED_SCHEMA = 3
POLL_S = 0.005  # how often a reader looks for entries other processes appended (SQLite)


@dataclass(frozen=True)
class LogEntry:
    position: int
    appended_unix_s: float
    body: bytes


class UpdateLog(abc.ABC):
    """Append-only entries, read in position order. Thread-safe."""

    url: str
    log_id: str
    durable: bool = True

    @abc.abstractmethod
    def append(self, body: bytes) -> int:
        """Store one entry durably; returns its position. ServiceUnavailable when the log
        cannot be reached (nothing was appended, or it will be read like any entry)."""

    @abc.abstractmethod
    def read(self, after: int, limit: int, block_s: float = 0.0) -> list[LogEntry]:
        """Up to `limit` entries after position `after`, in order; waits up to block_s for
        one when there are none."""

    @abc.abstractmethod
    def head(self) -> int:
        """The last appended position (0: empty)."""

    def first(self) -> int:
        """The first position still held: entries before it were trimmed (1: none were)."""
        return 1

    def trim(self, upto: int) -> int:
        """Drop the entries at positions <= upto, never the last one; returns how many went."""
        return 0

    def close(self) -> None:
        pass


def check_dense(update_log: UpdateLog, after: int, got: list[LogEntry]) -> list[LogEntry]:
    """`got` (read after `after`), or LogTrimmed when it does not start at after + 1
    because the entries between were trimmed."""
    if got and got[0].position != after + 1:
        first = update_log.first()
        if after + 1 < first:
            raise LogTrimmed(update_log.url, after, first)
    return got


class MemoryLog(UpdateLog):
    """--update-log off: the same order and answers, kept in this process only. Entries
    its one reader has read past are dropped, unless `keep_all` (a partitioned group
    replays the whole log into its ranks whenever it is formed)."""

    durable = False

    def __init__(self, keep_all: bool = False):
        self.url = "off"
        self.log_id = f"memory-{uuid.uuid4().hex}"
        self.keep_all = keep_all
        self._entries: collections.deque[LogEntry] = collections.deque()
        self._head = 0
        self._cond = threading.Condition()

    def append(self, body: bytes) -> int:
        with self._cond:
            self._head += 1
            self._entries.append(LogEntry(self._head, time.time(), body))
            self._cond.notify_all()
            return self._head

    def read(self, after: int, limit: int, block_s: float = 0.0) -> list[LogEntry]:
        with self._cond:
            if not self.keep_all:  # the reader has applied everything up to `after`
                while self._entries and self._entries[0].position <= after:
                    self._entries.popleft()
            first = self._entries[0].position if self._entries else self._head + 1
            if after + 1 < first:
                raise LookupError(f"entries {after + 1}..{first - 1} of the in-memory update log were dropped "
                                  "once read")
            if self._head <= after and block_s > 0:
                self._cond.wait(block_s)
            return list(itertools.islice(self._entries, after + 1 - first, after + 1 - first + limit))

    def __len__(self) -> int:
        return len(self._entries)

    def head(self) -> int:
        return self._head

    def first(self) -> int:
        with self._cond:
            return self._entries[0].position if self._entries else self._head + 1


class SqliteLog(UpdateLog):
    """One SQLite file in WAL mode, synchronous=FULL: an append has reached the disk when it
    returns. Several processes on one machine may share it: SQLite serialises appenders,
    and readers poll for entries others appended."""

    def __init__(self, path: Path, dataset_fingerprint: str):
        self.path = Path(path)
        self.url = f"sqlite://{self.path.resolve()}"
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._appended = threading.Condition()  # wakes this process's readers at once
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._connect()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before append returns
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                self._db.execute("CREATE TABLE IF NOT EXISTS entries (position INTEGER PRIMARY KEY, "
                                 "appended_unix_s REAL NOT NULL, body BLOB NOT NULL)")
                meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
                if not meta:
                    meta = {"schema": str(SCHEMA), "dataset_fingerprint": dataset_fingerprint,
                            "log_id": uuid.uuid4().hex}
                    self._db.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
                self._db.execute("COMMIT")
            except BaseException:
                _rollback(self._db)
                raise
            # Reads come from the follower while an append may hold the writer connection
            # through its fsync: a second connection reads (WAL lets it).
            self._reader = self._connect()
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError(f"cannot open the update log {self.path}: {exc} (graph updates need a "
                              "writable log; --update-log off keeps them in memory only)") from exc
        if meta.get("schema") not in (str(SCHEMA), str(TRIMMED_SCHEMA)):
            raise ConfigError(f"update log {self.path} has schema {meta.get('schema')}; this build reads {SCHEMA} "
                              f"and {TRIMMED_SCHEMA} "
                              "(move the old file away to start a new log)")
        if meta.get("dataset_fingerprint") != dataset_fingerprint:
            raise ConfigError(f"update log {self.path} belongs to dataset {meta.get('dataset_fingerprint')}, not "
                              f"{dataset_fingerprint}; point --update-log elsewhere or remove it")
        self.log_id = meta["log_id"]

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA busy_timeout=30000")  # other replicas' appends hold the write lock briefly
        return db

    def append(self, body: bytes) -> int:
        with self._write_lock:
            try:
                cur = self._db.execute("INSERT INTO entries (appended_unix_s, body) VALUES (?, ?)",
                                       (time.time(), body))
            except sqlite3.Error as exc:
                raise ServiceUnavailable(f"the update log {self.path} refused the append: {exc}") from exc
            position = int(cur.lastrowid)
        with self._appended:
            self._appended.notify_all()
        return position

    def _select(self, after: int, limit: int) -> list[LogEntry]:
        with self._read_lock:
            rows = self._reader.execute("SELECT position, appended_unix_s, body FROM entries WHERE position > ? "
                                        "ORDER BY position LIMIT ?", (after, limit)).fetchall()
        return [LogEntry(int(p), float(t), bytes(b)) for p, t, b in rows]

    def read(self, after: int, limit: int, block_s: float = 0.0) -> list[LogEntry]:
        deadline = time.monotonic() + block_s
        while True:
            got = self._select(after, limit)
            left = deadline - time.monotonic()
            if got or left <= 0:
                return check_dense(self, after, got)
            with self._appended:
                self._appended.wait(min(left, POLL_S))

    def head(self) -> int:
        with self._read_lock:
            row = self._reader.execute("SELECT MAX(position) FROM entries").fetchone()
        return int(row[0] or 0)

    def first(self) -> int:
        with self._read_lock:
            row = self._reader.execute("SELECT value FROM meta WHERE key = 'trimmed_upto'").fetchone()
        return int(row[0]) + 1 if row else 1

    def trim(self, upto: int) -> int:
        # The last row stays: SQLite numbers a new row one past the largest there, so
        # positions never restart. The freed pages are reused by later appends.
        with self._write_lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    head = int(self._db.execute("SELECT MAX(position) FROM entries").fetchone()[0] or 0)
                    row = self._db.execute("SELECT value FROM meta WHERE key = 'trimmed_upto'").fetchone()
                    upto = min(upto, head - 1)
                    if upto <= (int(row[0]) if row else 0):
                        self._db.execute("COMMIT")
                        return 0
                    gone = self._db.execute("DELETE FROM entries WHERE position <= ?", (upto,)).rowcount
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES ('trimmed_upto', ?)", (str(upto),))
                    self._db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(TRIMMED_SCHEMA),))
                    self._db.execute("COMMIT")
                except BaseException:
                    _rollback(self._db)
                    raise
            except sqlite3.Error as exc:
                raise ServiceUnavailable(f"the update log {self.path} refused the trim: {exc}") from exc
        return int(gone)

    def __len__(self) -> int:
        with self._read_lock:
            return int(self._reader.execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            self._db.close()
            self._reader.close()


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back the open transaction, if one is still open: a failure that ended it
    already (SQLite rolls back on some errors) must surface, not the ROLLBACK's own."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")


def parse_log_url(url: str | None, dataset_dir: Path) -> str:
    """The log's URL: sqlite:///abs/path (a plain path means the same), redis://host:port/
    <stream>, or "off"; None is the default <dataset>/updates.sqlite."""
    if url is None:
        return f"sqlite://{(Path(dataset_dir) / 'updates.sqlite').resolve()}"
    if url == "off" or url.startswith("redis://"):
        return url
    if url.startswith("sqlite://"):
        if not url[len("sqlite://"):]:
            raise ConfigError(f"update log {url!r}: give a path, e.g. sqlite:///var/lib/hybridgnn/updates.sqlite")
        return url
    if "://" in url:
        raise ConfigError(f"update log {url!r}: use sqlite:///<path>, a path, redis://host:port/<stream>, or off")
    return f"sqlite://{Path(url).expanduser().resolve()}"  # --update-log=~/u.sqlite was ./~/u.sqlite


def logged_updates(url: str | None, dataset_dir: Path) -> int:
    """The last position of a SQLite update log that exists (0: none, empty, or a log
    this process does not open without updates on: Redis, off). Read-only; opens nothing
    it would have to create."""
    url = parse_log_url(url, dataset_dir)
    if not url.startswith("sqlite://"):
        return 0
    path = Path(url[len("sqlite://"):])
    if not path.is_file():
        return 0
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            row = db.execute("SELECT MAX(position) FROM entries").fetchone()
        finally:
            db.close()
    except sqlite3.Error:  # not a log (no entries table), or unreadable: nothing to follow
        return 0
    return int(row[0] or 0)


def open_update_log(url: str | None, dataset_dir: Path, dataset_fingerprint: str,
                    replayed: bool = False) -> UpdateLog:
    """The log a server with updates on appends to and follows (replayed: read again from
    the start whenever a partitioned group is formed, so an in-memory log keeps it all)."""
    url = parse_log_url(url, dataset_dir)
    if url == "off":
        return MemoryLog(keep_all=replayed)
    if url.startswith("redis://"):
        from hybridgnn.updates.redis_log import (
            RedisLog,  # redis-py only where a Redis log is used
        )

        return RedisLog(url, dataset_fingerprint)
    return SqliteLog(Path(url[len("sqlite://"):]), dataset_fingerprint)
