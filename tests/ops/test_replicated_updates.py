"""Replicas sharing one update log (a Redis stream, or a SQLite file on one machine) behind HAProxy: updates through the balancer, reads
that carry min_graph_version reflect their own writes, a replica killed with -9 and one
started late catch up (from a snapshot and the log), a retried keyed update applies once,
and at the end every replica serves byte-identical embeddings that match an offline
precompute of the final graph."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from tests.support.cluster_load import Cluster
from tests.support.durability import (
    MODEL,
    add_node_body,
    get_json,
    post_json,
    send_update,
)
from tests.support.ops_tools import require_tool
from tests.support.replication import (
    RedisServer,
    offline_rebuild,
    served_logits,
    wait_for_version,
)
from tests.support.server import ServerProcess, await_ready, metrics_text

pytestmark = [pytest.mark.ops, pytest.mark.slow]

TOKEN = "replicated-token-1"
UPDATES, KILL_AT = 200, 80


def _with_retries(call, attempts: int = 4) -> tuple[int, dict]:
    """What a client does around a replica killed mid-request: retry (updates carry an
    Idempotency-Key, so a retry applies at most once)."""
    for _ in range(attempts):
        status, out = call()
        if status not in (502, 503, 504):
            break
    return status, out


def _read_own_write(url: str, node: int, version: int) -> tuple[int, dict]:
    return _with_retries(lambda: post_json(url, f"/v2/models/{MODEL}/infer", {
        "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [node]}],
        "parameters": {"mode": "precomputed", "min_graph_version": version}}))


@pytest.mark.parametrize("log_kind", ["redis", "sqlite"])
def test_replicas_on_one_log_agree_and_read_their_writes(log_kind, tiny_dataset, tiny_model_pe, tmp_path):
    """Redis: replicas on several machines; SQLite: replicas on one machine sharing a file."""
    require_tool("haproxy")
    require_tool("redis-server")
    with RedisServer(tmp_path / "redis") as redis:
        log_url = redis.url("hybridgnn-updates") if log_kind == "redis" else f"sqlite://{tmp_path / 'updates.sqlite'}"
        serve = ("--update-token", TOKEN, "--update-log", log_url,
                 "--snapshot-dir", str(tmp_path / "snapshots"), "--snapshot-every", "50")
        cluster = Cluster(tmp_path / "run", tiny_dataset, tiny_model_pe, replicas=3, balancer="haproxy",
                          serve_args=serve).wait_ready()
        late = None
        try:
            base = get_json(cluster.url, f"/v2/models/{MODEL}")[1]["parameters"]
            n0, dim = int(base["num_nodes"]), int(base["feature_dim"])
            new_ids, versions = [], []
            for k in range(UPDATES):
                if k == KILL_AT:
                    cluster.signal_replica(1, signal.SIGKILL)  # the launcher starts it again; it catches up
                status, out = _with_retries(lambda k=k: send_update(cluster.url, TOKEN, f"u-{k}",
                                                                     add_node_body(k, k % n0, dim)))
                assert status == 200, (k, out)
                [node] = out["new_node_ids"]
                new_ids.append(node)
                versions.append(out["graph_version"])
                status, read = _read_own_write(cluster.url, node, out["graph_version"])
                assert status == 200, (k, read)  # whichever replica answered has the write
            assert sorted(new_ids) == list(range(n0, n0 + UPDATES))  # one order: no id given twice
            assert versions == sorted(versions)

            # A retry of an acknowledged update (same key, same body), through the balancer:
            # answered again, applied nowhere again.
            status, again = send_update(cluster.url, TOKEN, "u-7", add_node_body(7, 7 % n0, dim))
            assert status == 200 and again["replayed"] and again["new_node_ids"] == [new_ids[7]]

            head = max(versions)
            late = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", *serve)
            await_ready(late, "late replica", 120)
            urls = [f"http://{b}" for b in cluster.backends] + [late.url]
            params = [wait_for_version(u, head) for u in urls]
            assert params[-1]["snapshot"] is not None, "the late replica starts from a snapshot"
            assert all(p["num_nodes"] == n0 + UPDATES for p in params), [p["num_nodes"] for p in params]

            nodes = np.arange(n0 + UPDATES)
            served = [served_logits(u, nodes) for u in urls]
            for other in served[1:]:
                assert np.array_equal(other, served[0])  # byte-identical on every replica
            alive, offline = offline_rebuild(tiny_dataset, tiny_model_pe, log_url, tmp_path / "offline")
            assert np.array_equal(alive, nodes)
            np.testing.assert_allclose(served[0], offline, rtol=1e-4, atol=1e-4)
        finally:
            if late is not None:
                late.stop()
            cluster.stop()


def test_an_unreachable_redis_log_is_a_503_and_updates_resume_when_it_is_back(tiny_dataset, tiny_model_pe, tmp_path):
    require_tool("redis-server")
    redis = RedisServer(tmp_path / "redis").start()
    srv = None
    try:
        srv = ServerProcess(tiny_dataset, tiny_model_pe, "--workers", "1", "--update-token", TOKEN,
                            "--update-log", redis.url("outage"), "--snapshot-every", "0").wait_ready()
        n0 = int(get_json(srv.url, f"/v2/models/{MODEL}")[1]["parameters"]["num_nodes"])
        status, first = send_update(srv.url, TOKEN, "o-1", add_node_body(1, 5, 16))
        assert status == 200 and first["graph_version"] == 1
        redis.stop()
        status, out = send_update(srv.url, TOKEN, "o-2", add_node_body(2, 5, 16))
        assert status == 503 and "unreachable" in out["error"], out
        # Reads go on from what this replica has; the follower reports it cannot read the log.
        assert post_json(srv.url, f"/v2/models/{MODEL}/infer", {
            "inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [n0]}],
            "parameters": {"mode": "precomputed"}})[0] == 200
        deadline = time.monotonic() + 30
        while "hybridgnn_update_follower_failing 1.0" not in metrics_text(srv.url):
            assert time.monotonic() < deadline, "the follower never reported the outage"
            time.sleep(0.05)  # poll interval; bounded by the deadline
        redis.start()  # the same data directory: the append-only file brings the stream back
        deadline = time.monotonic() + 30
        while True:
            status, out = send_update(srv.url, TOKEN, "o-2", add_node_body(2, 5, 16))
            if status == 200:
                break
            assert status == 503 and time.monotonic() < deadline, out
            time.sleep(0.05)  # poll interval; bounded by the deadline
        assert out["new_node_ids"] == [n0 + 1] and out["graph_version"] == 2
    finally:
        if srv is not None:
            srv.stop()
        redis.stop()
