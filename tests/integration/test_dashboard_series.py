"""Every series the Grafana dashboard and the Prometheus rules select exists in the
exposition of a real server, in each configuration they apply to: a query naming a
series no server has is a panel that stays empty, or an alert that can never fire,
without any error. And no request, however odd its model, version or path, adds a series.

tests/ops/test_prometheus.py runs the same expressions in a real Prometheus, for the
default configuration; this checks the other configurations without one."""

from __future__ import annotations

import shutil

import pytest
import requests

from tests.support.promql import recorded_names_are_defined, unmatched
from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

TOKEN = "dashboard-series-token"
CONFIGS = {
    "default": (),
    "frontends2_updates": ("--frontends", "2", "--update-token", TOKEN),
    "emulate": ("--device", "emulate"),
    "repository": ("--update-token", TOKEN),
    "partitions2": ("--partitions", "2", "--partition", "ranges"),
}


def _series(text: str) -> set[str]:
    return {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def _infer(url: str, model: str, ids: list[int], path: str = "") -> int:
    body = {"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)], "data": ids}]}
    return requests.post(f"{url}/v2/models/{model}{path}/infer", json=body, timeout=60).status_code


def test_recorded_series_the_alerts_use_are_recorded():
    assert not recorded_names_are_defined()


def test_a_selector_that_names_a_missing_series_or_label_is_caught():
    # the check itself: an exposition without what a panel selects fails it
    text = "\n".join(["# TYPE hybridgnn_ready gauge", "hybridgnn_ready 1.0", ""])
    problems = "\n".join(unmatched(text))
    assert "hybridgnn_pending_capacity_requests" in problems and "selects nothing" in problems
    assert "Spills, fallbacks" in problems
    # front-end panels and alerts are asked of servers with front-end processes only
    for where in ("panel 'Front ends up'", "panel 'Front-end memory'", "rule HybridgnnFrontendRestarting"):
        assert where in problems
        assert where not in "\n".join(unmatched(text, frontends=False))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_dashboard_and_rule_selector_matches_a_real_servers_series(config, tiny_dataset, tiny_model_pe,
                                                                         tmp_path):
    models = ["hybridgnn"]
    model = tiny_model_pe
    extra = list(CONFIGS[config])
    if config == "repository":  # two models, as a repository serves them
        models = ["alpha", "beta"]
        for name in models:
            shutil.copytree(tiny_model_pe, tmp_path / "repo" / name / "1")
        model, extra = None, ["--model-repository", str(tmp_path / "repo"), *extra]
    if "--update-token" in extra and model is not None:  # its own log, not the shared dataset's (a
        # repository's token guards loads: no graph updates, and an update log is refused)
        extra += ["--update-log", str(tmp_path / "updates.log")]
    server = ServerProcess(tiny_dataset, model, "--workers", "1", *extra).wait_ready(180)
    try:
        first = requests.get(server.url + "/metrics", timeout=10).text
        # front-end processes: asked for, or started by --frontends auto on a machine with cores to spare
        frontends = "--frontends" in extra or "hybridgnn_frontend_up{" in first
        assert not unmatched(first, frontends), "at the first scrape:\n" + "\n".join(unmatched(first, frontends))
        if "--frontends" in extra:  # ready once one front end listens: each has its series from then on
            assert all(f'hybridgnn_frontend_up{{frontend="{i}"}}' in first for i in range(2)), first
        for name in models:
            for ids in ([1, 2, 3], [4], [5, 6]):
                assert _infer(server.url, name, ids) == 200
        assert _infer(server.url, models[0], [10**9]) == 400
        if "--update-token" in extra and config != "repository":
            update = {"inputs": [{"name": "add_edges", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}]}
            r = requests.post(f"{server.url}/v2/models/{models[0]}/graph", json=update, timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200, r.text
        served = requests.get(server.url + "/metrics", timeout=10).text
        assert not unmatched(served, frontends), "after requests:\n" + "\n".join(unmatched(served, frontends))

        # Labels stay a small fixed set: made-up models, versions and paths add no series.
        for i in range(5):
            made_up = f"made-up-{i}-{config}"
            assert _infer(server.url, made_up, [1]) == 404
            assert _infer(server.url, models[-1], [1], f"/versions/{made_up}") == 404
            assert _infer(server.url, models[-1], [1], f"/versions/{90 + i}") == 404
            requests.post(f"{server.url}/v2/models/{made_up}/infer", data=b"{not json", timeout=30)
            requests.get(f"{server.url}/{made_up}/%2e%2e/metrics?{made_up}", timeout=30)
            requests.get(f"{server.url}/metrics/{made_up}", timeout=30)
        after = requests.get(server.url + "/metrics", timeout=10).text
        assert _series(after) == _series(served)
        assert "made-up" not in after
    finally:
        assert server.stop() == 0, server.output()
