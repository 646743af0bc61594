"""The installed package needs neither hypothesis nor pytest: they are the `test` extra, and
the helpers that use them live in tests/support (not shipped). Every import under hybridgnn/
counts, function-local and conditional ones included (ast.walk reaches them all)."""

import ast
from pathlib import Path

from tests.support.source import parse_file

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
        tree = parse_file(path)
        for lineno, module in _imported_modules(tree):
            if module.split(".")[0] in TEST_ONLY:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno} imports {module}")
    assert not offenders, ("the package may not import test-only modules (move the code to tests/support):\n"
                           + "\n".join(offenders))


def test_there_is_no_testing_subpackage():
    assert not (PACKAGE / "testing").exists(), "test helpers live in tests/support, outside the wheel"


def _module_level_imports(path: Path) -> set[str]:
    """What a module imports when it is imported (not what its functions import later)."""
    found = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                visit(node.orelse)  # the body runs only under a type checker
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
    visit(parse_file(path).body)
    return found


def _package_file(module: str) -> Path | None:
    if module == "hybridgnn":
        return PACKAGE / "__init__.py"
    rel = Path(*module.split(".")[1:])
    for p in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if p.exists():
            return p
    return None


def _import_closure(module: str) -> tuple[set[str], set[str]]:
    """(the package's modules importing `module` imports, the outside modules they import)."""
    seen, outside, todo = set(), set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        parts = m.split(".")
        # importing a.b.c runs a/__init__, a/b/__init__ first
        for i in range(2, len(parts)):
            todo.append(".".join(parts[:i]))
        path = _package_file(m)
        if path is None:
            continue
        seen.add(m)
        for imp in _module_level_imports(path):
            if imp.split(".")[0] == "hybridgnn":
                todo.append(imp)
            else:
                outside.add(imp.split(".")[0])
    return seen, outside


def test_a_front_end_process_loads_no_torch():
    """serving/frontend.py (one per front-end process) stays small: nothing it imports
    imports torch (or the engine)."""
    inside, outside = _import_closure("hybridgnn.serving.frontend")
    assert "hybridgnn.serving.frontend" in inside and "hybridgnn.serving.http.server" in inside
    assert "torch" not in outside, sorted(outside)
    assert not [m for m in inside if m.startswith(("hybridgnn.serving.core.engine", "hybridgnn.serving.v2.service"))]


def test_the_import_closure_sees_torch_where_it_is():
    _, outside = _import_closure("hybridgnn.serving.http.api")
    assert "torch" in outside


def test_the_adapt_helper_process_loads_no_torch():
    """`serve --adapt` re-fits the policy in a helper process that imports
    scheduler/control.py: deciding needs curves and a simulator, never a tensor, so it
    does not pay for torch (seconds of start and hundreds of MB)."""
    inside, outside = _import_closure("hybridgnn.scheduler.control")
    assert {"hybridgnn.scheduler.policy", "hybridgnn.types"} <= inside
    assert "torch" not in outside, sorted(outside)
