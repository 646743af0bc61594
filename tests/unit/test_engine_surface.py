"""Stats out, not internals in: outside serving/core (the engine's own package), code uses
the engine's public methods and its snapshot(), never its private parts. The private
names are those Engine and its base classes set on self or define; any `x._name` outside
core whose name is one of them (x not self or cls) fails, in hybridgnn/ and bench/."""

import ast
from pathlib import Path

from tests.support.source import parse_file

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "hybridgnn" / "serving" / "core"
ENGINE_MODULES = [CORE / "engine.py", CORE / "sampled.py"]


def private_engine_names(modules=ENGINE_MODULES) -> set[str]:
    names = set()
    for path in modules:
        for node in ast.walk(parse_file(path)):
            if isinstance(node, ast.ClassDef) and node.name in ("Engine", "SampledInference"):
                for inner in ast.walk(node):
                    if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                            and inner.value.id == "self" and inner.attr.startswith("_")
                            and not inner.attr.startswith("__")):
                        names.add(inner.attr)
                    elif isinstance(inner, ast.FunctionDef) and inner.name.startswith("_") \
                            and not inner.name.startswith("__"):
                        names.add(inner.name)
    return names


def touches(paths, private: set[str], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(parse_file(path)):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.relative_to(root)}:{node.lineno} reads .{node.attr}")
    return found


def outside_core() -> list[Path]:
    return [p for p in sorted((ROOT / "hybridgnn").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
            if CORE not in p.parents]


def test_the_engine_has_private_parts_to_protect():
    names = private_engine_names()
    assert {"_admission", "_pipelines", "_router", "_batcher", "_resources", "_pending"} <= names


def test_nothing_outside_the_engine_touches_its_private_parts():
    bad = touches(outside_core(), private_engine_names())
    assert not bad, "use the engine's public methods or snapshot():\n" + "\n".join(bad)


def test_the_check_finds_a_private_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def depth(engine, self):\n    self._pipelines = 1\n    return engine._pipelines['cpu'].depth\n")
    assert touches([probe], private_engine_names(), root=tmp_path) == ["probe.py:3 reads ._pipelines"]
