"""Trimming the update log (`--update-log-retain`) on a real server: the log stops growing
once snapshots cover it, a restart from the kept snapshot serves every acknowledged
update, and a replica with no snapshot that reaches back far enough is refused at start
with one line. The SQLite log and a Redis stream (a real redis-server) trim alike."""

from __future__ import annotations

import shutil
import signal
import time

import numpy as np
import pytest

from hybridgnn.errors import LogTrimmed, ServiceUnavailable
from hybridgnn.graph.store import GraphStore
from hybridgnn.updates.log import SqliteLog
from tests.support.durability import add_node_body, graph_state, send_update
from tests.support.ops_tools import require_tool
from tests.support.replication import RedisServer
from tests.support.server import ServerProcess, await_ready, metrics_text, poll_ready

pytestmark = [pytest.mark.ops]

TOKEN = "retain-token-123"


def trimmed_log(log_path, dataset, timeout_s: float = 60.0) -> SqliteLog:
    """The log at log_path once a server has trimmed it (after a snapshot, in the background)."""
    log = SqliteLog(log_path, GraphStore.open(dataset).fingerprint)
    deadline = time.monotonic() + timeout_s
    while log.first() == 1:
        assert time.monotonic() < deadline, "the log was not trimmed"
        time.sleep(0.05)  # poll interval; bounded by the deadline
    return log


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
        log = trimmed_log(log_path, dataset)
        while True:  # a later snapshot's trim may land between two reads: take a pair from one state
            first, kept = log.first(), len(log)
            if log.first() == first:
                break
        snapshot = max(int(p.name[:12]) for p in snaps.iterdir() if not p.name.startswith("."))
        assert 1 < first <= min(snapshot, 13 - 3) + 1 and kept == 13 - first + 1, (first, kept, snapshot)
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


def test_a_redis_server_that_cannot_trim_is_refused_at_start_and_records_no_trim(tiny_dataset, tiny_model_pe,
                                                                                  tmp_path):
    # XTRIM MINID came in Redis 6.2 (older servers, e.g. 6.0, answer a syntax error); a
    # server with XTRIM renamed away fails the same way. A failed trim must not leave
    # the log saying it was trimmed (replicas would be refused for entries still there),
    # and a server asked to trim such a log is refused at start in one line.
    require_tool("redis-server")
    from hybridgnn.updates.redis_log import RedisLog

    with RedisServer(tmp_path / "redis", extra_args=("--rename-command", "XTRIM", "")) as redis_server:
        url = redis_server.url("updates")
        log = RedisLog(url, GraphStore.open(tiny_dataset).fingerprint)
        for i in range(6):
            log.append(b"e%d" % i)
        with pytest.raises(ServiceUnavailable, match="needs Redis 6.2 or newer"):
            log.trim(3)
        assert log.first() == 1 and [e.position for e in log.read(0, 10)] == [1, 2, 3, 4, 5, 6]
        log.close()
        srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--update-token", TOKEN,
                            "--update-log", url, "--snapshot-dir", str(tmp_path / "snaps"),
                            "--update-log-retain", "2")
        assert srv.proc.wait(120) == 2
        out = srv.output()
        assert "needs Redis 6.2 or newer" in out and "Traceback" not in out, out


def test_a_running_replica_the_log_is_trimmed_past_reports_not_ready_and_refuses_updates(tiny_dataset, tiny_model_pe,
                                                                                          tmp_path):
    # Another replica's trim overtakes this one while it is paused (SIGSTOP stands in for a
    # long stall): once it runs again it can never apply the log, so it says so, leaves
    # the balancer's rotation and refuses updates at once instead of logging them.
    log_path = tmp_path / "updates.sqlite"
    srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--update-token", TOKEN, "--update-log",
                        str(log_path), "--snapshot-dir", str(tmp_path / "snaps"), "--log-level", "INFO").wait_ready()
    try:
        base = graph_state(srv.url)
        status, out = send_update(srv.url, TOKEN, "first", add_node_body(0, 1, base["feature_dim"]))
        assert status == 200, out
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            log = SqliteLog(log_path, GraphStore.open(tiny_dataset).fingerprint)
            for i in range(4):
                log.append(b"written by another replica %d" % i)
            assert log.trim(4) == 4 and log.first() == 5
            log.close()
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        poll_ready(srv.url, 503, 30)
        status, out = send_update(srv.url, TOKEN, "second", add_node_body(1, 2, base["feature_dim"]))
        assert status == 503 and "nothing of this update was logged" in out["error"], out
        assert graph_state(srv.url)["graph_version"] == 1
        assert "hybridgnn_update_follower_failing 1.0" in metrics_text(srv.url)
    finally:
        srv.stop()
    out = srv.output()
    assert "holds entries from position 5 on" in out and "Traceback" not in out, out


def _other_model(tiny_dataset, tiny_model_pe, out):
    """The tiny model with other weights (so another model fingerprint), precomputed."""
    import torch

    from hybridgnn.embeddings.precompute import precompute
    from hybridgnn.models.checkpoint import load_checkpoint, save_checkpoint

    model, _ = load_checkpoint(tiny_model_pe)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    graph = GraphStore.open(tiny_dataset)
    save_checkpoint(model, out, extra={"dataset_fingerprint": graph.fingerprint, "fanouts": [5, 3]})
    precompute(graph, load_checkpoint(out)[0], out, progress=False)
    return out


def test_a_model_with_other_weights_starts_on_a_trimmed_log_from_another_models_snapshot(tiny_dataset, tiny_model_pe,
                                                                                          tmp_path):
    # A new model has no snapshot of its own, and the log no longer reaches back to the
    # dataset: it starts from the graph of the other model's snapshot, computes its own
    # embeddings over it and replays the rest, serving what an offline precompute of the
    # final graph with its weights gives.
    from tests.support.replication import offline_rebuild, served_logits

    log_path, snaps = tmp_path / "updates.sqlite", tmp_path / "snaps"
    flags = ("--workers", "1", "--update-token", TOKEN, "--update-log", str(log_path), "--snapshot-dir", str(snaps),
             "--snapshot-every", "4", "--snapshot-keep", "1", "--update-log-retain", "2")
    srv = ServerProcess(tiny_dataset, tiny_model_pe, *flags).wait_ready()
    try:
        base = graph_state(srv.url)
        for k in range(11):
            status, out = send_update(srv.url, TOKEN, f"m{k}", add_node_body(k, 3 * k, base["feature_dim"]))
            assert status == 200, out
        trimmed_log(log_path, tiny_dataset).close()
    finally:
        assert srv.stop() == 0
    other = _other_model(tiny_dataset, tiny_model_pe, tmp_path / "other")
    srv = ServerProcess(tiny_dataset, other, *flags, "--log-level", "INFO")
    try:
        await_ready(srv, "server of the other model", 120)
        now = graph_state(srv.url)
        assert now["graph_version"] == 11 and now["num_nodes"] == base["num_nodes"] + 11
        alive, want = offline_rebuild(tiny_dataset, other, f"sqlite://{log_path}", tmp_path / "offline", snaps)
        np.testing.assert_allclose(served_logits(srv.url, alive), want, atol=1e-4)
    finally:
        assert srv.stop() == 0
    assert "starting from the graph of snapshot" in srv.output()
