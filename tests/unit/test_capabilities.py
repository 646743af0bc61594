"""What this machine and process can do, and the process-level helpers beside it."""

from __future__ import annotations


def test_a_private_run_dir_removes_the_ones_whose_process_is_gone(tmp_path, monkeypatch):
    # An engine killed with -9 never removed its socket directory: they gathered for ever.
    import os
    import tempfile

    from hybridgnn.capabilities import private_run_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = tmp_path / "hybridgnn-engine-99999999-abc"  # no such process (past any pid_max)
    alive = tmp_path / f"hybridgnn-engine-{os.getpid()}-def"
    other = tmp_path / "hybridgnn-ranks-99999999-ghi"  # another kind: its own sweep's
    for d in (gone, alive, other):
        d.mkdir()
        (d / "engine.sock").write_text("")
    made = private_run_dir("engine")
    assert os.path.basename(made).startswith(f"hybridgnn-engine-{os.getpid()}-")
    assert oct(os.stat(made).st_mode & 0o777) == "0o700"
    assert not gone.exists() and alive.exists() and other.exists()


def test_http_and_grpc_in_one_process_share_its_descriptors(monkeypatch, caplog):
    """Each listener lowered the cap to the whole room: HTTP and gRPC beside it could
    together hold twice the sockets the process may open."""
    import resource

    from hybridgnn.capabilities import connection_limit

    monkeypatch.setattr(resource, "getrlimit", lambda what: (4096 + 256, 8192))
    with caplog.at_level("INFO", logger="hybridgnn.serve"):
        assert connection_limit(10_000) == 4096
        assert connection_limit(10_000, 2) + connection_limit(10_000, 2, "gRPC's --max-connections") == 4096
        assert connection_limit(100, 2) == 100
        assert connection_limit(9_000) == 4096
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [  # the default's lowering: only said
        ("INFO", "--max-connections 10000 lowered to 4096: the process may open 4352 files"),
        ("INFO", "--max-connections 10000 lowered to 2048: the process may open 4352 files, shared by 2 listeners"),
        ("INFO", "gRPC's --max-connections 10000 lowered to 2048: the process may open 4352 files, shared by 2 "
                 "listeners"),
        ("WARNING", "--max-connections 9000 lowered to 4096: the process may open 4352 files")]
    monkeypatch.setattr(resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert connection_limit(10_000, 2) == 10_000


def test_exclusive_makes_a_second_holder_wait_and_runs_unlocked_where_nothing_can_be_written(tmp_path, monkeypatch,
                                                                                               caplog):
    import errno
    import os
    import threading
    import time

    from hybridgnn import capabilities
    from hybridgnn.capabilities import exclusive

    order = []

    def second():
        with exclusive(tmp_path / "x.lock", "waiting for the first"):
            order.append("second")

    with caplog.at_level("INFO", logger="hybridgnn"):
        with exclusive(tmp_path / "x.lock", "unused"):
            t = threading.Thread(target=second)
            t.start()
            deadline = time.monotonic() + 10
            while "waiting for the first" not in caplog.text:  # it tried, was refused, said so
                assert time.monotonic() < deadline
                time.sleep(0.01)  # poll interval, bounded by the deadline
            order.append("first")
        t.join(10)
    assert order == ["first", "second"]

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(capabilities.os, "open", read_only)
    with exclusive(tmp_path / "ro" / "y.lock", "unused"):
        order.append("unlocked")
    assert order[-1] == "unlocked"


def test_a_lock_file_this_user_may_not_write_still_makes_it_wait(tmp_path, monkeypatch, caplog):
    """Another user's server made the lock file (0644): this user, who may write the store
    (a group-writable repository), could not open it for writing and ran unlocked beside
    that user's writer."""
    import errno
    import os
    import threading
    import time

    from hybridgnn import capabilities
    from hybridgnn.capabilities import exclusive

    real_open, order = os.open, []

    def not_writable(path, flags, *args):
        if flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args)

    def other_user():
        with exclusive(tmp_path / "x.lock", "waiting for the first"):
            order.append("second")

    with caplog.at_level("INFO", logger="hybridgnn"), exclusive(tmp_path / "x.lock", "unused"):
        monkeypatch.setattr(capabilities.os, "open", not_writable)
        t = threading.Thread(target=other_user)
        t.start()
        deadline = time.monotonic() + 10
        while "waiting for the first" not in caplog.text and t.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)  # poll interval, bounded by the deadline
        order.append("first")
    t.join(10)
    assert order == ["first", "second"]
    with exclusive(tmp_path / "missing.lock", "unused"):  # none there and none can be made: unlocked
        order.append("unlocked")
    assert order[-1] == "unlocked" and not (tmp_path / "missing.lock").exists()


def test_a_file_written_over_a_link_replaces_the_link_not_its_target(tmp_path):
    """Decided: a link at the path is replaced by the new file and its target left as it was
    (another version's weights, a shared dataset's table); a linked directory is followed."""
    import os

    import numpy as np

    from hybridgnn.capabilities import save_array

    shared = tmp_path / "shared"
    shared.mkdir()
    np.save(shared / "psgs.npy", np.zeros(3))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "psgs.npy").symlink_to(shared / "psgs.npy")
    (tmp_path / "linked").symlink_to(shared, target_is_directory=True)
    save_array(mine / "psgs.npy", np.ones(3))
    assert not (mine / "psgs.npy").is_symlink() and np.load(mine / "psgs.npy").tolist() == [1, 1, 1]
    assert np.load(shared / "psgs.npy").tolist() == [0, 0, 0]
    save_array(tmp_path / "linked" / "fap.npy", np.ones(2))
    assert (shared / "fap.npy").is_file() and sorted(os.listdir(shared)) == ["fap.npy", "psgs.npy"]


def test_locked_elsewhere_sees_a_holder_and_takes_nothing(tmp_path):
    from hybridgnn.capabilities import exclusive, locked_elsewhere

    lock = tmp_path / ".store.lock"
    assert not locked_elsewhere(lock)  # absent: nobody holds it, and nothing is made
    assert not lock.exists()
    with exclusive(lock, "x") as waited:
        assert not waited and locked_elsewhere(lock)
    assert not locked_elsewhere(lock)
    with exclusive(lock, "x") as waited:  # the probe left no lock behind
        assert not waited
