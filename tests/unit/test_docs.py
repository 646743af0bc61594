"""README.md and docs/*.md against the code and each other: docs/cli.md names every flag
`--help` prints and no flag in its tables that the command lacks, and each table's default
is the parser's (the README's serve table too); its tables have no rows cut off from them;
every relative link resolves to a file and a heading; every repository path a page names
exists, and architecture.md's package table places every top-level module; api.md's
status table lists every status errors.py and the HTTP layer answer; and no page points
into the repository's working notes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hybridgnn.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI = ROOT / "docs" / "cli.md"
GLOBAL = {"--help", "--log-level"}  # every command's; cli.md says so once at the top


def _parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict:
    out = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_parsers(sub, prefix + (name,)))
    return out


def _sections() -> dict[str, str]:
    parts = re.split(r"^## `hybridgnn ([^`]+)`\n", CLI.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def _flags_of(command: str) -> set[str]:
    flags = set()
    for path, parser in _parsers(build_parser()).items():
        if " ".join(path) == command or " ".join(path).startswith(command + " "):
            for action in parser._actions:
                flags.update(o for o in action.option_strings if o.startswith("--"))
    return flags - GLOBAL


def test_cli_md_has_a_section_for_every_command():
    commands = {" ".join(p) for p in _parsers(build_parser()) if len(p) == 1}
    documented = {name.split()[0] for name in _sections()}
    assert commands <= documented, f"no section in docs/cli.md for {sorted(commands - documented)}"


@pytest.mark.parametrize("command", sorted(_sections()))
def test_cli_md_names_every_flag_and_no_other_in_its_tables(command):
    section, flags = _sections()[command], _flags_of(command)
    assert flags, f"`hybridgnn {command}` is no command"
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", section))
    assert not flags - named, f"`hybridgnn {command} --help` has flags docs/cli.md never names: {sorted(flags - named)}"
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `-")]
    in_tables = {f for cell in rows for f in re.findall(r"`(--[a-z][\w-]*)", cell)}
    assert not in_tables - flags, f"docs/cli.md tables `hybridgnn {command}` flags it lacks: {sorted(in_tables - flags)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_table_rows_stay_in_their_table(page):
    lines = page.read_text().splitlines()
    fence = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("|"):
            continue
        starts_table = i + 1 < len(lines) and re.match(r"^\|\s*:?-{3,}", lines[i + 1])
        assert starts_table or (i and lines[i - 1].startswith("|")), \
            f"{page.name}:{i + 1}: a table row outside any table: {line[:60]}"


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_points_into_working_notes(page):
    text = page.read_text()
    assert not re.search(r"(?<![/\w])shared/|DESIGN\.md", text), \
        f"{page.name} points at shared/ or DESIGN.md, which users do not get"


def _section(page: Path, heading: str) -> str:
    return page.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_operations_md_lists_every_metric_and_no_other():
    # The metric table against what a server exposes (every collector, front ends included).
    from prometheus_client.parser import text_string_to_metric_families

    from hybridgnn.telemetry.metrics import Telemetry

    telemetry = Telemetry()
    telemetry.declare(("cpu", "gpu"))
    telemetry.frontends(lambda: {0: {"connections": 1, "rss_bytes": 1, "requests": 1, "cpu_s": 1.0}})
    exposed = {f.name + ("_total" if f.type == "counter" else "")
               for f in text_string_to_metric_families(telemetry.exposition()[0].decode())
               if not f.name.endswith("_created")}
    documented = set(re.findall(r"`(hybridgnn_[a-z_]+)`", _section(ROOT / "docs" / "operations.md", "Metrics")))
    assert not exposed - documented, f"operations.md's metrics lack {sorted(exposed - documented)}"
    assert not documented - exposed, f"operations.md lists metrics no server exposes: {sorted(documented - exposed)}"


def test_operations_md_says_what_to_do_for_every_alert():
    yaml = pytest.importorskip("yaml")
    groups = yaml.safe_load((ROOT / "dashboards" / "rules" / "hybridgnn.rules.yml").read_text())["groups"]
    alerts = {r["alert"]: r["labels"]["severity"] for g in groups for r in g["rules"] if "alert" in r}
    rows = {}
    for line in _section(ROOT / "docs" / "operations.md", "Dashboards and alerts").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`Hybridgnn\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(alerts), f"alerts in the rules {sorted(alerts)}, in operations.md {sorted(rows)}"
    for name, (_, fires_when, severity, what_to_do) in rows.items():
        assert severity == alerts[name] and fires_when and len(what_to_do) > 40, name


# --- paths: every file or folder of the repository a page names exists ------------------

_ROOT_DIRS = ("bench/", "dashboards/", "deploy/", "examples/", "hybridgnn/", "scripts/", "tests/")
_CODE_SUFFIXES = (".py", ".sh", ".cpp", ".h")


def _repository_paths() -> list[str]:
    return [p.relative_to(ROOT).as_posix() + ("/" if p.is_dir() else "")
            for base in _ROOT_DIRS for p in (ROOT / base).rglob("*") if "__pycache__" not in p.parts]


def _named_paths(text: str, folders: bool) -> set[str]:
    """Backticked repository paths a page names: code files anywhere, any path under a
    top-level folder of the repository, and (folders) package folders such as `core/`."""
    names = set()
    for token in re.findall(r"`([\w./@-]+)`", text):
        if "<" in token or token.startswith("."):
            continue
        if token.endswith(_CODE_SUFFIXES) or token.startswith(_ROOT_DIRS) or (folders and token.endswith("/")):
            names.add(token)
    return names


def _resolves(token: str, paths: list[str]) -> bool:
    """A path from the repository's root (bench/x.py), or, for one named in its context
    (`serving/frontend.py`, `core/`, `loader.py`), the end of a path in the package or the tests."""
    if (ROOT / token).exists():
        return True
    if token.startswith(_ROOT_DIRS):
        return False
    return any(p == token or p.endswith("/" + token) for p in paths)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(page):
    paths = _repository_paths()
    missing = sorted(t for t in _named_paths(page.read_text(), page.name == "architecture.md")
                     if not _resolves(t, paths))
    assert not missing, f"{page.name} names paths the repository does not have: {missing}"


def test_a_renamed_module_is_caught():
    paths = [p for p in _repository_paths() if not p.endswith("/process_pipeline.py")]
    assert not _resolves("pipelines/process_pipeline.py", paths)
    assert not _resolves("bench/no_such_bench.py", paths)
    assert _resolves("serving/v2/lookups.py", paths) and _resolves("core/", paths)


def test_architecture_md_places_every_top_level_module_of_the_package():
    table = _section(ROOT / "docs" / "architecture.md", "Package layers").split("| package | holds |", 1)[1]
    rows = [line.split("|")[1] for line in table.split("\n\n", 1)[0].splitlines() if line.startswith("| `")]
    named = {t.rstrip("/").removesuffix(".py") for cell in rows for t in re.findall(r"`([\w./]+)`", cell)}
    package = {p.name.removesuffix(".py") for p in (ROOT / "hybridgnn").iterdir()
               if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists()
                                               or any(p.glob("*.py")))}
    assert named == package, (f"architecture.md's package table lacks {sorted(package - named)}, "
                              f"names {sorted(named - package)} the package does not have")


# --- cli.md's (and the README's) defaults are the parsers' -----------------------------------------------------

def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _documented_defaults() -> list[tuple[str, str, str]]:
    """(command, flag, the default the page gives it) for every flag in a table row of
    cli.md and of the README's `hybridgnn serve` table."""
    out = []
    readme = (ROOT / "README.md").read_text().split("\n### `hybridgnn serve`\n", 1)[1].split("\n### ", 1)[0]
    for command, section in [*_sections().items(), ("serve", readme)]:
        for line in section.splitlines():
            if not line.startswith("| `-"):
                continue
            first, default = _cells(line)[:2]
            flags = re.findall(r"`(--[a-z][\w-]*)", first)
            values = [v.strip() for v in default.split(",")] if len(flags) > 1 else [default]
            if len(values) == len(flags):
                out.extend((command, flag, re.sub(r"\s*\(.*\)$", "", value).strip("`"))  # "0 (keep every entry)"
                           for flag, value in zip(flags, values, strict=True))
    return out


def _default_says(text: str, default) -> bool:
    """Whether cli.md's default column says the parser's default."""
    from hybridgnn.config.settings import parse_bytes

    if isinstance(default, bool):  # a switch: off, or for a --no-x flag "x on"
        return text == "off" if not default else text.endswith(" on")
    if isinstance(default, int | float):
        try:
            return float(text) == float(default)
        except ValueError:
            return parse_bytes(text) == default if text[-1:] in "KMG" else False
    return text == str(default)


def test_cli_md_and_readme_give_every_flag_the_default_its_parser_has(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("HYBRIDGNN_")]:  # defaults as shipped
        monkeypatch.delenv(name)
    parsers = _parsers(build_parser())
    rows, wrong = _documented_defaults(), []
    for command, flag, text in rows:
        action = next(a for a in parsers[tuple(command.split())]._actions if flag in a.option_strings)
        if action.default is None or action.default == "":  # decided at start: the column says how
            continue
        if not _default_says(text, action.default):
            wrong.append(f"{command} {flag}: the docs say {text!r}, the parser {action.default!r}")
    assert len(rows) > 90, f"only {len(rows)} documented defaults found: is cli.md's table layout still parsed?"
    assert not wrong, "\n".join(wrong)


def test_help_shows_every_flags_default(monkeypatch):
    """cli.md: `--help` prints every flag with its default. The formatter leaves "(default: X)"
    off a help that says "default" itself, so such a help must name the value:
    --srpe-gamma's "default share of ..." showed no 0.1."""
    import os

    for name in [n for n in os.environ if n.startswith("HYBRIDGNN_")]:  # defaults as shipped
        monkeypatch.delenv(name)
    silent = []
    for path, parser in _parsers(build_parser()).items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS
                    or action.default in (None, "", argparse.SUPPRESS)):
                continue  # positionals, switches, and values decided at start (the help says how)
            text = formatter._get_help_string(action) % {"default": action.default}
            if str(action.default) not in text.split("default", 1)[-1] and f"{action.default} (default)" not in text:
                silent.append(f"hybridgnn {' '.join(path)} {action.option_strings[0]}: {text[-80:]!r}")
    assert not silent, "--help hides these defaults:\n" + "\n".join(silent)


def test_a_default_that_drifted_is_caught():
    assert _default_says("1G", 1 << 30) and _default_says("0.5", 0.5) and _default_says("off", False)
    assert _default_says("spill on", True) and _default_says("run/cluster", Path("run/cluster"))
    assert not _default_says("30", 60.0) and not _default_says("on", False) and not _default_says("uva", "gpu")


def test_api_md_lists_every_status_the_api_and_the_http_layer_answer():
    """api.md said every status came from errors.py; 408, 417, 431 and 505 come from the
    HTTP layer (serving/http/), and each must have a row in its status table too."""
    import hybridgnn.errors as errors

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    api = {getattr(c, "status") for c in subclasses(errors.ServingError)} | {errors.ServingError.status}
    http = set()
    for path in (ROOT / "hybridgnn" / "serving" / "http").glob("*.py"):
        http |= {int(s) for s in re.findall(r"(?:Reject|_refuse|Reply\.error)\(\s*(\d{3})\b", path.read_text())}
    assert {408, 417, 431, 505} <= http  # the pattern still finds them
    table = _section(ROOT / "docs" / "api.md", "Errors")
    rows = {int(s) for s in re.findall(r"^\| (\d{3}) \|", table, flags=re.M)}
    assert api | http <= rows, f"api.md's status table lacks {sorted((api | http) - rows)}"
