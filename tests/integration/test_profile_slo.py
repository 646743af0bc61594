"""`hybridgnn profile` on a small graph, then `hybridgnn serve --profile --policy slo:<ms>`
under open-loop load: the measured p99 stays within the SLO."""

from __future__ import annotations

import json
import subprocess
import sys

import requests

from hybridgnn.bench.loadgen import run_load
from hybridgnn.capabilities import run_async
from tests.support.server import ServerProcess

SLO_MS = 60.0


def test_profile_then_serve_within_the_slo(tiny_dataset, tiny_model, tmp_path):
    out = tmp_path / "tiny.json"
    done = subprocess.run(
        [sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "profile", "--dataset", str(tiny_dataset),
         "--model", str(tiny_model), "--fanouts", "5,3", "--device", "emulate", "--bins", "6", "--min-samples", "15",
         "--max-batch", "256", "--budget-s", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert set(summary["points"]) == {"cpu_preferred", "gpu_preferred", "latency_preferred", "throughput_preferred"}
    assert out.with_suffix(".png").stat().st_size > 1000 and out.with_suffix(".svg").is_file()

    srv = ServerProcess(tiny_dataset, tiny_model, "--fanouts", "5,3", "--device", "emulate", "--profile", str(out),
                        "--policy", f"slo:{SLO_MS:g}").wait_ready()
    try:
        meta = requests.get(f"{srv.url}/v2/models/hybridgnn", timeout=10).json()["parameters"]
        assert meta["policy"] == f"slo:{SLO_MS:g}" and meta["max_batch_psgs"] != "inf"
        res = run_async(run_load(srv.url, "hybridgnn", rate=150, duration_s=4, nodes_per_request=4))
        assert res.ok == res.sent and res.p99_ms <= SLO_MS, res
        metrics = requests.get(f"{srv.url}/metrics", timeout=10).text
        assert f'hybridgnn_policy_info{{policy="slo:{SLO_MS:g}"}} 1.0' in metrics
    finally:
        assert srv.stop() == 0
