"""Entry point of the `hybridgnn` console script."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hybridgnn import __version__
from hybridgnn.cli import (
    bench,
    cluster,
    dataset,
    model,
    place,
    precompute,
    profile,
    rank,
    serve,
    train,
    workload,
)
from hybridgnn.cli.flags import in_flag_words
from hybridgnn.config.settings import (
    ENV_PREFIX,
    BadEnvValue,
    deferred_env_errors,
    env_default,
)
from hybridgnn.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
COMMANDS = (serve, cluster, dataset, model, workload, train, precompute, profile, place, bench, rank)


def build_parser() -> argparse.ArgumentParser:
    """Flag defaults read HYBRIDGNN_* variables; one a flag cannot take is refused only
    by the command that reads it (_check_defaults)."""
    with deferred_env_errors():
        return _build_parser()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridgnn", description="Workload-aware GPU/CPU hybrid GNN inference serving.")
    parser.add_argument("--version", action="version", version=f"hybridgnn {__version__}")
    parser.add_argument("--log-level", default=env_default("LOG_LEVEL", "INFO", str.upper), choices=LOG_LEVELS,
                        type=str.upper, help="log lines at this level and above (default: INFO, or HYBRIDGNN_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    _log_level_after_commands(parser)
    return parser


def _log_level_after_commands(parser: argparse.ArgumentParser) -> None:
    """`hybridgnn serve --log-level DEBUG` as `hybridgnn --log-level DEBUG serve`: users
    put the flag after the command too (it was refused there as unrecognized)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in set(action.choices.values()):
                if not any("--log-level" in a.option_strings for a in command._actions):
                    command.add_argument("--log-level", choices=LOG_LEVELS, type=str.upper,
                                         default=argparse.SUPPRESS, help="as before the command")
                _log_level_after_commands(command)


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The deepest subparser the parsed command line reached (e.g. `dataset import`)."""
    current = parser
    while True:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return current
        current = subs[0].choices[name]


def _check_defaults(command: argparse.ArgumentParser, args) -> None:
    """argparse checks choices only of values given on the command line: a default from
    a HYBRIDGNN_* variable is checked here, refused in one line as a variable's value
    that its flag cannot parse is (without the usage: no flag on the line was wrong)."""
    for action in command._actions:
        value = getattr(args, action.dest, None)
        if isinstance(value, BadEnvValue):
            _refuse_env(args, value.message)
        if action.choices is None or value is None or isinstance(value, list) or not action.option_strings \
                or isinstance(action, argparse._SubParsersAction):
            continue  # positionals and lists come from the command line, which argparse checked
        if value not in action.choices:
            env = ENV_PREFIX + action.option_strings[-1][2:].upper().replace("-", "_")
            _refuse_env(args, f"argument {'/'.join(action.option_strings)}: invalid choice {value!r} (from {env}; "
                              f"choose from {', '.join(map(str, action.choices))})")


def _refuse_env(args, message: str) -> None:
    print(f"hybridgnn {args.command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # flag defaults read HYBRIDGNN_* variables
    except ValueError as exc:
        print(f"hybridgnn: error: {exc}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # say it with the subcommand's usage, which lists the flags it does take
        hint = (" (flags for the replicas' `hybridgnn serve` go after `--`: hybridgnn cluster ... -- --dataset D "
                "--model M)" if getattr(args, "command", None) == "cluster" else "")
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    _check_defaults(parser, args)  # --log-level (HYBRIDGNN_LOG_LEVEL), taken before any command
    _check_defaults(_command_parser(parser, args), args)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher re-runs as each rank
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a reader gone (`| head`) is found here, not in the flush at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        # A dataset, model, profile or flags that do not fit (ConfigError; the config
        # dataclasses raise ValueError for a bad flag): one clear line, exit 2.
        message = " ".join(str(exc).split())
        if not isinstance(exc, (ConfigError, FileNotFoundError)):  # a config dataclass's: name the flags
            message = in_flag_words(message)
        print(f"hybridgnn {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:
        # A path that cannot be read or written (a directory where a file is expected, a
        # read-only directory, a full disk): one line, exit 2, not a traceback.
        where = f" {exc.filename}" if exc.filename else ""
        print(f"hybridgnn {args.command}: error: cannot use{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C (or a SIGTERM that a command turns into one, exit 143): one line saying so
        # (it ended silently, as if the command had finished)
        code = getattr(exc, "exit_code", 130)
        print(f"hybridgnn {args.command}: {'terminated' if code == 143 else 'interrupted'}", file=sys.stderr)
        return code


# The exit status of a command that SIGPIPE ended (128 + 13), as `cat` or `git` report it.
EXIT_READER_GONE = 141


def _reader_gone() -> int:
    """What stdout was piped into closed it before the command finished writing
    (`hybridgnn dataset info D | head -1`): end quietly, with a killed-by-SIGPIPE status,
    as Unix tools do (it said "error: cannot use: Broken pipe", exit 2). stdout is
    pointed at /dev/null so that the interpreter's flush at exit cannot fail again
    (Python's documented recipe)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured, replaced): nothing to redirect
        return EXIT_READER_GONE
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
