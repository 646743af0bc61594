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
