"""Dashboards, rules and deployment files, checked by the real validators."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys

import pytest

from hybridgnn.deploy.balancer import check_command, render_haproxy, render_nginx
from tests.support.ops_tools import (
    DASHBOARDS,
    DEPLOY,
    ROOT,
    VENV_BIN,
    assert_ok,
    require_tool,
    run_tool,
)

jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

DASHBOARD = DASHBOARDS / "hybridgnn.json"
SCHEMA = DASHBOARDS / "schema" / "grafana-dashboard.schema.json"
K8S = sorted((DEPLOY / "k8s").rglob("*.yaml"))
LOCAL = [f"127.0.0.1:{8001 + i}" for i in range(3)]


# --- Grafana -------------------------------------------------------------------------------
def test_dashboard_is_built_from_build_py():
    proc = subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--check"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def test_dashboard_validates_against_grafana_schema():
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    dash = json.loads(DASHBOARD.read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(dash)]
    assert not errors, "\n".join(errors)
    # The schema is strict: a misspelt field is caught, so the check above can fail.
    broken = copy.deepcopy(dash)
    broken["panels"][1]["gridpos"] = broken["panels"][1].pop("gridPos")
    assert list(validator.iter_errors(broken))


def test_dashboard_is_provisionable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "hybridgnn-overview" and "__inputs" not in dash and dash.get("id") is None
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance", "slo"} <= set(variables)
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" and t["expr"] for t in p["targets"]), p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("p50", "p99", "requests by code", "seeds", "routing share", "spills", "batch size",
                  "batch psgs", "queue depth", "cache hit", "slo", "ready", "replication lag", "staleness",
                  "front ends up", "front-end restarts", "front-end connections", "front-end cpu",
                  "front-end memory"):
        assert topic in titles, f"no panel on {topic}"


def test_all_jobs_are_the_jobs_with_hybridgnn_series():
    """The job variable's All is what its query finds (the jobs exposing hybridgnn_ready,
    whatever the scrape job is named), never ".*": up{job=~".*"} counted every target
    the Prometheus scrapes as a replica."""
    dash = json.loads(DASHBOARD.read_text())
    job = next(v for v in dash["templating"]["list"] if v["name"] == "job")
    assert job["query"]["query"].startswith("label_values(hybridgnn_") and job["includeAll"]
    assert "allValue" not in job
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for expr in exprs:  # every selector carries the variable
        for selector in re.findall(r"(?<![\w:])([a-z_]+)\{([^}]*)\}", expr):
            assert 'job=~"$job"' in selector[1], expr


def test_grafana_provisioning_files():
    ds = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus" and ds["datasources"][0]["uid"] == "prometheus"
    prov = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards" / "hybridgnn.yml").read_text())
    assert prov["providers"][0]["type"] == "file"
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    mounts = " ".join(compose["services"]["grafana"]["volumes"])
    assert prov["providers"][0]["options"]["path"] in mounts


# --- Prometheus ----------------------------------------------------------------------------
def test_rules_check_and_unit_tests():
    promtool = require_tool("promtool")
    assert_ok(run_tool(promtool, "check", "rules", "rules/hybridgnn.rules.yml", cwd=DASHBOARDS))
    assert_ok(run_tool(promtool, "test", "rules", "rules/hybridgnn.rules.test.yml", cwd=DASHBOARDS))


def test_prometheus_configs():
    promtool = require_tool("promtool")
    assert_ok(run_tool(promtool, "check", "config", "prometheus.yml", cwd=DASHBOARDS))
    # The compose config names rule paths inside the container, so only its syntax is checked here.
    assert_ok(run_tool(promtool, "check", "config", "--syntax-only", str(DEPLOY / "compose" / "prometheus.yml")))


# --- Load balancers ------------------------------------------------------------------------
def test_shipped_balancer_configs_are_the_renderers_output():
    assert (DEPLOY / "haproxy" / "haproxy.cfg").read_text() == render_haproxy("127.0.0.1:8000", LOCAL)
    assert (DEPLOY / "nginx" / "nginx.conf").read_text() == render_nginx("127.0.0.1:8000", LOCAL)
    compose = [f"replica{i + 1}:8000" for i in range(3)]
    assert (DEPLOY / "compose" / "haproxy.cfg").read_text() == render_haproxy("*:8000", compose,
                                                                             resolver="127.0.0.11:53")


def test_haproxy_accepts_configs():
    require_tool("haproxy")
    for path in (DEPLOY / "haproxy" / "haproxy.cfg", DEPLOY / "compose" / "haproxy.cfg"):
        assert_ok(run_tool(*check_command("haproxy", path)))


def test_nginx_accepts_config(tmp_path):
    require_tool("nginx")
    # The shipped file keeps its state in /var/lib; the same rendering with a temporary state dir is checked.
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx("127.0.0.1:8000", LOCAL, state_dir=tmp_path))
    assert_ok(run_tool(*check_command("nginx", conf)))


def test_balancer_rejects_broken_config(tmp_path):
    require_tool("haproxy")
    bad = tmp_path / "bad.cfg"
    bad.write_text(render_haproxy("127.0.0.1:8000", LOCAL).replace("balance roundrobin", "balance nosuchalgo"))
    assert run_tool(*check_command("haproxy", bad)).returncode != 0


# --- Kubernetes, compose, systemd ----------------------------------------------------------
@pytest.mark.parametrize("path", K8S, ids=[str(p.relative_to(DEPLOY)) for p in K8S])
def test_kubernetes_manifests_validate_strictly(path):
    tool = require_tool("kubernetes-validate")
    proc = run_tool(tool, "--strict", str(path))
    assert_ok(proc)
    if yaml.safe_load(path.read_text())["kind"] != "ServiceMonitor":  # a CRD: no schema in kubernetes-validate
        assert "passed" in proc.stdout + proc.stderr


def _k8s(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "k8s" / name).read_text())


@pytest.mark.parametrize("name", ["deployment.yaml", "cuda/deployment.yaml"])
def test_deployment_drain_contract(name):
    dep = _k8s(name)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(env["HYBRIDGNN_DRAIN_TIMEOUT_S"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
    labels = dep["spec"]["selector"]["matchLabels"]
    assert labels.items() <= pod.get("labels", dep["spec"]["template"]["metadata"]["labels"]).items()
    if "cuda" in name:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # the graph and model come from the shared read-only volume, not the demo
    mount = next(m for m in c["volumeMounts"] if m["name"] == "data")
    assert mount["readOnly"] and env["HYBRIDGNN_DATASET"].startswith(mount["mountPath"] + "/")
    assert env["HYBRIDGNN_MODEL_REPOSITORY"].startswith(mount["mountPath"] + "/")
    claim = next(v for v in pod["volumes"] if v["name"] == "data")["persistentVolumeClaim"]["claimName"]
    assert claim == _k8s("pvc.yaml")["metadata"]["name"]


def test_service_monitor_and_pdb_select_the_pods():
    pod_labels = _k8s("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    svc = _k8s("service.yaml")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    mon = _k8s("servicemonitor.yaml")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert _k8s("pdb.yaml")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert _k8s("hpa.yaml")["spec"]["scaleTargetRef"]["name"] == _k8s("deployment.yaml")["metadata"]["name"]


def test_compose_validates_against_compose_spec():
    tool = require_tool("check-jsonschema")
    assert_ok(run_tool(tool, "--builtin-schema", "vendor.compose-spec", str(DEPLOY / "compose" / "docker-compose.yml")))
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    assert {"replica1", "replica2", "replica3", "balancer", "prometheus", "grafana"} <= set(compose["services"])
    scrape = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["replica1:8000", "replica2:8000", "replica3:8000"]  # each replica, not the balancer


def test_systemd_unit_outlasts_the_drain(tmp_path):
    text = (DEPLOY / "systemd" / "hybridgnn@.service").read_text()
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", text, re.MULTILINE).group(1))
    assert stop > 30 and re.search(r"^KillSignal=SIGTERM", text, re.MULTILINE)
    assert re.search(r"^ExecStart=\S+/hybridgnn serve", text, re.MULTILINE)
    analyze = shutil.which("systemd-analyze")
    if analyze:  # not a Debian package the ops tests install; verified where systemd is present
        unit = tmp_path / "hybridgnn@.service"  # ExecStart pointed at this checkout's binary, which exists
        unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={VENV_BIN / 'hybridgnn'}", text, flags=re.MULTILINE))
        assert_ok(run_tool(analyze, "verify", str(unit)))


def test_dockerfiles_install_cpu_torch_first():
    cpu = (DEPLOY / "docker" / "Dockerfile.cpu").read_text()
    assert cpu.index("torch==") < cpu.index("pip install .") and "whl/cpu" in cpu
    cuda = (DEPLOY / "docker" / "Dockerfile.cuda").read_text()
    assert cuda.index("torch==") < cuda.index("pip install .") and "whl/cu" in cuda
    assert (ROOT / ".dockerignore").exists()
