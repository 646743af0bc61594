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


def test_an_interrupted_run_reports_the_requests_sent_and_those_in_flight_apart():
    """The partial report of a run a signal stopped: the requests not yet sent are not in
    it, those still in flight are unanswered (not the server's errors), and its rates run
    over the time it ran."""
    from hybridgnn.bench.loadgen import _result

    statuses = np.array([200, 200, 429, 500, -1, 0, 0, 0])  # sent: the first 6; the last 2 never were
    latencies = np.array([0.002, 0.004, 0.001, 0.001, 0.5, np.nan, np.nan, np.nan])
    res = _result(100.0, 10.0, 2.0, 3, latencies, statuses.copy(), True, np.arange(8) / 100, sent=6,
                  interrupted="SIGINT")
    assert (res.sent, res.ok, res.rejected, res.errors, res.unanswered) == (6, 2, 1, 2, 1)
    assert res.error_statuses == {"-1": 1, "500": 1} and res.interrupted == "SIGINT"
    assert res.achieved_rps == pytest.approx(1.0) and res.seeds_per_s == pytest.approx(3.0)  # 2 ok over 2 s
    assert res.p50_ms == pytest.approx(3.0) and res.max_ms == pytest.approx(4.0)
    assert len(res.latencies_ms) == len(res.arrivals_s) == 6
    report = json.loads(strict_json(res.to_dict()))
    assert report["interrupted"] == "SIGINT" and report["unanswered"] == 1
    # a run that ran its course: everything scheduled counts, a missing answer is an error
    whole = _result(100.0, 10.0, 12.0, 3, latencies, statuses.copy(), False, np.arange(8) / 100)
    assert (whole.sent, whole.errors, whole.unanswered, whole.interrupted) == (8, 5, 0, None)
    assert whole.achieved_rps == pytest.approx(0.2)  # over the 10 s of arrivals
    # stopped before anything was sent: an empty report, still strict JSON
    empty = _result(100.0, 10.0, 0.1, 1, latencies[:0], statuses[:0], False, np.zeros(0), sent=0,
                    interrupted="SIGTERM")
    assert (empty.sent, empty.ok, empty.unanswered) == (0, 0, 0)
    assert json.loads(strict_json(empty.to_dict()))["p99_ms"] is None


def test_an_interrupted_reports_line_says_it_is_partial():
    from hybridgnn.bench.loadgen import _result
    from hybridgnn.cli.bench import interrupted_line, search_report

    res = _result(50.0, 600.0, 3.24, 1, np.full(4, 0.01), np.array([200, 200, 200, 0]), False, np.zeros(4),
                  sent=4, interrupted="SIGINT")
    assert interrupted_line(res.to_dict()) == ("hybridgnn bench: interrupted (SIGINT) after 3.2 s: a partial "
                                               "report of the 4 requests sent (1 still unanswered)")
    search = search_report(400.0, res, 50.0, "SIGTERM")
    assert search["interrupted"] == "SIGTERM" and search["max_rate_within_slo"] == 400.0
    assert interrupted_line(search).startswith("hybridgnn bench: terminated (SIGTERM): the search ended early")
    assert search_report(0.0, None, 50.0, None) == {"max_rate_within_slo": 0.0, "slo_ms": 50.0, "result": None,
                                                     "interrupted": None}


def test_overload_prints_its_summary_first_and_its_report_as_json_last(tmp_path, monkeypatch, capsys):
    """It printed the JSON, then its table and summary lines: the output's tail (what a
    device run brings back) was no report."""
    import sys

    monkeypatch.setenv("PYTHONPATH", __import__("os").environ.get("PYTHONPATH", ""))  # bench.common sets it
    import bench.overload as overload

    run = {"server": "current", "multiple": 1.0, "offered_rps": 100.0, "goodput_rps": 99.0, "share_429": 0.0,
           "share_503": 0.0, "p50_ms": 5.0, "p99_ms": float("nan"), "service_p99_ms": None,
           "latency_limit_ms": 120.0, "latency_ok": True, "goodput_ok": True}
    ratios = {"1x": {"goodput_current_over_baseline": 1.0, "p99_baseline_over_current": None,
                     "refused_share_current": 0.0, "refused_share_baseline": 0.0}}
    monkeypatch.setattr(overload, "ensure_demo", lambda: (tmp_path / "dataset", tmp_path / "model"))
    monkeypatch.setattr(overload, "part", lambda name, *a: {"mode": name, "runs": [run], "ratios": ratios})
    monkeypatch.setattr(sys, "argv", ["overload.py", "--servers", "current", "--parts", "sampled", "--multiples",
                                      "1", "--json", str(tmp_path / "r.json")])
    overload.main()
    out = capsys.readouterr().out
    head, brace, tail = out.partition("\n{\n")
    assert "goodput current/baseline 1.0" in head and "machine: " in head
    report = _strict_loads(brace.strip() + tail)
    assert report == _strict_loads((tmp_path / "r.json").read_text())
    assert report["parts"]["sampled"]["runs"][0]["p99_ms"] is None
