"""Trimming the update log (`--update-log-retain`) on a real server: the log stops growing
once snapshots cover it, a restart from the kept snapshot serves every acknowledged
update, and a replica with no snapshot that reaches back far enough is refused at start
with one line. The SQLite log and a Redis stream (a real redis-server) trim alike."""

from __future__ import annotations

import shutil
import time

import pytest

from hybridgnn.errors import LogTrimmed
from hybridgnn.graph.store import GraphStore
from hybridgnn.updates.log import SqliteLog
from tests.support.durability import add_node_body, graph_state, send_update
from tests.support.ops_tools import require_tool
from tests.support.replication import RedisServer
from tests.support.server import ServerProcess, await_ready

pytestmark = [pytest.mark.ops]

TOKEN = "retain-token-123"


def test_a_trimmed_log_restarts_from_its_snapshot_and_refuses_a_replica_without_one(tiny_dataset, tiny_model_pe,
                                                                                      tmp_path):
    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset)
    log_path, snaps = tmp_path / "updates.sqlite", tmp_path / "snaps"
    common = ("--workers", "1", "--update-token", TOKEN, "--update-log", str(log_path))
    flags = (*common, "--snapshot-dir", str(snaps), "--snapshot-every", "4", "--snapshot-keep", "1",
             "--update-log-retain", "3")
    srv = ServerProcess(dataset, tiny_model_pe, *flags).wait_ready()
    base = graph_state(srv.url)
    try:
        for k in range(13):
            status, out = send_update(srv.url, TOKEN, f"k{k}", add_node_body(k, k % base["num_nodes"],
                                                                             base["feature_dim"]))
            assert status == 200, out
        # a snapshot (every 4 entries, written in the background) and then the trim, up to
        # the snapshot and no nearer the head than 3
        log = SqliteLog(log_path, GraphStore.open(dataset).fingerprint)
        deadline = time.monotonic() + 60
        while log.first() == 1:
            assert time.monotonic() < deadline, "the log was not trimmed"
            time.sleep(0.05)  # poll interval; bounded by the deadline
        first = log.first()
        snapshot = max(int(p.name[:12]) for p in snaps.iterdir() if not p.name.startswith("."))
        assert 1 < first <= min(snapshot, 13 - 3) + 1 and len(log) == 13 - first + 1
        log.close()
    finally:
        assert srv.stop() == 0
    srv = ServerProcess(dataset, tiny_model_pe, *flags, port=srv.port)
    try:
        await_ready(srv, "restarted server", 120)
        now = graph_state(srv.url)
        assert now["graph_version"] == 13 and now["num_nodes"] == base["num_nodes"] + 13
    finally:
        assert srv.stop() == 0
    log = SqliteLog(log_path, GraphStore.open(dataset).fingerprint)
    first = log.first()  # a later snapshot may have trimmed further since
    log.close()
    late = ServerProcess(dataset, tiny_model_pe, *common, "--snapshot-dir", str(tmp_path / "empty"))
    assert late.proc.wait(120) == 2
    out = late.output()
    assert f"holds entries from position {first} on" in out and "the dataset (no snapshot)" in out, out
    assert "Traceback" not in out


def test_a_redis_log_trims_like_the_sqlite_one(tmp_path):
    require_tool("redis-server")
    from hybridgnn.updates.redis_log import RedisLog

    with RedisServer(tmp_path / "redis") as redis_server:
        log = RedisLog(redis_server.url("updates"), "abc")
        for i in range(10):
            assert log.append(b"e%d" % i) == i + 1
        assert log.first() == 1 and log.trim(4) == 4 and log.first() == 5
        assert log.trim(3) == 0 and log.first() == 5
        assert [e.position for e in log.read(4, 3)] == [5, 6, 7]
        with pytest.raises(LogTrimmed, match="from position 5 on"):
            log.read(2, 10)
        assert log.trim(100) == 5 and log.first() == 10 and log.head() == 10
        assert log.append(b"e10") == 11 and [e.position for e in log.read(9, 10)] == [10, 11]
        log.close()
