"""The launcher's reading of failed ranks, and the driver's per-layer line and report."""

import os
import signal

from hybridgnn.distributed.driver import DistributedConfig, _layer_line, _summary
from hybridgnn.distributed.launch import _culprit, _why
from hybridgnn.errors import ConfigError
from hybridgnn.runtime.ranks import PEER_LOST, rank_environment


def test_the_culprit_is_a_killed_rank_then_one_with_its_own_error(tmp_path):
    errors = [tmp_path / f"rank-{r}.txt" for r in range(3)]
    errors[0].write_text(PEER_LOST + "Connection closed by peer")
    errors[2].write_text("model expects 7-dim features")
    assert _culprit([(0, 1), (1, -signal.SIGKILL), (2, 1)], errors) == (1, -signal.SIGKILL)
    assert _culprit([(0, 1), (2, 1)], errors) == (2, 1)
    assert _culprit([(0, 1)], errors) == (0, 1)


def test_a_rank_the_others_lost_while_it_still_runs_is_the_culprit(tmp_path):
    """Ranks 0 and 2 timed out waiting for rank 1, which never failed: rank 1 hangs (the
    line named rank 0, as if its timeout were its own fault)."""
    errors = [tmp_path / f"rank-{r}.txt" for r in range(3)]
    errors[0].write_text(PEER_LOST + "Timed out waiting 5000ms for send operation to complete")
    errors[2].write_text(PEER_LOST + "Connection closed by peer")
    assert _culprit([(0, 1), (2, 1)], errors, [1]) == (1, None)
    assert _why(None, errors[1]).startswith("stopped answering")
    errors[2].write_text("model expects 7-dim features")  # a rank's own error still comes first
    assert _culprit([(0, 1), (2, 2)], errors, [1]) == (2, 2)


class FakeStore:
    port, key = 29500, "k"

    def close(self):
        pass


def test_why_names_the_signal_or_the_error(tmp_path):
    said = tmp_path / "r.txt"
    assert _why(-signal.SIGKILL, said) == "was killed by SIGKILL"
    said.write_text("out of memory\n")
    assert _why(1, said) == "exited with code 1: out of memory"


def test_each_rank_gets_its_rendezvous_and_thread_count(tmp_path):
    env = rank_environment(2, 4, 29500, 3, tmp_path / "e")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == \
        ("2", "4", "2", "29500", "3")


def test_distributed_config_refuses_nonsense():
    for bad in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"chunk_bytes": 0}):
        try:
            DistributedConfig(**bad)
        except ConfigError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_the_report_compares_bytes_with_sending_every_row_everywhere(tmp_path):
    class Graph:
        num_nodes, num_edges, feature_dim = 100, 1000, 8

    per_rank = [{"layer": 1, "seconds": 2.0, "comm_wait_s": 0.5, "bytes_sent": 3_000_000, "rows": 10, "chunks": 1},
                {"layer": 1, "seconds": 1.0, "comm_wait_s": 0.1, "bytes_sent": 1_000_000, "rows": 5, "chunks": 1}]
    assert _layer_line(per_rank) == "layer 1: 2.00 s, halo wait up to 0.50 s, sent 4.0 MB (per rank: 3.0, 1.0 MB)"
    report = _summary(tmp_path, Graph(), [4], {"precompute_s": 3.0, "computed_unix_s": 1.0}, "ranges", 2, 250,
                      [per_rank])
    assert report["edge_cut"] == {"edges": 250, "fraction": 0.25}
    assert report["layers"][0]["naive_bytes"] == 1 * 100 * 8 * 4
    assert report["layers"][0]["compute_s"] == [1.5, 0.9]


def test_a_rank_that_cannot_be_started_stops_those_that_were_in_one_line(monkeypatch, capsys):
    """Out of processes or memory at rank 2 of 4: ranks 0 and 1 are stopped and one line
    says so (it was a traceback, and ranks 0 and 1 waited for the others until --timeout-s)."""
    from hybridgnn.distributed import launch as launch_mod

    started = []

    class Rank:
        def __init__(self, *_args, **_kwargs):
            if len(started) == 2:
                raise OSError(11, "Resource temporarily unavailable")
            self.code = None
            started.append(self)

        def poll(self):
            return self.code

        def kill(self):
            self.code = -signal.SIGKILL

        terminate = kill

        def wait(self, _timeout=None):
            return self.code

    monkeypatch.setattr(launch_mod.subprocess, "Popen", Rank)
    monkeypatch.setattr(launch_mod, "HostedStore", FakeStore)
    assert launch_mod.launch(["precompute"], 4, 1) == 1
    assert len(started) == 2 and all(r.code is not None for r in started)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not start rank 2 of 4: [Errno 11] Resource temporarily unavailable" in err[0]


def test_the_launchers_run_directory_is_removed_and_one_a_killed_launcher_left_is_swept(monkeypatch, tmp_path):
    """A launcher killed with -9 left its directory in the temporary directory for ever."""
    import tempfile

    from hybridgnn.distributed import launch as launch_mod

    class Rank:
        def __init__(self, *_args, **_kwargs):
            raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    left = tmp_path / "hybridgnn-launch-99999999-abc"  # its process is gone (past any pid_max)
    left.mkdir()
    (left / "rank-0.txt").write_text("")
    monkeypatch.setattr(launch_mod.subprocess, "Popen", Rank)
    monkeypatch.setattr(launch_mod, "HostedStore", FakeStore)
    assert launch_mod.launch(["precompute"], 2, 1) == 1
    assert list(tmp_path.iterdir()) == []


def _joining(monkeypatch, tmp_path, starter: int, fails: int):
    """join_group of a rank of a HostedStore's starter `starter`, whose first `fails`
    connections fail: (the timeouts tried, what init_process_group got)."""
    import torch.distributed as dist

    from hybridgnn.runtime import ranks

    tries, joined = [], {}

    class Store:
        def __init__(self, host, port, world, is_master, timeout):
            tries.append(timeout.total_seconds())
            if len(tries) <= fails:
                raise dist.DistNetworkError("The client socket has timed out")

        def set_timeout(self, timeout):
            joined["timeout"] = timeout.total_seconds()

    env = rank_environment(1, 2, 29500, 1, tmp_path / "e", store_key="abc")
    env[ranks.HOSTED_STORE_ENV] = env[ranks.HOSTED_STORE_ENV].replace(str(os.getpid()), str(starter), 1)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "TCPStore", Store)
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, store, **kw: joined.update(store=store))
    return tries, joined, ranks


def test_a_rank_whose_starter_is_gone_stops_trying_its_store_at_once(monkeypatch, tmp_path):
    """A server killed with -9 as its ranks started took its store with it; the ranks tried
    the port for torch's whole retry (about twice the 60 s timeout, minutes seen), outliving
    the server, and could meet another server's store there if the port was given out again."""
    from datetime import timedelta

    import pytest

    tries, joined, ranks = _joining(monkeypatch, tmp_path, starter=os.getppid() + 1, fails=99)
    with pytest.raises(RuntimeError, match="started this rank is gone"):
        ranks.join_group("gloo", 1, 2, timedelta(seconds=60))
    assert len(tries) == 1 and tries[0] <= ranks.CONNECT_ATTEMPT_S and not joined


def test_a_rank_tries_its_starters_store_until_it_answers_and_meets_under_its_key(monkeypatch, tmp_path):
    from datetime import timedelta

    tries, joined, ranks = _joining(monkeypatch, tmp_path, starter=os.getppid(), fails=2)
    ranks.join_group("gloo", 1, 2, timedelta(seconds=60))
    assert len(tries) == 3 and joined["timeout"] == 60 and joined["store"][0] == "hybridgnn/hosted/abc"
