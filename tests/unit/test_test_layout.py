"""Tests and benches share helpers through hybridgnn.testing, never by importing one
another: a test module imported from elsewhere runs its module-level code twice and
couples suites that should move independently. Unit tests stay in process: no sockets,
no servers, no child processes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_test_bench_or_package_module_imports_a_test_module():
    offenders = []
    for folder in ("tests", "bench", "hybridgnn"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad = sorted(n for n in _imports_of(path) if n == "tests" or n.startswith("tests."))
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    assert not offenders, "import shared helpers from hybridgnn.testing instead:\n" + "\n".join(offenders)


# What a unit test may not use: sockets, servers, processes (tests/integration has those).
NOT_IN_UNIT_TESTS = {"socket", "subprocess", "multiprocessing", "aiohttp", "hybridgnn.testing.engine_client",
                     "hybridgnn.testing.server", "hybridgnn.serving.http.protocol", "hybridgnn.pipelines.process"}


def test_unit_tests_open_no_sockets_and_start_no_processes():
    offenders = []
    for path in sorted((ROOT / "tests" / "unit").rglob("*.py")):
        bad = sorted(n for n in _imports_of(path) if n in NOT_IN_UNIT_TESTS or n.split(".")[0] in NOT_IN_UNIT_TESTS)
        if bad:
            offenders.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    assert not offenders, "move these to tests/integration:\n" + "\n".join(offenders)


def test_every_name_a_bench_script_imports_exists():
    """Bench scripts run by hand, not in CI: a helper moved elsewhere must not leave one
    failing at its first line. Each `from hybridgnn... / bench... import name` is resolved."""
    import importlib

    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in ("hybridgnn", "bench")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not missing, "bench scripts import names that do not exist:\n" + "\n".join(missing)
