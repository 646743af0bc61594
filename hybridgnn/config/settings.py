"""What the configuration dataclasses are made of: the setting() field that is also a
flag, HYBRIDGNN_<FLAG> environment defaults, and parsers of the flags' text forms
(cores, byte sizes, front-end counts)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_PREFIX = "HYBRIDGNN_"


class BadEnvValue:
    """A HYBRIDGNN_<NAME> value its flag cannot take, kept as the flag's default while the
    command line's parsers are built (deferred_env_errors): the command that reads the
    flag refuses it in one line (cli.main); every other command runs, so a variable meant
    for `serve` does not break `hybridgnn dataset info`."""

    def __init__(self, message: str):
        self.message = message

    def __str__(self) -> str:
        return f"invalid: {self.message}"


_DEFERRING = []  # non-empty inside deferred_env_errors()


class deferred_env_errors:  # noqa: N801 (a context manager, used as a statement)
    """Within it, env_default returns a BadEnvValue instead of raising."""

    def __enter__(self):
        _DEFERRING.append(True)

    def __exit__(self, *exc):
        _DEFERRING.pop()


def env_default(name: str, default, cast=str):
    """Value of HYBRIDGNN_<NAME> cast with `cast`, or `default` when unset; ValueError
    naming the variable when the cast refuses it (a BadEnvValue holding that message
    within deferred_env_errors())."""
    raw = os.environ.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except (ValueError, TypeError, OverflowError) as exc:
        kind = "boolean" if cast is env_flag else getattr(cast, "__name__", "value")
        message = f"{ENV_PREFIX}{name}={raw!r} is not a valid {kind}: {exc}"
        if _DEFERRING:
            return BadEnvValue(message)
        raise ValueError(message) from exc


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(value: str) -> bool:
    """A boolean from the environment: 1/true/yes/on or 0/false/no/off (any case)."""
    v = value.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def config_class(cls):
    """A frozen dataclass whose checks first refuse NaN in any field by name: every
    comparison with NaN is false, so `timeout <= 0` would let it through and silently
    turn the limit off."""
    own = cls.__dict__.get("__post_init__")

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{name} must be a number, got NaN")
        if own is not None:
            own(self)

    cls.__post_init__ = __post_init__
    return dataclass(frozen=True)(cls)


def setting(default, help: str, *, flag: str | None = None, scale: float | None = None, choices=None, parse=None):
    """A config field that is also a command-line flag: its default lives here, once.
    flag: the flag's name (default --<field-name>); scale: flag value = field value ×
    scale (e.g. 1000 for a _s field shown in milliseconds); parse: the flag's type when
    it is not the field's own (e.g. "1G" byte sizes). cli/flags.py builds the flags."""
    meta = {"help": help, "flag": flag, "scale": scale, "choices": choices, "parse": parse}
    return field(default=default, metadata=meta)


def parse_frontends(text: str | int | None) -> int | None:
    """--frontends: 'auto' -> None (serving/frontends.py's frontends_for decides), else a count >= 1."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    try:
        count = int(str(text).strip())
    except ValueError:
        raise ValueError(f"--frontends takes a count or auto, got {text!r}") from None
    if count < 1:
        raise ValueError(f"--frontends must be >= 1 (or auto), got {count}")
    return count


def default_cache_dir() -> Path:
    base = env_default("CACHE_DIR", None)
    if base:  # ~ expanded as a path flag's is (a unit file's Environment= has no shell to do it)
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")  # empty or relative: unset, as the XDG spec says
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "hybridgnn"


MAX_CORE = 4096  # Linux's usual CPU_SETSIZE is 1024; a typo like 1-100000000 must not build a huge set


def parse_cpus(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """'2,3' or '2-5' or '0,4-7' -> the core numbers, ascending; '' -> ()."""
    if isinstance(text, (tuple, list)):
        return tuple(sorted({int(c) for c in text}))
    cores: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cores must be numbers or ranges like 0,2-3, got {text!r}") from None
        if first < 0 or last < first or last >= MAX_CORE:
            raise ValueError(f"cores must be numbers in [0, {MAX_CORE}) and ranges low-high, got {text!r}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def parse_bytes(text: str | int) -> int:
    """'512M', '4G', '1.5GiB' or a plain number of bytes -> bytes (binary units)."""
    if isinstance(text, int):
        value = text
    else:
        raw = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(raw[-1:], 1)
        try:
            value = int(float(raw[:-1] if scale > 1 else raw) * scale)
        except (ValueError, OverflowError) as exc:  # OverflowError: inf, 1e999G
            raise ValueError(f"expected a byte count such as 512M or 4G, got {text!r}") from exc
    if value < 0:
        raise ValueError(f"a byte count must be >= 0, got {text!r}")
    return value


# The most bytes of a JSON file people or tools write small (model and repository configs,
# embedding states): such a file past it is refused unread, not read whole into a server.
SMALL_JSON_BYTES = 16 << 20


def read_json(path: str | Path, max_bytes: int | None = None):
    """The JSON a file holds; ValueError saying why when it is not valid UTF-8 JSON
    (nested too deeply included, which json raises as RecursionError) or holds more than
    max_bytes (refused unread); OSError as is."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"{size:,} bytes, more than such a file holds (at most {max_bytes:,})")
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:  # grown since the stat
        raise ValueError(f"more than {max_bytes:,} bytes, more than such a file holds")
    try:
        return json.loads(data.decode())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not valid JSON: {exc}") from exc
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
