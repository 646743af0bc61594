"""Tests and benches share helpers through tests.support, never by importing one
another: a test module imported from elsewhere runs its module-level code twice and
couples suites that should move independently. The installed package imports nothing
from tests/ (tests/support is not shipped). Unit tests stay in process: no sockets,
no servers, no child processes."""

import ast
from pathlib import Path

from tests.support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]


def _imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("tests", "tests.support"):  # `from tests.support import server` names a module
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            if node.module != "tests":
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _is_support(name: str) -> bool:
    return name == "tests.support" or name.startswith("tests.support.")


def test_no_test_bench_or_package_module_imports_a_test_module():
    offenders = []
    for folder in ("tests", "bench", "hybridgnn"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            names = _imports_of(path)
            tests_names = [n for n in names if n == "tests" or n.startswith("tests.")]
            # hybridgnn/ is what the wheel ships: it may not import even tests.support.
            bad = sorted(n for n in tests_names if folder == "hybridgnn" or not _is_support(n))
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    assert not offenders, ("import shared helpers from tests.support instead (and nothing from tests/ "
                           "in hybridgnn/):\n" + "\n".join(offenders))


# What a unit test may not use: sockets, servers, processes (tests/integration has those).
NOT_IN_UNIT_TESTS = {"socket", "subprocess", "multiprocessing", "aiohttp", "tests.support.engine_client",
                     "tests.support.server", "hybridgnn.serving.http.protocol", "hybridgnn.pipelines.process"}


def test_unit_tests_open_no_sockets_and_start_no_processes():
    offenders = []
    for path in sorted((ROOT / "tests" / "unit").rglob("*.py")):
        bad = sorted(n for n in _imports_of(path) if n in NOT_IN_UNIT_TESTS or n.split(".")[0] in NOT_IN_UNIT_TESTS)
        if bad:
            offenders.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    assert not offenders, "move these to tests/integration:\n" + "\n".join(offenders)


def test_every_name_a_bench_script_imports_exists():
    """Bench scripts run by hand, not in CI: a helper moved elsewhere must not leave one
    failing at its first line. Each `from hybridgnn... / bench... / tests.support... import name`
    is resolved."""
    import importlib

    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(parse_file(path)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and (node.module.split(".")[0] in ("hybridgnn", "bench") or _is_support(node.module))):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not missing, "bench scripts import names that do not exist:\n" + "\n".join(missing)
