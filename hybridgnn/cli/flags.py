"""Command-line flags generated from the config dataclasses' fields.

A field declared with config.setting(...) carries its help, flag name and unit scale;
its default is the field's own, so a default lives in one place. Every flag can also be
set as HYBRIDGNN_<FLAG> (e.g. HYBRIDGNN_MAX_WAIT_MS=5)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

from hybridgnn.config import env_default


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" only where it tells the reader something: not when the help
    already says what the default is, not for no value (None or "": the help says what
    happens then) and not for on/off switches (their name says it; --no-spill read
    "(default: True)")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default is None or action.default == "":
            return text
        return super()._get_help_string(action)


def user_path(text: str) -> Path:
    """A path flag's value, with a leading ~ expanded: the shell leaves `--out=~/x` and a
    HYBRIDGNN_* variable's "~/x" as they are, and a directory named "~" is no one's intent."""
    return Path(text).expanduser()


def user_path_or_word(text: str) -> str:
    """The value of a flag that takes a keyword or a path (`--seeds uniform|degree|LOG`): a
    leading ~ expanded as user_path does (`--seeds=~/requests.txt` was "no such file"),
    a keyword as it is."""
    return os.path.expanduser(text)


_TYPES = {"int": int, "float": float, "str": str, "Path": user_path}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _dest(cls, f: dataclasses.Field) -> str:
    return f"{cls.__name__}.{f.name}"


class FlagValueError(argparse.ArgumentTypeError, ValueError):
    """A flag's text its parser refuses: argparse prints the parser's own message (it said
    "invalid <lambda> value" or "invalid parse_frontends value"), and env_default still
    sees a ValueError for a HYBRIDGNN_* variable."""


def flag_parser(parse):
    """`parse` as an argparse type whose refusals say why."""
    def convert(text):
        try:
            return parse(text)
        except (ValueError, OverflowError) as exc:
            raise FlagValueError(str(exc)) from None
    convert.__name__ = "value"  # env_default: "HYBRIDGNN_X='...' is not a valid value: <why>"
    return convert


def _type(f: dataclasses.Field):
    if f.metadata.get("parse") is not None:
        return flag_parser(f.metadata["parse"])
    name = str(f.type).replace(" | None", "").strip()
    if name not in _TYPES:
        raise TypeError(f"{f.name}: no flag type for annotation {f.type!r}")
    return _TYPES[name]


def settings(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags (declared with config.setting)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_config_flags(parser: argparse.ArgumentParser, *classes) -> None:
    """One flag per setting of each class: type, default (in the flag's unit), choices,
    help and the HYBRIDGNN_<FLAG> environment default, all from the field."""
    for cls in classes:
        for f in settings(cls):
            flag, kind, scale = _flag(f), _type(f), f.metadata.get("scale")
            default = f.default
            if default is not None and scale:
                default = default * scale
            env = flag[2:].upper().replace("-", "_")
            parser.add_argument(flag, dest=_dest(cls, f), type=kind, choices=f.metadata.get("choices"),
                                default=env_default(env, default, kind), help=f.metadata["help"],
                                metavar=None if f.metadata.get("choices") else env)


def config_values(args: argparse.Namespace, cls) -> dict:
    """{field: value} for cls's settings as parsed (back in the field's unit)."""
    out = {}
    for f in settings(cls):
        value = getattr(args, _dest(cls, f))
        scale = f.metadata.get("scale")
        out[f.name] = value / scale if value is not None and scale else value
    return out


def flags_given(args: argparse.Namespace, cls) -> list[str]:
    """The flags of cls's settings whose parsed value is not the setting's default (given on
    the command line or by a HYBRIDGNN_<FLAG> variable)."""
    values = config_values(args, cls)
    return [_flag(f) for f in settings(cls) if values[f.name] != f.default]


def flag_value(args: argparse.Namespace, cls, name: str):
    """The parsed value of one setting, in the flag's unit."""
    f = next(f for f in settings(cls) if f.name == name)
    return getattr(args, _dest(cls, f))


def _flags_by_field() -> dict[str, str]:
    """{field name: its flag} for every setting of hybridgnn.config whose flag takes the
    field's own unit and whose name no other setting's flag shares."""
    import hybridgnn.config as config

    seen: dict[str, set[str]] = {}
    for cls in vars(config).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            for f in settings(cls):
                seen.setdefault(f.name, set()).add("" if f.metadata.get("scale") else _flag(f))
    return {name: flags.pop() for name, flags in seen.items() if len(flags) == 1 and "" not in flags}


def in_flag_words(message: str) -> str:
    """A config error as the command line says it: the settings it names (max_pending_requests,
    gamma at the start) as their flags (--max-pending, --srpe-gamma). Names of several
    words anywhere, one word only as the subject ("gamma must ..."): a lone word such as
    "log" or "policy" is too often plain English. Names inside paths, file names and quoted
    values are the user's text and stay as they are."""
    flags = _flags_by_field()

    def flag(match: re.Match) -> str:
        return flags.get(match.group(0), match.group(0))

    # a name standing alone: not part of a path, a file name or a quoted value (a user's
    # /data/seed_log.npy or 'a_b' stays as given)
    message = re.sub(r"(?<![\w./\\'\"-])[a-z]+(?:_[a-z]+)+(?![\w/\\'\"-]|\.\w)", flag, message)
    head = re.match(r"([a-z]+) must\b", message)
    if head and head.group(1) in flags:
        message = flags[head.group(1)] + message[len(head.group(1)):]
    return message
