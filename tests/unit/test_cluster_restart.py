"""The local cluster supervisor's restart decisions (no processes: a fake replica)."""

import pytest

from hybridgnn.deploy.cluster import (
    RESTART_BACKOFF_MAX_S,
    STABLE_UPTIME_S,
    ClusterConfig,
    LocalCluster,
    last_line,
    restart_delay,
)


def test_backoff_doubles_per_crash_up_to_the_cap_and_resets_after_a_stable_run():
    delays, last = [], None
    for _ in range(8):
        last = restart_delay(last, uptime_s=2.0, base_s=1.0)
        delays.append(last)
    assert delays[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0] and max(delays) == RESTART_BACKOFF_MAX_S
    assert restart_delay(30.0, uptime_s=STABLE_UPTIME_S + 1, base_s=1.0) == 1.0


class FakeProc:
    def __init__(self, pid, code=None):
        self.pid, self.returncode = pid, code

    def poll(self):
        return self.returncode


def test_a_dead_replica_is_started_again_once_its_backoff_has_passed(tmp_path, monkeypatch):
    cluster = LocalCluster(ClusterConfig(replicas=2, run_dir=tmp_path, restart_backoff_s=1.0))
    cluster.replicas = [FakeProc(10), FakeProc(11, code=-9)]
    cluster.restarts = [0, 0]
    cluster._started_at = {0: 0.0, 1: 0.0}
    spawned = []
    monkeypatch.setattr(cluster, "_spawn", lambda i: spawned.append(i) or FakeProc(100 + i))
    cluster.restart_dead(now=5.0)  # schedules replica 1 for 6.0
    assert spawned == []
    cluster.restart_dead(now=5.5)
    assert spawned == []
    cluster.restart_dead(now=6.0)
    assert spawned == [1] and cluster.replicas[1].pid == 101 and cluster.restarts == [0, 1]
    cluster.restart_dead(now=7.0)  # running again: nothing to do
    assert spawned == [1]


def test_no_restart_leaves_it_down(tmp_path):
    cluster = LocalCluster(ClusterConfig(replicas=1, run_dir=tmp_path, restart=False))
    cluster.replicas, cluster.restarts = [FakeProc(10, code=1)], [0]
    cluster.restart_dead(now=100.0)
    assert cluster.replicas[0].pid == 10


def test_backoff_must_be_positive():
    with pytest.raises(ValueError, match="restart_backoff_s"):
        ClusterConfig(restart_backoff_s=0)


def test_a_stop_while_replicas_start_ends_the_wait_at_once_and_exits_0(tmp_path, monkeypatch):
    import time

    cluster = LocalCluster(ClusterConfig(replicas=1, run_dir=tmp_path, ready_timeout_s=300))
    monkeypatch.setattr("hybridgnn.deploy.cluster.http_ready", lambda url: False)  # never ready
    stopped = []
    monkeypatch.setattr(cluster, "stop", lambda: stopped.append(True))

    def start():
        cluster.replicas.append(FakeProc(11))
        cluster.stop_requested = True  # as the SIGTERM handler does, while the replicas start
        cluster._wait_replicas_ready()

    monkeypatch.setattr(cluster, "start", start)
    t0 = time.monotonic()
    assert cluster.run_until_signal() == 0
    assert time.monotonic() - t0 < 5 and stopped == [True]


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan")])
def test_a_ready_timeout_that_is_not_positive_is_refused_before_anything_starts(timeout_s):
    with pytest.raises(ValueError, match="ready_timeout_s must be > 0"):
        ClusterConfig(ready_timeout_s=timeout_s)


def test_the_wait_for_replicas_says_each_as_it_becomes_ready(tmp_path, monkeypatch, caplog):
    """It was silent for as long as the replicas took to load (16 s for the demo)."""
    import logging

    cluster = LocalCluster(ClusterConfig(replicas=2, run_dir=tmp_path, ready_timeout_s=30))
    cluster.replicas = [FakeProc(11), FakeProc(12)]
    polls = {"n": 0}

    def ready(url):
        polls["n"] += 1
        return polls["n"] > 2 or url.endswith(str(cluster.cfg.base_port))

    monkeypatch.setattr("hybridgnn.deploy.cluster.http_ready", ready)
    with caplog.at_level(logging.INFO, logger="hybridgnn"):
        cluster._wait_replicas_ready()
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("starting 2 replicas (their logs: ")
    assert said[1].startswith("replica 0 ready on ") and said[1].endswith("; 1 of 2)")
    assert said[2].startswith("replica 1 ready on ") and said[2].endswith("; 2 of 2)")


def test_a_replica_that_exits_while_starting_is_reported_with_what_it_said(tmp_path, monkeypatch):
    """It was "replica 0 exited with 2 while starting; see run/cluster/replica-0.log": the
    replica's one-line refusal (a mistyped --dataset, say) was only in that file."""
    cluster = LocalCluster(ClusterConfig(replicas=1, run_dir=tmp_path, ready_timeout_s=30))
    cluster.replicas = [FakeProc(11, code=2)]
    (tmp_path / "replica-0.log").write_text("an older run's line\n2026 INFO starting\n"
                                             "hybridgnn serve: error: dataset directory data/nope does not exist\n\n")
    monkeypatch.setattr("hybridgnn.deploy.cluster.http_ready", lambda url: False)
    with pytest.raises(RuntimeError) as info:
        cluster._wait_replicas_ready()
    assert str(info.value) == ("replica 0 exited with 2 while starting: hybridgnn serve: error: dataset directory "
                               f"data/nope does not exist (its log: {tmp_path / 'replica-0.log'})")
    assert last_line(tmp_path / "nothing.log") == "" and last_line(tmp_path / "replica-0.log", limit=10).endswith("exist")


def test_serve_flags_before_the_separator_are_refused_saying_where_they_go(capsys):
    """`hybridgnn cluster --replicas 2 --dataset D --model M` said only "unrecognized
    arguments: --dataset D --model M"."""
    from hybridgnn.cli.main import main

    with pytest.raises(SystemExit):
        main(["cluster", "--replicas", "2", "--dataset", "d", "--model", "m"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("hybridgnn cluster: error: unrecognized arguments: --dataset")
    assert err.endswith(" (flags for the replicas' `hybridgnn serve` go after `--`: hybridgnn cluster ... -- --dataset D "
                        "--model M)")


class _Started(Exception):
    """Raised by the stand-in LocalCluster: the configuration it was given is in .cfg."""

    def __init__(self, cfg):
        self.cfg = cfg


def _cluster(monkeypatch, argv):
    """Run `hybridgnn cluster argv` until it would start replicas: (the demo cache dirs
    ensure_demo was called with, the ClusterConfig, or the exit code)."""
    import hybridgnn.demo
    import hybridgnn.deploy.cluster
    from hybridgnn.cli.main import main

    demos = []
    monkeypatch.setattr(hybridgnn.demo, "ensure_demo", lambda cache_dir=None: demos.append(cache_dir) or (
        "demo/dataset", "demo/model"))

    def started(cfg):
        raise _Started(cfg)

    monkeypatch.setattr(hybridgnn.deploy.cluster, "LocalCluster", started)
    try:
        return demos, main(["cluster", *argv])
    except _Started as s:
        return demos, s.cfg


def test_the_cluster_checks_its_flags_before_making_the_demo(monkeypatch, capsys):
    """--replicas 0 or a port out of range was refused only after the demo was made (a
    first run: 30-60 s of generating and training)."""
    monkeypatch.delenv("HYBRIDGNN_DATASET", raising=False)
    for argv in (["--replicas", "0"], ["--port", "0"]):
        demos, code = _cluster(monkeypatch, argv)
        assert (demos, code) == ([], 2)
        assert capsys.readouterr().err.startswith("hybridgnn cluster: error: ")


def test_the_replicas_demo_is_made_where_their_flags_and_variables_say(monkeypatch, tmp_path):
    """cli.md: flags after `--` go to every replica, and every serve flag may be a
    HYBRIDGNN_<FLAG> variable. `-- --cache-dir X` made the demo in the default cache and
    gave the replicas that, and HYBRIDGNN_DATASET/HYBRIDGNN_MODEL were overridden by the
    demo's --dataset/--model."""
    for name in ("HYBRIDGNN_DATASET", "HYBRIDGNN_MODEL", "HYBRIDGNN_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    demos, cfg = _cluster(monkeypatch, ["--", "--cache-dir", str(tmp_path), "--workers", "1"])
    assert demos == [tmp_path]
    assert cfg.serve_args == ("--cache-dir", str(tmp_path), "--workers", "1", "--dataset", "demo/dataset",
                              "--model", "demo/model")
    monkeypatch.setenv("HYBRIDGNN_DATASET", str(tmp_path / "g"))
    monkeypatch.setenv("HYBRIDGNN_MODEL", str(tmp_path / "m"))
    demos, cfg = _cluster(monkeypatch, ["--replicas", "2"])
    assert demos == [] and cfg.serve_args == ()
    monkeypatch.delenv("HYBRIDGNN_DATASET")
    demos, cfg = _cluster(monkeypatch, ["--", "--dataset=d", "--model=m"])
    assert demos == [] and cfg.serve_args == ("--dataset=d", "--model=m")
    # HYBRIDGNN_WORKER_CPUS is split over the replicas as the flag is (each had all the cores)
    monkeypatch.setenv("HYBRIDGNN_WORKER_CPUS", "0-3")
    demos, cfg = _cluster(monkeypatch, ["--replicas", "2", "--", "--dataset=d", "--model=m"])
    assert cfg.serve_args == ("--dataset=d", "--model=m", "--worker-cpus", "0-3")
    assert [cfg.replica_serve_args(i)[-1] for i in range(2)] == ["0,1", "2,3"]
    demos, code = _cluster(monkeypatch, ["--replicas", "5", "--", "--dataset=d", "--model=m"])
    assert code == 2
