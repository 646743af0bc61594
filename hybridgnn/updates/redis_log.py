"""The update log in a Redis stream, shared by replicas on several machines.

redis://host:port[/db]/<stream>. Positions are kept dense (1, 2, 3, ...) by a Lua script
that takes the next number from <stream>:seq and adds the entry with stream id
"<position>-0" in one atomic step, so every replica reads the same entries at the same
positions and a reader resumes with XREAD after "<applied>-0". <stream>:meta holds the
dataset fingerprint and the log's id.

How durable an acknowledged entry is depends on the Redis server: run it with
`appendonly yes` and `appendfsync always` (an append is then on the server's disk
before Redis answers), and with a replica of its own for a machine loss.
"""

from __future__ import annotations

import time
import uuid
from urllib.parse import urlparse

from hybridgnn.errors import ConfigError, ServiceUnavailable
from hybridgnn.updates.log import LogEntry, UpdateLog, check_dense

_APPEND = """
local position = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], position .. '-0', 'body', ARGV[1], 't', ARGV[2])
return position
"""

# Trims up to ARGV[1] but never the last entry, and records how far (only ever forward)
# in the same atomic step, so a reader that finds a gap knows it was a trim. A script is
# not rolled back when a command in it fails: the first line (which removes nothing) fails
# on a server without XTRIM MINID (before Redis 6.2) before anything is written.
_TRIM = """
redis.call('XTRIM', KEYS[1], 'MINID', '0-0')
local upto = math.min(tonumber(ARGV[1]), tonumber(redis.call('GET', KEYS[2]) or '0') - 1)
if upto <= tonumber(redis.call('HGET', KEYS[3], 'trimmed_upto') or '0') then
  return 0
end
redis.call('HSET', KEYS[3], 'trimmed_upto', upto)
return redis.call('XTRIM', KEYS[1], 'MINID', (upto + 1) .. '-0')
"""


def parse_redis_url(url: str) -> tuple[str, int, int, str]:
    """(host, port, db, stream) of redis://host:port[/db]/<stream>."""
    u = urlparse(url)
    parts = [p for p in u.path.split("/") if p]
    if u.scheme != "redis" or not u.hostname or not parts or len(parts) > 2:
        raise ConfigError(f"update log {url!r}: use redis://host:port/<stream> or redis://host:port/<db>/<stream>")
    db = 0
    if len(parts) == 2:
        if not parts[0].isdigit():
            raise ConfigError(f"update log {url!r}: the database number must be an integer")
        db = int(parts[0])
    try:
        port = u.port or 6379
    except ValueError as exc:
        raise ConfigError(f"update log {url!r}: {exc}") from exc
    return u.hostname, port, db, parts[-1]


class RedisLog(UpdateLog):
    def __init__(self, url: str, dataset_fingerprint: str, *, connect_timeout_s: float = 5.0):
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - a dependency, present unless uninstalled
            raise ConfigError("a Redis update log needs redis-py (pip install redis)") from exc
        self._redis_errors = (redis.RedisError, OSError)
        self._refused = redis.ResponseError  # the server answered, with an error
        host, port, db, self.stream = parse_redis_url(url)
        self.url = url
        self._seq, self._meta = f"{self.stream}:seq", f"{self.stream}:meta"
        # One client (a thread-safe connection pool): appends come from the applier's
        # threads, reads from the follower's, which blocks in XREAD on its own connection.
        self._redis = redis.Redis(host=host, port=port, db=db, socket_connect_timeout=connect_timeout_s,
                                  socket_timeout=30, health_check_interval=30)
        try:
            self._redis.hsetnx(self._meta, "dataset_fingerprint", dataset_fingerprint)
            self._redis.hsetnx(self._meta, "log_id", uuid.uuid4().hex)
            meta = {k.decode(): v.decode() for k, v in self._redis.hgetall(self._meta).items()}
            self._append = self._redis.register_script(_APPEND)
            self._trim = self._redis.register_script(_TRIM)
        except self._redis_errors as exc:
            raise ConfigError(f"cannot reach the update log {url}: {exc}") from exc
        if meta.get("dataset_fingerprint") != dataset_fingerprint:
            raise ConfigError(f"update log {url} belongs to dataset {meta.get('dataset_fingerprint')}, not "
                              f"{dataset_fingerprint}; use another stream")
        self.log_id = meta["log_id"]

    def append(self, body: bytes) -> int:
        try:
            return int(self._append(keys=[self.stream, self._seq], args=[body, repr(time.time())]))
        except self._redis_errors as exc:
            # The script is atomic: on a lost answer the entry may still be in the stream,
            # and it applies like any other; an idempotency key makes the retry safe.
            raise ServiceUnavailable(f"the update log {self.url} is unreachable: {exc}; if the append reached it "
                                     "before its answer was lost, the update applies: retry with the same "
                                     "Idempotency-Key") from exc

    def read(self, after: int, limit: int, block_s: float = 0.0) -> list[LogEntry]:
        kw = {"block": max(1, int(block_s * 1000))} if block_s > 0 else {}
        try:
            got = self._redis.xread({self.stream: f"{after}-0"}, count=limit, **kw)
        except self._redis_errors as exc:
            raise ServiceUnavailable(f"the update log {self.url} is unreachable: {exc}") from exc
        out = []
        for _stream, items in got or []:
            for entry_id, fields in items:
                position = int(entry_id.split(b"-")[0])
                out.append(LogEntry(position, float(fields[b"t"]), bytes(fields[b"body"])))
        return check_dense(self, after, out)

    def head(self) -> int:
        try:
            return int(self._redis.get(self._seq) or 0)
        except self._redis_errors as exc:
            raise ServiceUnavailable(f"the update log {self.url} is unreachable: {exc}") from exc

    def first(self) -> int:
        try:
            return int(self._redis.hget(self._meta, "trimmed_upto") or 0) + 1
        except self._redis_errors as exc:
            raise ServiceUnavailable(f"the update log {self.url} is unreachable: {exc}") from exc

    def trim(self, upto: int) -> int:
        try:
            return int(self._trim(keys=[self.stream, self._seq, self._meta], args=[int(upto)]))
        except self._refused as exc:
            raise ServiceUnavailable(f"the update log {self.url} cannot be trimmed ({exc}): --update-log-retain "
                                     "trims the stream with XTRIM MINID, which needs Redis 6.2 or newer") from exc
        except self._redis_errors as exc:
            raise ServiceUnavailable(f"the update log {self.url} is unreachable: {exc}") from exc

    def close(self) -> None:
        self._redis.close()
