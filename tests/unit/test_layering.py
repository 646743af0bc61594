"""Layers point down: a module imports only from its own layer or below, in the order
the architecture gives (docs/architecture.md). Every import counts, function-local ones
included. Known exceptions are listed with what removes them; a new upward import fails."""

import ast
import sys
from pathlib import Path

from tests.support.source import parse_file

PACKAGE = Path(__file__).resolve().parents[2] / "hybridgnn"

# bottom to top
LAYERS = ["types", "errors", "config", "capabilities", "graph", "workload", "sampling", "features", "models",
          "embeddings", "updates", "pipelines", "scheduler", "runtime", "serving", "distributed", "telemetry", "profiling",
          "deploy", "demo", "bench", "cli", "__main__"]
RANK = {name: i for i, name in enumerate(LAYERS)}

# (importer's layer, imported layer): why it is still there
KNOWN_UPWARD = {
}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "hybridgnn" and len(parts) > 1 else None


def _imports(path):
    """(line, module) of every absolute import in a file, function-local ones included."""
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _upward_imports() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        me = rel.parts[0].removesuffix(".py")
        if me == "__init__":
            continue
        assert me in RANK, f"{rel}: layer {me!r} is not in LAYERS"
        for lineno, module in _imports(path):
            other = _layer_of(module)
            if other is not None and other in RANK and RANK[other] > RANK[me]:
                found.setdefault((me, other), []).append(f"{rel}:{lineno} imports {module}")
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


# serving/'s sub-packages, bottom to top; a module imports only from its own sub-package or
# one below. http and grpc are transports side by side: neither imports the other; ipc
# (front-end processes to the engine) sits beside them. The
# modules directly in serving/ (server.py assembles, lifecycle.py runs) sit on top.
SERVING = PACKAGE / "serving"
SERVING_RANKS = {"core": 0, "repository": 1, "v2": 2, "http": 3, "grpc": 3, "ipc": 3, "": 4}


def _serving_part(module: str) -> str | None:
    """The serving sub-package a module name lies in ("" for serving/'s own modules)."""
    parts = module.split(".")
    if parts[:2] != ["hybridgnn", "serving"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SERVING_RANKS and parts[2] else ""


def _serving_violations() -> list[str]:
    found = []
    for path in sorted(SERVING.rglob("*.py")):
        rel = path.relative_to(SERVING)
        me = rel.parts[0] if len(rel.parts) > 1 else ""
        assert me in SERVING_RANKS, f"serving/{rel}: sub-package {me!r} is not in SERVING_RANKS"
        for lineno, module in _imports(path):
            other = _serving_part(module)
            if other is not None and other != me and SERVING_RANKS[other] >= SERVING_RANKS[me]:
                found.append(f"serving/{rel}:{lineno} ({me or 'serving'}) imports {module}")
    return found


def test_serving_sub_packages_only_point_down():
    """core below repository below v2 below the transports (http, grpc: neither imports
    the other), the assembly on top."""
    bad = _serving_violations()
    assert not bad, "upward or sideways imports in serving/:\n" + "\n".join(bad)


def test_the_serving_rank_check_can_fail(tmp_path, monkeypatch):
    """A transport importing the other transport is caught (the check is not vacuous)."""
    fake = tmp_path / "serving"
    (fake / "grpc").mkdir(parents=True)
    (fake / "grpc" / "x.py").write_text("from hybridgnn.serving.http.codec import parse_infer\n")
    monkeypatch.setattr(sys.modules[__name__], "SERVING", fake)
    assert _serving_violations() == ["serving/grpc/x.py:1 (grpc) imports hybridgnn.serving.http.codec"]
