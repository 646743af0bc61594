"""The series the dashboard and the Prometheus rules select, checked against a server's
exposition without a Prometheus: a query naming a metric, a label value or a label that
no series has is a panel that stays empty or an alert that can never fire, silently.

Selectors are read from the PromQL with a regular expression (metric names are those
starting with hybridgnn_; the dashboard's variables are substituted as Grafana would),
which covers the plain selectors, aggregations and label_values() the files use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
# What Grafana puts in for the dashboard's variables (All for the multi-value ones).
VARIABLES = {"$__rate_interval": "15s", "$job": ".*", "$instance": ".*", "$slo": "0.05", "$model": ".*",
             "$version": ".*"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = ("job", "instance")
# Series only a server with front-end processes (--frontends N > 1) exposes: the panels and
# alerts selecting them alone apply to such servers only.
FRONTEND_SERIES = "hybridgnn_frontend_"

_SELECTOR = re.compile(r"(?<![\w:])(hybridgnn_[a-zA-Z0-9_]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\)\s*$")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def queries() -> list[tuple[str, str, str]]:
    """(where, expr, legend) of every dashboard target, dashboard variable query and rule."""
    import yaml

    dash = json.loads((DASHBOARDS / "hybridgnn.json").read_text())
    out = [(f"panel {p['title']!r}", _substitute(t["expr"]), t.get("legendFormat", ""))
           for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if isinstance(v.get("query"), dict):
            out.append((f"variable ${v['name']}", _substitute(v["query"]["query"]), ""))
    groups = yaml.safe_load((DASHBOARDS / "rules" / "hybridgnn.rules.yml").read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        out.append((f"rule {rule.get('record') or rule.get('alert')}", rule["expr"], ""))
    return out


def _series(exposition: str) -> list[tuple[str, dict[str, str]]]:
    return [(s.name, s.labels) for f in text_string_to_metric_families(exposition) for s in f.samples]


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        if label in TARGET_LABELS and label not in labels:
            continue  # Prometheus adds it at scrape time; any value of the scrape config
        have = labels.get(label, "")
        hit = re.fullmatch(value, have) is not None if op in ("=~", "!~") else have == value
        if hit != (op in ("=", "=~")):
            return False
    return True


def unmatched(exposition: str, frontends: bool = True) -> list[str]:
    """What the dashboard and rules ask of this exposition that it does not have: a
    selector no series matches, or a label (in by/without/on/ignoring/group_*, a
    label_values() or a legend) that no series it selects carries. frontends=False: the
    server runs no front-end processes, so queries of their series alone are not asked."""
    series = _series(exposition)
    names = {n for n, _ in series}
    problems = []
    for where, expr, legend in queries():
        selected: set[str] = set(TARGET_LABELS)
        body, label_values = expr, None
        m = _LABEL_VALUES.search(expr)
        if m:
            body, label_values = m.group(1), m.group(2)
        selectors = _SELECTOR.findall(body)
        if not frontends and selectors and all(n.startswith(FRONTEND_SERIES) for n, _ in selectors):
            continue
        for name, braces in selectors:
            matchers = _MATCHER.findall(braces or "")
            hits = [labels for n, labels in series if n == name and _matches(labels, matchers)]
            if not hits:
                why = "" if name in names else " (no series of that name)"
                problems.append(f"{where}: {name}{braces} selects nothing{why}")
            for labels in hits:
                selected.update(labels)
        wanted = {lab.strip() for clause in _CLAUSE.findall(body) for lab in clause.split(",") if lab.strip()}
        wanted.update(_LEGEND.findall(legend))
        if label_values:
            wanted.add(label_values)
        for label in sorted(wanted - selected):
            if ":" not in body:  # recorded series keep what their rule kept; checked through the rule
                problems.append(f"{where}: label {label!r} is on no series it selects")
    return problems


def recorded_names_are_defined() -> list[str]:
    """Recorded series (names with a colon) that an expression uses but no rule records."""
    import yaml

    groups = yaml.safe_load((DASHBOARDS / "rules" / "hybridgnn.rules.yml").read_text())["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    used = {name for _, expr, _ in queries() for name in re.findall(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b", expr)}
    return sorted(used - recorded)
