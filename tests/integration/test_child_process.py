"""`python -m hybridgnn.cli.child`: the server's helper processes (a model repository's
precompute) run at a lower priority and end when the process that started them is gone,
even when it was killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.server import free_port, process_alive

ROOT = Path(__file__).resolve().parents[2]


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_a_child_runs_below_serving_and_ends_when_its_parent_is_killed(tiny_dataset, tiny_model):
    if not Path("/proc/self/stat").is_file():
        import pytest

        pytest.skip("reads /proc (Linux)")
    # A parent that starts a child running a long command (a server), says its pid, waits.
    starter = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-m', 'hybridgnn.cli.child', '7', "
               "str(os.getpid())] + sys.argv[1:]); print(p.pid, flush=True); p.wait()")
    parent = subprocess.Popen([sys.executable, "-c", starter, "serve", "--dataset", str(tiny_dataset), "--model",
                               str(tiny_model), "--port", str(free_port()), "--workers", "1",
                               "--worker-processes", "off"],
                              stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = None
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while _nice(child) != 7:  # set first thing in the child
            assert time.monotonic() < deadline, "the child's niceness was never set"
            time.sleep(0.05)  # poll interval
        parent.kill()  # -9: it stops nothing itself
        parent.wait(10)
        deadline = time.monotonic() + 30
        while process_alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)  # poll interval
    finally:
        parent.kill()
        parent.wait(10)
        if child is not None and process_alive(child):
            os.kill(child, 9)


def test_a_child_is_spared_the_process_group_s_hang_up_and_ctrl_c_and_ends_on_sigterm(tiny_dataset, tiny_model):
    """A terminal's hang-up or Ctrl-C reaches the whole process group: the server acts on
    them (a cache refresh; a drain that ends its children). The child died of them; a
    repository's precompute then failed and its version was listed unavailable."""
    if not Path("/proc/self/stat").is_file():
        import pytest

        pytest.skip("reads /proc (Linux)")
    child = subprocess.Popen([sys.executable, "-m", "hybridgnn.cli.child", "7", str(os.getpid()), "precompute",
                              "--dataset", str(tiny_dataset), "--model", str(tiny_model), "--help"],
                             stdout=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while _nice(child.pid) != 7:  # set after the signals are ignored
            assert time.monotonic() < deadline, "the child's niceness was never set"
            time.sleep(0.01)  # poll interval
        # pending together, they are taken lowest number first: HUP, INT, then TERM
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            os.kill(child.pid, sig)
        code = child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert code in (-signal.SIGTERM, 143), code


def test_the_child_entry_says_its_usage():
    out = subprocess.run([sys.executable, "-m", "hybridgnn.cli.child", "7"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 2 and "usage: python -m hybridgnn.cli.child NICE PARENT_PID" in out.stderr
