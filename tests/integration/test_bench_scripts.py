"""The bench scripts still run. They are scripts, not timed tests, and nothing else runs most
of them, so a refactor broke them unseen (a name the end of a run reads, a lost import, a
flag). Every bench/*.py answers --help; a few that finish in seconds at tiny sizes run for
real, from another directory, and print their report as strict JSON last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name not in ("__init__.py", "common.py"))

# Each script's --help in one interpreter (one torch import instead of one per script:
# seconds, not minutes, on two cores); the modules of bench/ and tests/ and the import
# path are reset before each, so a script imports what it needs itself.
_HELP_ALL = r"""
import contextlib, io, json, runpy, sys, traceback
path0, failures, helps = list(sys.path), {}, {}
for script in sys.argv[1:]:
    for name in [m for m in sys.modules if m.split(".")[0] in ("bench", "tests")]:
        del sys.modules[name]
    sys.path[:] = path0
    sys.argv, out = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
        failures[script] = "ran without exiting: it took --help for a run"
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage:" not in out.getvalue():
            failures[script] = f"exit {exc.code}: {out.getvalue()[-1500:]}"
    except BaseException:
        failures[script] = traceback.format_exc()[-3000:]
    helps[script] = out.getvalue()
print(json.dumps({"failures": failures, "helps": helps}))
"""


def _env(data: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if data is not None:
        env["HYBRIDGNN_BENCH_DATA"] = str(data)  # bench/common.py's DATA: graphs the scripts generate or reuse
    return env


def _run(script: str, *args: str, cwd: Path, data: Path | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=cwd, env=_env(data),
                          capture_output=True, text=True, timeout=timeout)


def _last_json(stdout: str):
    """The report a script printed last: strict JSON (NaN or Infinity fail) running to the end."""
    lines = stdout.rstrip().splitlines()
    for i in reversed(range(len(lines))):
        if lines[i][:1] in ("{", "["):
            try:
                return json.loads("\n".join(lines[i:]), parse_constant=lambda c: pytest.fail(f"{c} in the report"))
            except json.JSONDecodeError:
                continue
    pytest.fail(f"no JSON report at the end of:\n{stdout[-3000:]}")


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, str]:
    """Each script's --help (by file name); fails on any that did not answer it."""
    proc = subprocess.run([sys.executable, "-c", _HELP_ALL, *map(str, SCRIPTS)], env=_env(tmp_path_factory.mktemp("d")),
                          cwd=tmp_path_factory.mktemp("cwd"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["failures"], "\n\n".join(f"{Path(k).name}: {v}" for k, v in got["failures"].items())
    return {Path(k).name: v for k, v in got["helps"].items()}


def test_every_bench_script_answers_help(helps):
    assert len(helps) == len(SCRIPTS) >= 30


def test_the_bench_commands_the_docs_quote_name_only_flags_their_script_takes(helps):
    """A command quoted in the docs (`bench/x.py --flag ...`) still parses: every flag it
    names is in that script's --help. Values of --x="..." (flags for the server) are not its own."""
    import re

    quoted = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`]+)`", doc.read_text()):
            span = " ".join(span.split())
            for script, rest in re.findall(r"bench/(\w+\.py)((?:\s+[^\s]+)*)", span):
                quoted.append((doc.name, script, re.sub(r"""=("[^"]*"|'[^']*'|\S*)""", "", rest)))
    assert len(quoted) >= 40
    unknown = [(doc, script, flag) for doc, script, rest in quoted if script != "common.py"
               for flag in re.findall(r"(?<![\w-])--[\w-]+", rest)
               if script not in helps or not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[script])]
    assert not unknown


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory) -> Path:
    """A bench data directory whose arxiv-scale graph (bench/incremental.py's ARXIV, reused
    when present) is a 1,500-node power-law graph."""
    from hybridgnn.graph.generate import generate_powerlaw

    data = tmp_path_factory.mktemp("bench-data")
    generate_powerlaw(data / "arxiv-powerlaw", num_nodes=1500, avg_degree=8, feature_dim=16, seed=0)
    return data


def test_workload_tables_and_placement_report_on_a_tiny_graph(bench_data, tmp_path):
    graph = str(bench_data / "arxiv-powerlaw")
    proc = _run("workload_tables.py", "--dataset", graph, "--subset", "100", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _last_json(proc.stdout)
    assert report["graph"]["nodes"] == 1500
    assert {"tables_build_s", "speedup_tables_vs_sampling", "mean_psgs_exact", "mean_sampled_size_on_subset"} <= set(report)

    proc = _run("placement.py", "--dataset", graph, "--batches", "4", "--batch-size", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _last_json(proc.stdout)
    assert report["cases"] and {"p99_ms", "fap_vs_best_baseline"} <= set(report["cases"][0])
    assert [r["cache_share"] for r in report["cache_hit_ratio"]] == [0.05, 0.1, 0.2]


def test_incremental_prints_its_rows_as_json_last_and_writes_the_same(bench_data, tmp_path):
    """It printed a table only, and wrote JSON only with --json."""
    proc = _run("incremental.py", "--graphs", "arxiv", "--aggs", "mean", "--batches", "10:1",
                "--json", str(tmp_path / "r.json"), cwd=tmp_path, data=bench_data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _last_json(proc.stdout)
    assert rows == json.loads((tmp_path / "r.json").read_text())
    assert [(r["graph"], r["agg"], r["batch"]) for r in rows] == [("arxiv", "mean", 10)]
    assert rows[0]["incremental"]["updates_per_s"] > 0 and rows[0]["recompute"]["updates_per_s"] > 0


def test_durability_log_cost_prints_its_report_as_json_last(bench_data, tmp_path):
    """It printed lines only, and wrote JSON only with --json."""
    proc = _run("durability.py", "--parts", "cost", "--rounds", "1", "--batches-1000", "1", "--batches-100", "1",
                "--aggs", "mean", cwd=tmp_path, data=bench_data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _last_json(proc.stdout)
    assert report["cost"]["graph"]["nodes"] == 1500
    assert {"durable_updates_per_s", "durable_over_memory"} <= set(report["cost"]["aggs"]["mean"]["batch_1000"])


def test_partitioned_serving_runs_on_two_ranks_and_refuses_a_run_that_measures_nothing(tmp_path):
    """--requests 3 (all of them warm-up) failed at the end with an IndexError traceback."""
    proc = _run("partitioned_serving.py", "--requests", "3", cwd=tmp_path, data=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--requests 3: the first 3 of each mode only warm up" in proc.stderr.strip().splitlines()[-1]

    proc = _run("partitioned_serving.py", "--nodes", "1000", "--hidden", "8", "--requests", "4", "--ranks", "2",
                cwd=tmp_path, data=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = _last_json(proc.stdout)["runs"]
    assert run["ranks"] == 2 and [m["mode"] for m in run["modes"]] == ["srpe", "pe", "full", "sampled"]
    assert all(m["requests"] == 1 and m["max_abs_diff_cgp_vs_fetch"] < 1e-4 for m in run["modes"])


def test_gpu_all_parses_and_calls_each_script_with_flags_it_takes(helps):
    """bench/gpu_all.sh runs on a GPU machine only, where a stage that breaks costs device time."""
    import re

    script = ROOT / "bench" / "gpu_all.sh"
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    text = script.read_text().replace("\\\n", " ")
    calls = [(name, re.sub(r"""=("[^"]*"|'[^']*'|\S*)""", "", rest))
             for line in text.splitlines() if not line.lstrip().startswith("#")
             for name, rest in re.findall(r"bench/(\w+\.py)(.*)", line)]
    assert {name for name, _ in calls} >= {"gpu_sampler.py", "lane_cost.py", "hybrid_policies.py", "slo_batching.py"}
    unknown = [(name, flag) for name, rest in calls for flag in re.findall(r"(?<![\w-])--[\w-]+", rest)
               if name not in helps or not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[name])]
    assert not unknown
