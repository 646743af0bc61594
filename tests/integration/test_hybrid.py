"""`hybridgnn serve --device emulate`: both pipelines in a real server process (the GPU
pipeline's code on CPU tensors), routed by PSGS, under concurrent clients. On a GPU
machine HYBRIDGNN_TEST_DEVICE=cuda runs the same tests with the real GPU pipeline."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

from hybridgnn.graph.store import GraphStore
from hybridgnn.workload.tables import WorkloadTables
from tests.support.server import ServerProcess

DEVICE = os.environ.get("HYBRIDGNN_TEST_DEVICE", "emulate")


def test_hybrid_server_routes_small_batches_to_cpu_and_large_ones_to_the_gpu_pipeline(tiny_dataset, tiny_model):
    graph = GraphStore.open(tiny_dataset)
    psgs = WorkloadTables.load_or_build(graph, (5, 3)).psgs
    threshold = float(np.sort(psgs)[-40:].sum())  # only batches of many heavy seeds exceed it
    srv = ServerProcess(tiny_dataset, tiny_model, "--fanouts", "5,3", "--device", DEVICE, "--gpu-workers", "2",
                        "--psgs-threshold", str(threshold), "--gpu-cache-bytes", "64K",
                        "--max-wait-ms", "0", "--max-queue-delay-ms", "60000").wait_ready()
    try:
        meta = requests.get(f"{srv.url}/v2/models/hybridgnn", timeout=10).json()["parameters"]
        assert meta["pipelines"] == ["cpu", "gpu"] and meta["psgs_threshold"] == threshold
        heavy = np.argsort(-psgs)[:400].tolist()

        def infer(ids):
            body = {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}]}
            r = requests.post(f"{srv.url}/v2/models/hybridgnn/infer", json=body, timeout=30)
            return r.status_code, r.json()["outputs"][0]["shape"][0]

        # Small requests first, then heavy ones: on a GPU the split CPU lane's batches on the
        # device count as the GPU's load, and heavy batches sent beside them spill (correctly)
        # to the CPU lane, so the phases are kept apart for the threshold route to show.
        small, large = [[i] for i in range(30)], [heavy] * 5
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(infer, small))
        with ThreadPoolExecutor(2) as pool:  # two GPU workers: never saturated (2 per worker)
            results += list(pool.map(infer, large))
        assert results == [(200, len(ids)) for ids in small + large]
        text = requests.get(f"{srv.url}/metrics", timeout=10).text
        routed = {(s.labels["pipeline"], s.labels["reason"]): s.value
                  for f in text_string_to_metric_families(text) if f.name == "hybridgnn_routing_decisions"
                  for s in f.samples if s.name.endswith("_total")}
        assert routed[("gpu", "threshold")] >= 1 and routed[("cpu", "threshold")] >= 1
    finally:
        assert srv.stop() == 0


def test_sighup_refreshes_the_gpu_cache_under_load_and_the_seed_log_feeds_place(tiny_dataset, tiny_model, tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time

    log = tmp_path / "seeds.counts.npy"
    srv = ServerProcess(tiny_dataset, tiny_model, "--fanouts", "5,3", "--device", DEVICE, "--psgs-threshold", "0",
                        "--gpu-cache-bytes", "16K", "--seed-log", str(log)).wait_ready()
    try:
        session = requests.Session()

        def infer(ids):
            body = {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}]}
            return session.post(f"{srv.url}/v2/models/hybridgnn/infer", json=body, timeout=30).status_code

        hot = list(range(2900, 2920))
        assert all(infer(hot) == 200 for _ in range(5))
        srv.proc.send_signal(signal.SIGHUP)
        codes = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # keep requesting until the refresh is counted
            codes.append(infer(hot[:5]))
            text = session.get(f"{srv.url}/metrics", timeout=10).text
            if "hybridgnn_placement_refreshes_total 1.0" in text:
                break
        else:
            raise AssertionError("the SIGHUP refresh never completed:\n" + srv.output())
        assert set(codes) == {200}
    finally:
        assert srv.stop() == 0
    counts = np.load(log)
    assert counts[2900:2920].sum() >= 100 and counts.shape == (3000,)
    done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "place", "--dataset",
                           str(tiny_dataset), "--fanouts", "5,3", "--from-log", str(log), "--topology",
                           str(_one_gpu_topology(tmp_path)), "--out", str(tmp_path / "plan")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from hybridgnn.features.placement import GPU, Plan

    plan = Plan.load(tmp_path / "plan")
    assert all(plan.tier[n] == GPU for n in range(2900, 2905))
    json.dumps(plan.summary(np.ones(3000)))


def _one_gpu_topology(tmp_path):
    path = tmp_path / "one-gpu.json"
    path.write_text('{"servers": 1, "gpus_per_server": 1, "gpu_memory_bytes": "32K", "host_memory_bytes": "1M"}')
    return path
