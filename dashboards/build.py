#!/usr/bin/env python3
"""Builds dashboards/hybridgnn.json, the Grafana dashboard of a hybridgnn fleet.

The dashboard is written from this file so panels stay consistent (one selector, one
rate window, one layout rule); edit here, run `python dashboards/build.py`, commit both.
`--check` exits 1 when the committed JSON differs from what this file builds (CI runs it).

Every expression uses only metrics from hybridgnn/telemetry/metrics.py; the ops tests run
each one against a real Prometheus scraping real replicas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

UID = "hybridgnn-overview"
OUT = Path(__file__).with_name("hybridgnn.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
RATE = "$__rate_interval"
# Bucket bounds of hybridgnn_stage_seconds, so `le="$slo"` always names a real bucket.
SLO_CHOICES = ("0.01", "0.02", "0.05", "0.1", "0.25", "0.5")
SLO_DEFAULT = "0.05"
TOTAL = 'stage="total"'
WITHIN_SLO = 'stage="total", le="$slo"'
CODE_5XX = 'code=~"5.."'
MOVED = 'reason=~"spill|fallback"'
GPU_TIER = 'tier="gpu"'


# Series labelled with the model and version that answered (a model repository serves several).
BY_MODEL = ("hybridgnn_requests_total", "hybridgnn_seeds_total", "hybridgnn_stage_seconds_bucket",
            "hybridgnn_stage_seconds_count")
MODEL_SEL = 'model=~"$model", version=~"$version"'


def rate(metric: str, extra: str = "") -> str:
    sel = SEL + (", " + MODEL_SEL if metric in BY_MODEL else "") + (", " + extra if extra else "")
    return f"rate({metric}{{{sel}}}[{RATE}])"


def quantile(q: float, by: str, extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate('hybridgnn_stage_seconds_bucket', extra)}))"


# (title, description, unit, [(expr, legend)], kind) per panel; kind picks the panel type.
PANELS: list[tuple[str, list[tuple]]] = [
    ("Fleet", [
        ("Replicas up / ready", "Scrape targets answering, and replicas accepting requests (0 while draining).",
         "none", [(f"sum(up{{{SEL}}})", "up"), (f"sum(hybridgnn_ready{{{SEL}}})", "ready")], "stat"),
        ("SLO compliance", "Share of answered requests with server-side latency (stage total) within the $slo s SLO.",
         "percentunit",
         [((f"sum({rate('hybridgnn_stage_seconds_bucket', WITHIN_SLO)}) / "
           f"sum({rate('hybridgnn_stage_seconds_count', TOTAL)})"), "within SLO")], "stat"),
        ("Requests by code", "Answered requests per second by HTTP status.", "reqps",
         [(f"sum by (code) ({rate('hybridgnn_requests_total')})", "{{code}}")], "timeseries"),
        ("Error ratio", "5xx answers over all answers.", "percentunit",
         [(f"sum({rate('hybridgnn_requests_total', CODE_5XX)}) / sum({rate('hybridgnn_requests_total')})",
           "5xx share")], "timeseries"),
        ("Seeds per second", "Seed nodes answered per second.", "short",
         [(f"sum({rate('hybridgnn_seeds_total')})", "seeds/s")], "timeseries"),
        ("Requests by model and version", "Answered requests per second per model version (a model repository "
         "serves several).", "reqps",
         [(f"sum by (model, version) ({rate('hybridgnn_requests_total')})", "{{model}} v{{version}}")],
         "timeseries"),
        ("Rejected requests", ("Requests refused before admission: overload (429), draining (503), reads "
         "behind their min_graph_version (503), gRPC calls past the cap on those in flight "
         "(grpc_call_cap: RESOURCE_EXHAUSTED), and HTTP connections past --max-connections "
         "(connection_cap: 503)."), "reqps",
         [(f"sum by (reason) ({rate('hybridgnn_rejected_requests_total')})", "{{reason}}")], "timeseries"),
    ]),
    ("Latency", [
        ("Stage latency p50", "Median per serving stage and pipeline.", "s",
         [(quantile(0.5, "stage, pipeline"), "{{pipeline}} {{stage}}")], "timeseries"),
        ("Stage latency p99", "99th percentile per serving stage and pipeline.", "s",
         [(quantile(0.99, "stage, pipeline"), "{{pipeline}} {{stage}}")], "timeseries"),
        ("Server p99 by replica", "Server-side request latency (stage total: from its turn on the event loop to its answer) per replica against the SLO.", "s",
         [(quantile(0.99, "instance", 'stage="total"'), "{{instance}}"),
          (f"max(hybridgnn_ready{{{SEL}}}) * 0 + $slo", "SLO")], "timeseries"),
    ]),
    ("Scheduling", [
        ("Routing share", "Share of batches each pipeline ran (CPU vs GPU).", "percentunit",
         [((f"sum by (pipeline) ({rate('hybridgnn_routing_decisions_total')}) / ignoring (pipeline) group_left "
           f"sum({rate('hybridgnn_routing_decisions_total')})"), "{{pipeline}}")], "timeseries"),
        ("Spills, fallbacks and batch errors", ("Batches moved to the other pipeline because theirs was saturated "
         "(spill) or failed (fallback), and batches that failed."), "ops",
         [(f"sum by (pipeline, reason) ({rate('hybridgnn_routing_decisions_total', MOVED)})",
           "{{reason}} to {{pipeline}}"),
          (f"sum by (pipeline) ({rate('hybridgnn_batch_errors_total')})", "errors on {{pipeline}}")], "timeseries"),
        ("Batch size (seeds)", "Distribution of seeds per executed batch.", "short",
         [(f"sum by (le) ({rate('hybridgnn_batch_size_seeds_bucket')})", "{{le}}")], "heatmap"),
        ("Batch PSGS", "Distribution of batch PSGS, the routing key.", "short",
         [(f"sum by (le) ({rate('hybridgnn_batch_psgs_bucket')})", "{{le}}")], "heatmap"),
        ("Queue depth", "Batches queued or running per pipeline, and admitted requests over capacity.", "short",
         [(f"sum by (instance, pipeline) (hybridgnn_queue_depth_batches{{{SEL}}})", "{{instance}} {{pipeline}}"),
          ((f"sum by (instance) (hybridgnn_pending_requests{{{SEL}}}) / "
           f"sum by (instance) (hybridgnn_pending_capacity_requests{{{SEL}}})"), "{{instance}} pending/capacity")],
         "timeseries"),
        ("GPU feature-cache hit ratio", "Feature rows served from GPU memory over all rows gathered.", "percentunit",
         [((f"sum by (pipeline) ({rate('hybridgnn_gathered_rows_total', GPU_TIER)}) / "
           f"sum by (pipeline) ({rate('hybridgnn_gathered_rows_total')})"), "{{pipeline}}")], "timeseries"),
        ("PSGS threshold", "Threshold in force: batches below it run on CPU (+Inf: CPU only).", "short",
         [(f"hybridgnn_psgs_threshold{{{SEL}}}", "{{instance}}")], "timeseries"),
    ]),
    ("Graph updates", [
        ("Replication lag", ("Per replica: age of the oldest update-log entry it has read but not applied "
         "(0: caught up). Reads with min_graph_version wait for it."), "s",
         [(f"hybridgnn_update_log_lag_seconds{{{SEL}}}", "{{instance}}")], "timeseries"),
        ("Embedding staleness", ("Per replica: age of the oldest graph update it accepted that its answers do not "
         "reflect yet (queued, being logged, or logged and not applied here; 0: fresh)."), "s",
         [(f"hybridgnn_embedding_staleness_seconds{{{SEL}}}", "{{instance}}")], "timeseries"),
        ("Update log position", "Graph version (log position) each replica has applied, and the highest it has read.",
         "short",
         [(f"hybridgnn_update_log_position{{{SEL}}}", "{{instance}} applied"),
          (f"max(hybridgnn_update_log_head{{{SEL}}})", "log head seen")], "timeseries"),
        ("Update batches", "Log entries applied and update requests rejected per second, over the fleet.", "ops",
         [(f"sum by (outcome) ({rate('hybridgnn_graph_update_batches_total')})", "{{outcome}}")], "timeseries"),
        ("Update follower failing", "1 while a replica cannot read or apply the update log (it retries).", "short",
         [(f"hybridgnn_update_follower_failing{{{SEL}}}", "{{instance}}")], "timeseries"),
    ]),
    # Series of front-end processes exist only on replicas serving with --frontends N > 1.
    ("Front ends", [
        ("Front ends up", ("Per replica: front-end processes linked to the engine, of those it runs "
         "(serve --frontends N; empty without front-end processes)."), "short",
         [(f"sum by (instance) (hybridgnn_frontend_up{{{SEL}}})", "{{instance}} up"),
          (f"count by (instance) (hybridgnn_frontend_up{{{SEL}}})", "{{instance}} running")], "timeseries"),
        ("Front-end restarts", "Times each front-end process was started again, over the last 15 minutes.", "short",
         [(f"increase(hybridgnn_frontend_restarts_total{{{SEL}}}[15m])", "{{instance}} #{{frontend}}")],
         "timeseries"),
        ("Front-end connections", "Open client connections per front end, and connections refused past its share "
         "of --max-connections (per second).", "short",
         [(f"hybridgnn_frontend_connections{{{SEL}}}", "{{instance}} #{{frontend}} open"),
          (f"sum by (instance, frontend) ({rate('hybridgnn_frontend_refused_connections_total')})",
           "{{instance}} #{{frontend}} refused/s")], "timeseries"),
        ("Front-end requests", "Requests each front end sent on to the engine (inferences, gRPC calls, "
         "everything it forwards), per second.", "reqps",
         [(f"sum by (instance, frontend) ({rate('hybridgnn_frontend_requests_total')})",
           "{{instance}} #{{frontend}}")], "timeseries"),
        ("Front-end CPU", "CPU time of each front-end process per second (1 = one core busy).", "percentunit",
         [(f"sum by (instance, frontend) ({rate('hybridgnn_frontend_cpu_seconds_total')})",
           "{{instance}} #{{frontend}}")], "timeseries"),
        ("Front-end memory", "Resident memory of each front-end process.", "bytes",
         [(f"hybridgnn_frontend_resident_memory_bytes{{{SEL}}}", "{{instance}} #{{frontend}}")], "timeseries"),
    ]),
    ("Engine process", [
        ("Engine CPU", "CPU time of each replica's engine process per second (1 = one core busy; its worker "
         "processes and front ends not included).", "percentunit",
         [(f"sum by (instance) ({rate('hybridgnn_engine_cpu_seconds_total')})", "{{instance}}")], "timeseries"),
        ("Engine memory", "Resident memory of each replica's engine process (the pages of the graph it has read "
         "included): steady once warm; growth under a steady load is a leak.", "bytes",
         [(f"hybridgnn_engine_resident_memory_bytes{{{SEL}}}", "{{instance}}")], "timeseries"),
    ]),
]


def _panel(pid: int, title: str, desc: str, unit: str, targets: list[tuple], kind: str, pos: dict) -> dict:
    panel = {
        "id": pid, "type": kind, "title": title, "description": desc, "datasource": DS, "gridPos": pos,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                     **({"format": "heatmap"} if kind == "heatmap" else {})}
                    for i, (expr, legend) in enumerate(targets)],
    }
    if kind == "heatmap":
        panel["options"] = {"calculate": False, "yAxis": {"unit": unit}}
    return panel


def _variables() -> list[dict]:
    def query_var(name: str, label: str, query: str, match_all: bool = True) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "query": {"query": query, "refId": f"{name}-var"},
                "refresh": 2, "includeAll": True, "multi": True, **({"allValue": ".*"} if match_all else {}),
                "current": {"text": "All", "value": "$__all"}, "sort": 1}

    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {"text": "Prometheus", "value": "prometheus"}},
        # All jobs: those with hybridgnn series, whatever the scrape job is named (no ".*", which
        # would make up{} count every target the Prometheus scrapes)
        query_var("job", "Job", "label_values(hybridgnn_ready, job)", match_all=False),
        query_var("instance", "Replica", 'label_values(hybridgnn_ready{job=~"$job"}, instance)'),
        query_var("model", "Model", 'label_values(hybridgnn_requests_total{job=~"$job"}, model)'),
        query_var("version", "Version", 'label_values(hybridgnn_requests_total{job=~"$job", model=~"$model"}, version)'),
        {"name": "slo", "label": "Latency SLO (s)", "type": "custom", "query": ",".join(SLO_CHOICES),
         "current": {"text": SLO_DEFAULT, "value": SLO_DEFAULT},
         "options": [{"text": v, "value": v, "selected": v == SLO_DEFAULT} for v in SLO_CHOICES]},
    ]


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in PANELS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (title, desc, unit, targets, kind) in enumerate(row_panels):
            w = 8 if kind == "stat" else 12
            x = (i % 2) * 12 if kind != "stat" else (i % 3) * 8
            pos = {"h": 4 if kind == "stat" else 8, "w": w, "x": x, "y": y}
            panels.append(_panel(pid, title, desc, unit, targets, kind, pos))
            pid += 1
            if x + w >= 24 or i == len(row_panels) - 1 or (kind == "stat" and row_panels[i + 1][4] != "stat"):
                y += pos["h"]
    return {
        "uid": UID, "title": "hybridgnn", "description": "hybridgnn GNN inference fleet: latency, load, routing.",
        "tags": ["hybridgnn", "gnn", "inference"], "editable": True, "graphTooltip": 1, "schemaVersion": 39,
        "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "annotations": {"list": []}, "links": [], "templating": {"list": _variables()}, "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed dashboard is out of date")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python dashboards/build.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
