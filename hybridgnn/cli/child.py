"""A child process the server starts to run a `hybridgnn` command beside it:

    python -m hybridgnn.cli.child NICE PARENT_PID <hybridgnn arguments...>

runs `hybridgnn <arguments>` at niceness NICE (below serving, which shares its cores),
and ends when the process that started it (PARENT_PID) is gone: also when that one was
killed with -9, or stopped during its start-up before it could stop its children.
SIGINT and SIGHUP are ignored: sent to the whole process group (a Ctrl-C, a terminal's
hang-up) they are the server's to act on, and the server ends its children itself (SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        print("usage: python -m hybridgnn.cli.child NICE PARENT_PID <hybridgnn arguments...>", file=sys.stderr)
        return 2
    from hybridgnn.capabilities import die_with_parent

    die_with_parent(int(argv[1]))
    # A group's hang-up killed a model repository's precompute, and the version it was for
    # was listed unavailable, while the server (which takes SIGHUP as a cache refresh) served on.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.nice(int(argv[0]))  # before torch starts its threads: they inherit it
    from hybridgnn.cli.main import main as hybridgnn

    return hybridgnn(argv[2:])


if __name__ == "__main__":
    sys.exit(main())
