"""Front-end processes of a `hybridgnn serve --frontends N` server, found from /proc: their
pids, and which one holds the server end of a client's connection."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


def frontend_pids(parent: int) -> dict[int, int]:
    """{front-end index: pid} of the server process `parent`'s live front ends."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"hybridgnn.serving.frontend" in cmd and b"--index" in cmd and stat.rsplit(
                ")", 1)[1].split()[0] != "Z":
            found[int(cmd[cmd.index(b"--index") + 1])] = int(entry.name)
    return found


def wait_for_frontends(parent: int, count: int, timeout_s: float = 60.0, exclude: set[int] = frozenset()) -> dict:
    """frontend_pids(parent) once it lists `count` live ones none of which is in `exclude`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = frontend_pids(parent)
        if len(pids) == count and not set(pids.values()) & set(exclude):
            return pids
        time.sleep(0.05)  # poll interval, bounded by the deadline
    raise TimeoutError(f"{count} front ends of pid {parent} not up within {timeout_s}s: {frontend_pids(parent)}")


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def frontend_of(sock: socket.socket, pids: dict[int, int]) -> int | None:
    """The index of the front end holding the server end of the client connection `sock`."""
    client_port = sock.getsockname()[1]
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == client_port:  # its remote end is our socket
            inode = int(fields[9])
            break
    if inode is None:
        return None
    for index, pid in pids.items():
        if inode in _socket_inodes(pid):
            return index
    return None


def connection_to(port: int, index: int, pids: dict[int, int], timeout_s: float = 60.0) -> socket.socket:
    """A connected socket to 127.0.0.1:port that front end `index` accepted (connections
    are spread by the kernel: open some until one lands there, for up to timeout_s; a
    front end just started again takes seconds to listen on a loaded machine, and a
    count of tries ran out before it did)."""
    deadline_all = time.monotonic() + timeout_s
    tries = 0
    while time.monotonic() < deadline_all:
        tries += 1
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        deadline = time.monotonic() + 2.0
        owner = None
        while owner is None and time.monotonic() < deadline:  # accepted a moment after connect
            owner = frontend_of(s, pids)
            if owner is None:
                time.sleep(0.01)  # poll interval, bounded by the deadline
        if owner == index:
            return s
        s.close()
        time.sleep(0.01)  # poll interval, bounded by the deadline (each try leaves a port in TIME_WAIT)
    raise RuntimeError(f"no connection landed on front end {index} in {tries} tries over {timeout_s:g} s")
