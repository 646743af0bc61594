"""Benchmark reports as strict JSON: a figure with no value (a percentile of a run where
nothing succeeded, a ratio over an empty run) is null, never NaN or Infinity, which
strict parsers (jq, JavaScript, most languages' JSON libraries) refuse. `hybridgnn bench`
and the scripts under bench/ (through bench/common.py) write their reports with it."""

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
