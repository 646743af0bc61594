"""Tests and benches share helpers through hybridgnn.testing, never by importing one
another: a test module imported from elsewhere runs its module-level code twice and
couples suites that should move independently."""

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
