"""Where a command writes its output (--out): checked before the command's work, so a path
that cannot take it is refused in one line at once rather than after minutes of work, and
(staged_directory) made beside its place and moved in whole.

A path problem is raised as the OSError the write would have met (a file where a directory
is wanted, a directory where a file is, a directory that cannot be written), which
cli/main.py prints as "cannot use <path>: <reason>"; an output the command will not
replace is a ConfigError."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridgnn.capabilities import pid_alive
from hybridgnn.errors import ConfigError


def _refuse(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _check_writable_dir(path: Path) -> None:
    if not path.is_dir():
        raise _refuse(errno.ENOTDIR, path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise _refuse(errno.EACCES, path)


def _nearest_existing(path: Path) -> Path:
    """path, or the closest folder above it that exists (where a mkdir -p starts). Under a
    file nothing exists: the walk stops at that file."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_out(path: Path, *, directory: bool, staged: bool = False, force: bool | None = None,
              replaceable: Callable[[Path], bool] | None = None, what: str = "") -> None:
    """Refuse now an output path the command could not write at its end.

    directory: the output is a directory, else one file (the folders above either are made
    when missing). staged: the directory is made beside the target and moved in whole
    (staged_directory), so the folder holding it must take a new entry; otherwise an
    existing directory is written into. force: the command's --force, None where it has
    none; False refuses an existing, non-empty directory. replaceable: for a command that
    replaces its output without --force, whether an existing, non-empty directory is one
    it made (anything else there is refused, never removed); what names such an output in
    the refusal."""
    path = Path(path)
    if staged:  # made beside where a link at path points (staged_directory)
        _check_stageable(path)
        path = Path(os.path.realpath(path))
    if path.exists():
        if directory and not path.is_dir():
            raise _refuse(errno.ENOTDIR, path)
        if not directory and path.is_dir():
            raise _refuse(errno.EISDIR, path)
        if directory:
            _check_writable_dir(path)  # written into, or emptied when replaced
            if any(path.iterdir()):
                if force is False:
                    raise ConfigError(f"{path} already exists; pass --force to replace it")
                if replaceable is not None and not replaceable(path):
                    raise ConfigError(f"{path} holds files other than {what}: give a new or empty directory")
            if not staged:
                return
    _check_writable_dir(_nearest_existing(path.parent))


def _check_stageable(path: Path) -> None:
    """A staged output replaces its directory whole, by renames beside it: never the
    directory the command runs in, or one holding it (--out . generated the dataset, then
    read `.`, the removed directory the process still stood in, and failed; the shell was
    left in a removed directory too), nor a mount point, which cannot be renamed (a volume
    mounted at --out: the whole output was made beside it, on the filesystem above, then
    failed with "Device or resource busy")."""
    real, cwd = Path(os.path.realpath(path)), Path(os.getcwd())
    if real == cwd or real in cwd.parents:
        raise ConfigError(f"--out {path} is the directory this command runs in, or holds it: the output replaces it "
                          "whole; name it from outside (from its parent, say)")
    if real.is_dir() and _mount_point(real):
        raise ConfigError(f"--out {path} is a mount point, which the output cannot replace (it is made beside it "
                          f"and moved in whole): name a directory inside it, such as {path}/<name>")


MOUNTINFO = "/proc/self/mountinfo"


def _mount_point(path: Path) -> bool:
    """Whether path (resolved) is a mount point: os.path.ismount, or listed in
    /proc/self/mountinfo (a bind mount within one filesystem, which ismount misses)."""
    import re

    if os.path.ismount(path):
        return True
    try:
        with open(MOUNTINFO) as f:
            points = [line.split()[4] for line in f if len(line.split()) > 4]
    except OSError:
        return False
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040 ..)
    return str(path) in {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points}


@contextmanager
def staged_directory(out: Path, action: str) -> Iterator[Path]:
    """A hidden sibling of `out` to write the output into (.<name>.<action>-<pid>), moved to
    `out` once the block ends without an error: a failed or interrupted run (an error, a
    full disk, Ctrl-C, a kill) leaves `out` as it was. The sibling is removed on an error or
    Ctrl-C (a killed process leaves it, hidden, never a half output at `out`). What `out`
    held is moved aside before the new output takes its place and removed after, so a
    failed move puts it back. A link at `out` is followed: the output replaces what it points
    to, and the link stays (replacing the link put the output beside it, on another disk
    perhaps, and left its target as it was)."""
    _check_stageable(out)
    out = Path(os.path.realpath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{action}-{os.getpid()}"
    _remove(staging)  # a killed run's of this pid
    _remove_orphans(out)
    try:
        yield staging
        _move_in(staging, out)
    finally:
        _remove(staging)


# The actions of the commands that stage (their hidden siblings' names), and the old output
# moved aside: what _remove_orphans may remove.
STAGED_ACTIONS = ("generating", "importing", "placing", "training", "exporting", "replaced")


def _remove_orphans(out: Path) -> None:
    """Remove what runs killed before they finished left beside out: hidden staging and
    replaced siblings (.<name>.<action>-<pid>, action one of STAGED_ACTIONS) whose process
    is gone. One whose pid is in use is left (a run in progress, or a stranger that reused
    the pid), and so is any other name: a user's own .<name>.bak-2024 is not ours to remove."""
    import re

    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:{'|'.join(STAGED_ACTIONS)})-([0-9]+)")
    try:
        siblings = [(p, m) for p in out.parent.iterdir() if (m := pattern.fullmatch(p.name)) is not None]
    except OSError:
        return
    for path, m in siblings:
        pid = int(m.group(1))
        if pid != os.getpid() and not pid_alive(pid):
            _remove(path)


def _move_in(staging: Path, out: Path) -> None:
    if not out.exists():
        staging.rename(out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    _remove(old)
    out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        old.rename(out)
        raise
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
