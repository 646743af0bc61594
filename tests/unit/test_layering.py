"""Layers point down: a module imports only from its own layer or below, in the order
the architecture gives (docs/architecture.md). Every import counts, function-local ones
included. Known exceptions are listed with what removes them; a new upward import fails."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hybridgnn"

# bottom to top
LAYERS = ["types", "errors", "config", "capabilities", "graph", "workload", "sampling", "features", "models",
          "embeddings", "updates", "pipelines", "scheduler", "runtime", "serving", "telemetry", "profiling",
          "deploy", "demo", "bench", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}

# (importer's layer, imported layer): why it is still there
KNOWN_UPWARD = {
}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "hybridgnn" and len(parts) > 1 else None


def _upward_imports() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        me = rel.parts[0].removesuffix(".py")
        if me == "__init__":
            continue
        assert me in RANK, f"{rel}: layer {me!r} is not in LAYERS"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                other = _layer_of(module)
                if other is not None and other in RANK and RANK[other] > RANK[me]:
                    found.setdefault((me, other), []).append(f"{rel}:{node.lineno} imports {module}")
    return found


def test_layers_only_point_down_except_the_listed_ones():
    upward = _upward_imports()
    new = {pair: sites for pair, sites in upward.items() if pair not in KNOWN_UPWARD}
    assert not new, "upward imports:\n" + "\n".join(s for sites in new.values() for s in sites)


def test_the_known_exceptions_still_exist():
    """An exception that is gone must leave the list, so the list stays the truth."""
    upward = _upward_imports()
    stale = [pair for pair in KNOWN_UPWARD if pair not in upward]
    assert not stale, f"no longer upward, remove from KNOWN_UPWARD: {stale}"
