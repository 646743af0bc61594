"""Three replicas behind a real balancer under load: one drained (SIGTERM), one killed (-9)."""

from __future__ import annotations

import signal

import pytest

from tests.support.cluster_load import Cluster, drive
from tests.support.ops_tools import require_tool

pytestmark = [pytest.mark.ops, pytest.mark.slow]

CONCURRENCY = 6
TERM_AT_S, KILL_AT_S, DURATION_S = 2.0, 4.0, 7.0


@pytest.mark.parametrize("balancer", ["haproxy", "nginx"])
def test_drain_and_kill_under_load(balancer, tiny_dataset, tiny_model, tmp_path):
    require_tool(balancer)
    cluster = Cluster(tmp_path / "run", tiny_dataset, tiny_model, replicas=3, balancer=balancer,
                      serve_args=("--drain-timeout-s", "20")).wait_ready()
    try:
        outcomes = drive(cluster.url + "/v2/models/hybridgnn/infer", concurrency=CONCURRENCY,
                         duration_s=DURATION_S, num_nodes=3000,
                         actions=[(TERM_AT_S, lambda: cluster.signal_replica(0, signal.SIGTERM)),
                                  (KILL_AT_S, lambda: cluster.signal_replica(1, signal.SIGKILL))])
        assert cluster.replica_exit(0) == 0, "a drained replica exits 0"
        assert cluster.replica_exit(1) == -signal.SIGKILL
    finally:
        launcher_rc = cluster.stop()
    # A 429 (with Retry-After) is admission refusing a burst on two shared cores, an answer
    # rather than a failure; it stays rare, so it cannot hide the drain's own failures.
    refused = [o for o in outcomes if o.status == 429]
    assert len(refused) <= 0.05 * len(outcomes), f"{len(refused)} of {len(outcomes)} refused"
    failed = [o for o in outcomes if o.status not in (200, 429)]
    before_kill = [o for o in failed if o.end_s < KILL_AT_S]
    # The drain costs clients nothing: the balancer routes around the replica (ready=503)
    # and retries anything it refused.
    assert not before_kill, f"failures around the drain: {before_kill[:5]}"
    # Only requests in flight on the killed replica may fail, so at most one per client.
    assert len(failed) <= CONCURRENCY, f"{len(failed)} failures: {failed[:5]}"
    # Load goes on on the last replica.
    after = [o for o in outcomes if o.start_s > KILL_AT_S + 0.5]
    assert sum(o.status == 200 for o in after) >= 20 and all(o.status in (200, 429) for o in after)
    assert sum(o.start_s < TERM_AT_S for o in outcomes) >= 20, "too little load before the drain to mean anything"
    assert launcher_rc == 0


def test_a_killed_replica_is_started_again_and_served_through_the_balancer(tiny_dataset, tiny_model, tmp_path):
    import time
    import urllib.request

    from hybridgnn.deploy.cluster import http_ready

    require_tool("haproxy")
    cluster = Cluster(tmp_path / "run", tiny_dataset, tiny_model, replicas=2, balancer="haproxy").wait_ready()
    try:
        first = cluster.replica_pid(0)
        cluster.signal_replica(0, signal.SIGKILL)
        assert cluster.replica_exit(0) == -signal.SIGKILL
        deadline = time.monotonic() + 120
        while not (cluster.replica_pid(0) != first and http_ready(f"http://{cluster.backends[0]}")):
            assert time.monotonic() < deadline, f"replica 0 not back:\n{cluster.launcher_log()[-3000:]}"
            time.sleep(0.2)  # poll interval; bounded by the deadline
        assert "started again" in cluster.launcher_log()
        body = b'{"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [7]}]}'
        for _ in range(6):  # round robin reaches the restarted replica too
            req = urllib.request.Request(cluster.url + "/v2/models/hybridgnn/infer", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
    finally:
        assert cluster.stop() == 0
