"""Where a command writes its output (--out): checked before the command's work, so a path
that cannot take it is refused in one line at once rather than after minutes of work.

A path problem is raised as the OSError the write would have met (a file where a directory
is wanted, a directory where a file is, a directory that cannot be written), which
cli/main.py prints as "cannot use <path>: <reason>"; an output the command will not
replace is a ConfigError."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

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
