"""A real Prometheus scraping real replicas: every dashboard and rule expression runs and
returns data after load; promtool accepts the replicas' /metrics."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.support.cluster_load import Cluster, drive
from tests.support.ops_tools import DASHBOARDS, assert_ok, require_tool
from tests.support.server import free_port

yaml = pytest.importorskip("yaml")
pytestmark = [pytest.mark.ops, pytest.mark.slow]

# What Grafana would put in for the dashboard's variables.
VARIABLES = {"$__rate_interval": "15s", "$job": "hybridgnn", "$instance": ".*", "$slo": "0.05", "$model": ".*",
             "$version": ".*"}


def dashboard_exprs() -> list[str]:
    dash = json.loads((DASHBOARDS / "hybridgnn.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out = []
    for e in exprs:
        for var, value in VARIABLES.items():
            e = e.replace(var, value)
        assert "$" not in e, f"unsubstituted variable in {e}"
        out.append(e)
    return out


def rules() -> list[dict]:
    groups = yaml.safe_load((DASHBOARDS / "rules" / "hybridgnn.rules.yml").read_text())["groups"]
    return [r for g in groups for r in g["rules"]]


def as_bool(expr: str) -> str:
    """An alert condition as a 0/1 series (`x > 0.05` -> `x > bool 0.05`), so it returns
    data whether or not it fires."""
    return re.sub(r"(==|!=|>=|<=|>|<)\s*(-?[0-9.]+)", r"\1 bool \2", expr)


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{expr}: {exc.code} {exc.read().decode(errors='replace')}") from exc
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)  # poll interval; bounded by the deadline


def test_dashboard_and_rule_expressions_return_data(tiny_dataset, tiny_model, tmp_path):
    prometheus = require_tool("prometheus")
    promtool = require_tool("promtool")
    require_tool("haproxy")
    # with front-end processes, whose panels and alerts have data then only
    cluster = Cluster(tmp_path / "run", tiny_dataset, tiny_model, replicas=2, balancer="haproxy",
                      serve_args=("--frontends", "2", "--max-queue-delay-ms", "60000")).wait_ready()  # no 429 on a busy 2-core box
    prom = None
    try:
        # The shipped rules, evaluated every second instead of every 15 s so the test is short.
        rule_file = tmp_path / "hybridgnn.rules.yml"
        rule_file.write_text((DASHBOARDS / "rules" / "hybridgnn.rules.yml").read_text()
                             .replace("interval: 15s", "interval: 1s"))
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rule_file)],
            "scrape_configs": [{"job_name": "hybridgnn", "static_configs": [{"targets": cluster.backends}]}],
        }))
        assert_ok(subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True,
                                 check=False))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (lives with the process)
        prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=prom_log, stderr=subprocess.STDOUT)

        def prometheus_ready() -> bool:
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=1) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError, OSError):
                return False

        wait_for(prometheus_ready, "prometheus to start")
        wait_for(lambda: len(query(base, 'up{job="hybridgnn"} == 1')) == 2, "both replicas scraped")
        outcomes = drive(cluster.url + "/v2/models/hybridgnn/infer", concurrency=4, duration_s=4.0,
                         num_nodes=3000, actions=[], bad_every=10)
        ok = sum(o.status == 200 for o in outcomes)
        assert ok >= 50 and all(o.status in (200, 400) for o in outcomes)

        def scraped_all() -> bool:
            got = query(base, 'sum(hybridgnn_requests_total{code="200"})')
            return bool(got) and float(got[0]["value"][1]) >= ok

        wait_for(scraped_all, "the load to show up in prometheus")
        wait_for(lambda: bool(query(base, "job:hybridgnn_request_latency_seconds:p99_5m")), "recording rules")

        empty = []
        for expr in dashboard_exprs():
            if not query(base, expr):
                empty.append(expr)
        for rule in rules():
            if "record" in rule:
                if not query(base, rule["record"]):
                    empty.append(rule["record"])
            query(base, rule["expr"])  # the condition as written must evaluate
            if not query(base, as_bool(rule["expr"])):
                empty.append(as_bool(rule["expr"]))
        assert not empty, "expressions with no data after load:\n" + "\n".join(empty)

        # The dashboard's numbers agree with what the clients saw.
        codes = {r["metric"]["code"]: float(r["value"][1])
                 for r in query(base, "sum by (code) (hybridgnn_requests_total)")}
        assert codes["200"] == ok and codes["400"] == sum(o.status == 400 for o in outcomes)

        for backend in cluster.backends:
            with urllib.request.urlopen(f"http://{backend}/metrics", timeout=5) as r:
                text = r.read()
            lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, check=False)
            assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        assert cluster.stop() == 0
