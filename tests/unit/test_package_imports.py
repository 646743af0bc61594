"""The installed package needs neither hypothesis nor pytest: they are the `test` extra, and
the helpers that use them live in tests/support (not shipped). Every import under hybridgnn/
counts, function-local and conditional ones included (ast.walk reaches them all)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hybridgnn"
TEST_ONLY = {"hypothesis", "pytest", "_pytest", "tests"}


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))  # importlib.import_module("pytest")
    return found


def test_no_package_module_imports_hypothesis_or_pytest():
    offenders = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50, f"found only {len(modules)} modules under {PACKAGE}"
    for path in modules:
        tree = ast.parse(path.read_text(), str(path))
        for lineno, module in _imported_modules(tree):
            if module.split(".")[0] in TEST_ONLY:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno} imports {module}")
    assert not offenders, ("the package may not import test-only modules (move the code to tests/support):\n"
                           + "\n".join(offenders))


def test_there_is_no_testing_subpackage():
    assert not (PACKAGE / "testing").exists(), "test helpers live in tests/support, outside the wheel"
