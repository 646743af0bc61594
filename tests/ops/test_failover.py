"""Three replicas behind a real balancer under load: one drained (SIGTERM), one killed (-9)."""

from __future__ import annotations

import signal

import pytest

from hybridgnn.testing.cluster_load import Cluster, drive
from hybridgnn.testing.ops_tools import require_tool

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
    failed = [o for o in outcomes if o.status != 200]
    before_kill = [o for o in failed if o.end_s < KILL_AT_S]
    # The drain costs clients nothing: the balancer routes around the replica (ready=503)
    # and retries anything it refused.
    assert not before_kill, f"failures around the drain: {before_kill[:5]}"
    # Only requests in flight on the killed replica may fail, so at most one per client.
    assert len(failed) <= CONCURRENCY, f"{len(failed)} failures: {failed[:5]}"
    # Load goes on on the last replica.
    after = [o for o in outcomes if o.start_s > KILL_AT_S + 0.5]
    assert len(after) >= 20 and all(o.status == 200 for o in after)
    assert sum(o.start_s < TERM_AT_S for o in outcomes) >= 20, "too little load before the drain to mean anything"
    assert launcher_rc == 0
