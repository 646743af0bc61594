"""`hybridgnn serve --device emulate`: both pipelines in a real server process (the GPU
pipeline's code on CPU tensors), routed by PSGS, under concurrent clients."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

from hybridgnn.workload.tables import WorkloadTables
from hybridgnn.graph.store import GraphStore
from tests.integration.server import ServerProcess


def test_hybrid_server_routes_small_batches_to_cpu_and_large_ones_to_the_gpu_pipeline(tiny_dataset, tiny_model):
    graph = GraphStore.open(tiny_dataset)
    psgs = WorkloadTables.load_or_build(graph, (5, 3)).psgs
    threshold = float(np.sort(psgs)[-40:].sum())  # only batches of many heavy seeds exceed it
    srv = ServerProcess(tiny_dataset, tiny_model, "--fanouts", "5,3", "--device", "emulate", "--gpu-workers", "2",
                        "--psgs-threshold", str(threshold), "--gpu-cache-bytes", "64K",
                        "--max-wait-ms", "0").wait_ready()
    try:
        meta = requests.get(f"{srv.url}/v2/models/hybridgnn", timeout=10).json()["parameters"]
        assert meta["pipelines"] == ["cpu", "gpu"] and meta["psgs_threshold"] == threshold
        heavy = np.argsort(-psgs)[:400].tolist()

        def infer(ids):
            body = {"inputs": [{"name": "node_ids", "shape": [len(ids)], "datatype": "INT64", "data": ids}]}
            r = requests.post(f"{srv.url}/v2/models/hybridgnn/infer", json=body, timeout=30)
            return r.status_code, r.json()["outputs"][0]["shape"][0]

        work = [[i] for i in range(30)] + [heavy] * 5
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(infer, work))
        assert results == [(200, len(ids)) for ids in work]
        text = requests.get(f"{srv.url}/metrics", timeout=10).text
        routed = {(s.labels["pipeline"], s.labels["reason"]): s.value
                  for f in text_string_to_metric_families(text) if f.name == "hybridgnn_routing_decisions"
                  for s in f.samples if s.name.endswith("_total")}
        assert routed[("gpu", "threshold")] >= 1 and routed[("cpu", "threshold")] >= 1
    finally:
        assert srv.stop() == 0
