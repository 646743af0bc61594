"""hybridgnn cluster: --worker-cpus split among the replicas (no processes started)."""

import pytest

from hybridgnn.deploy.cluster import ClusterConfig


def test_worker_cpus_are_split_into_one_share_per_replica():
    cfg = ClusterConfig(replicas=3, serve_args=("--dataset", "d", "--worker-cpus", "2-9", "--model", "m"))
    assert cfg.worker_cpus_split() == [(2, 3), (4, 5, 6), (7, 8, 9)]
    assert cfg.replica_serve_args(0) == ("--dataset", "d", "--worker-cpus", "2,3", "--model", "m")
    assert cfg.replica_serve_args(2) == ("--dataset", "d", "--worker-cpus", "7,8,9", "--model", "m")
    # each replica runs on its own workers' share and on the cores no replica's workers use
    allowed = set(range(12))
    assert cfg.replica_cores(1, allowed) == {0, 1, 10, 11, 4, 5, 6}
    assert all(not (cfg.replica_cores(i, allowed) & set(cfg.worker_cpus_split()[j]))
               for i in range(3) for j in range(3) if i != j)


def test_the_equals_form_and_no_flag():
    cfg = ClusterConfig(replicas=2, serve_args=("--worker-cpus=0,4-6",))
    assert cfg.replica_serve_args(0) == ("--worker-cpus=0,4",)
    assert cfg.replica_serve_args(1) == ("--worker-cpus=5,6",)
    plain = ClusterConfig(replicas=2, serve_args=("--max-wait-ms", "2"))
    assert plain.worker_cpus_split() is None and plain.replica_cores(0, {0, 1}) is None
    assert plain.replica_serve_args(1) == ("--max-wait-ms", "2")


@pytest.mark.parametrize("args, message", [
    (("--worker-cpus", "1"), "gives 1 core\\(s\\) for 2 replicas"),
    (("--worker-cpus", "a-b"), "cores must be numbers"),
    (("--worker-cpus",), "needs a value"),
])
def test_a_split_that_cannot_be_made_is_refused_in_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(replicas=2, serve_args=args)
