"""Benchmark reports are strict JSON: a figure with no value (a ratio over an empty run, a
percentile of a run where nothing succeeded) is null. The scripts under bench/ wrote
json.dumps' NaN and Infinity, which strict parsers (jq, JavaScript) refuse."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hybridgnn.bench.report import finite, strict_json


def _strict_loads(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))


def test_figures_with_no_value_are_null_at_any_depth_and_the_rest_unchanged():
    report = {"ratio": float("nan"), "p99_ms": float("inf"), "floor": -math.inf, "np": np.float64("nan"),
              "rows": [{"speedup": math.nan, "ok": 3, "share": 0.5}, (1.5, float("inf"))],
              "flags": [True, None, "NaN"], "nested": {"deeper": {"x": [[math.nan]]}}}
    assert finite(report) == {"ratio": None, "p99_ms": None, "floor": None, "np": None,
                              "rows": [{"speedup": None, "ok": 3, "share": 0.5}, [1.5, None]],
                              "flags": [True, None, "NaN"], "nested": {"deeper": {"x": [[None]]}}}
    assert _strict_loads(strict_json(report)) == finite(report)
    assert strict_json({"a": 1}, indent=None) == '{"a": 1}'
    assert _strict_loads(strict_json({"path": object()}, default=lambda o: "obj")) == {"path": "obj"}


def test_the_bench_scripts_report_writer_prints_and_writes_strict_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", __import__("os").environ.get("PYTHONPATH", ""))  # bench.common sets it
    from bench.common import emit_report

    report = {"machine": "m", "rows": [{"seeds_per_s": 0.0, "vs_baseline": float("nan")}], "p99_ms": math.inf}
    emit_report(report, tmp_path / "r.json")
    printed = _strict_loads(capsys.readouterr().out)
    assert printed == _strict_loads((tmp_path / "r.json").read_text())
    assert printed == {"machine": "m", "rows": [{"seeds_per_s": 0.0, "vs_baseline": None}], "p99_ms": None}


def test_a_bench_scripts_progress_line_is_one_line_of_strict_json(capsys):
    from bench.common import progress

    progress({"rate": 100, "p99_ms": float("nan"), "served": [1.0, math.inf]})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and _strict_loads(out) == {"rate": 100, "p99_ms": None, "served": [1.0, None]}


def _undefined_names(code: str) -> set[str]:
    """Names a program's code reads as globals but never binds (imports and builtins aside)."""
    import builtins
    import symtable

    top = symtable.symtable(code, "<probe>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    bound |= {c.get_name() for c in top.get_children()}  # functions and classes it defines
    missing, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for s in table.get_symbols():
            if s.is_referenced() and (s.is_global() or table is top) and not (s.is_assigned() or s.is_imported()):
                if s.get_name() not in bound and not hasattr(builtins, s.get_name()):
                    missing.add(s.get_name())
    return missing


def test_the_programs_bench_scripts_run_in_other_processes_name_only_what_they_define():
    """A probe runs in a child process, often against a baseline revision: it may use only
    what it imports itself. One used bench.common's progress() and failed at its end."""
    import ast
    from pathlib import Path

    programs = []
    for path in sorted((Path(__file__).resolve().parents[2] / "bench").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str) and "\nimport " in "\n" + node.value.value):
                programs.append((f"{path.name}:{node.targets[0].id}", node.value.value))
    assert any(name == "refusal_cost.py:PROBE" for name, _ in programs)
    problems = {name: sorted(_undefined_names(code)) for name, code in programs}
    assert not {k: v for k, v in problems.items() if v}
