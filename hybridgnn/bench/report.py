"""Benchmark reports as strict JSON: a figure with no value (a percentile of a run where
nothing succeeded, a ratio over an empty run) is null, never NaN or Infinity, which
strict parsers (jq, JavaScript, most languages' JSON libraries) refuse. `hybridgnn bench`
and the scripts under bench/ (through bench/common.py) write their reports with it. And
what a load's report says of its failures: a bounded sample of what the server said
(ErrorSamples)."""

from __future__ import annotations

import json
import math


def finite(value):
    """value with every float that is not finite (NaN, ±inf) as None, through dicts,
    lists and tuples (tuples become lists, as JSON writes them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def strict_json(report, *, indent: int | None = 2, default=None) -> str:
    """The report as JSON that strict parsers take (finite's nulls); default: as json.dumps'."""
    return json.dumps(finite(report), indent=indent, allow_nan=False, default=default)


# The sample of messages a run keeps: so many distinct ones per status, each cut to so many
# characters, from at most the first so many bytes of a body (a run of millions of
# failures keeps no more, and parses a body only while its status has room)
MESSAGES_PER_STATUS = 3
MESSAGE_CHARS = 200
MESSAGE_BODY_BYTES = 1 << 16


def error_message(body: bytes) -> str:
    """What a failing answer's body says: its JSON "error" (the server's errors are
    {"error": "..."}), else its text."""
    try:
        said = json.loads(body)
    except ValueError:  # not JSON (or cut short): its text
        said = None
    if isinstance(said, dict) and isinstance(said.get("error"), str):
        return said["error"]
    return body.decode("utf-8", "replace")


class ErrorSamples:
    """The first MESSAGES_PER_STATUS distinct messages of each status, each at most
    MESSAGE_CHARS long: bounded however many answers fail."""

    def __init__(self):
        self.by_status: dict[int, list[str]] = {}
        self._last: dict[int, bytes] = {}  # the body last read per status: a repeat is not parsed again

    def wants(self, status: int) -> bool:
        return len(self.by_status.get(status, ())) < MESSAGES_PER_STATUS

    def add(self, status: int, message: str) -> None:
        if not self.wants(status):
            return
        message = " ".join(message.split())
        if len(message) > MESSAGE_CHARS:
            message = message[:MESSAGE_CHARS - 3] + "..."
        seen = self.by_status.setdefault(status, [])
        if message not in seen:
            seen.append(message)

    def add_body(self, status: int, body: bytes) -> None:
        if self.wants(status) and self._last.get(status) != body:
            self._last[status] = body
            self.add(status, error_message(body))

    def to_dict(self) -> dict[str, list[str]]:
        return {str(status): list(said) for status, said in sorted(self.by_status.items())}
