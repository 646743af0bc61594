"""Files a user (or a damaged disk) hands the CLI, run as the command is: each bad one is
one error line and exit 2, never a traceback, a crash or a hang."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=timeout)


def _one_error_line(done: subprocess.CompletedProcess, command: str, *expected: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hybridgnn {command}: error: "), done.stderr[-2000:]
    for text in expected:
        assert text in lines[0], lines[0]


def test_serving_a_dataset_with_an_index_past_its_nodes_is_one_line_not_a_crash(tiny_dataset, tiny_model, tmp_path):
    """It was opened with quick validation, which read no index: the compiled sampler then
    read outside its arrays and the server died of a segmentation fault (exit -11)."""
    from tests.support.server import free_port

    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset, ignore=shutil.ignore_patterns("workload"))
    indices = np.load(dataset / "indices.npy")
    indices[7] = 1 << 30
    np.save(dataset / "indices.npy", indices)
    done = _cli("serve", "--dataset", str(dataset), "--model", str(tiny_model), "--device", "cpu",
                "--port", str(free_port()))
    _one_error_line(done, "serve", "indices must lie in [0, 3000)", str(1 << 30))


def test_serving_with_a_profile_naming_a_billion_workers_is_one_line_not_a_hang(tiny_dataset, tiny_model, tmp_path):
    """The SLO choice simulated every worker: a billion allocated 8 GB and never finished."""
    import json
    from pathlib import Path

    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import weights_fingerprint
    from tests.support.server import free_port

    profile = json.loads((Path(__file__).parents[2] / "profiles" / "demo-sage-2core-epyc.json").read_text())
    profile["dataset"]["fingerprint"] = GraphStore.open(tiny_dataset).fingerprint  # made for this pair
    profile["model"]["fingerprint"] = weights_fingerprint(tiny_model)
    profile["fanouts"] = [5, 3]
    profile["pipelines"]["cpu"]["workers"] = 10**9
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    done = _cli("serve", "--dataset", str(tiny_dataset), "--model", str(tiny_model), "--device", "cpu",
                "--profile", str(path), "--policy", "slo:30", "--port", str(free_port()), timeout=120)
    _one_error_line(done, "serve", "workers must be a whole number in [1, 1024], got 1000000000")


def test_placing_on_a_billion_servers_is_one_line_not_a_hang(tiny_dataset, tmp_path):
    """Making and checking a plan passed over the rows once per server: it never finished."""
    import json

    topology = tmp_path / "topo.json"
    topology.write_text(json.dumps({"servers": 10**9, "network": "infiniband", "host_memory_bytes": "1G"}))
    done = _cli("place", "--dataset", str(tiny_dataset), "--fanouts", "5,3", "--topology", str(topology),
                "--out", str(tmp_path / "plan"), timeout=120)
    _one_error_line(done, "place", "servers must be within [1, 4096], got 1000000000")


def test_serving_with_a_plan_of_zero_byte_rows_is_one_line(tiny_dataset, tiny_model, tmp_path):
    """row_bytes 0 in plan.json was a ZeroDivisionError traceback (capacities in rows)."""
    import json

    from hybridgnn.features.placement import make_plan
    from hybridgnn.features.topology import Topology
    from tests.support.server import free_port

    plan = make_plan("hash", num_nodes=3000, topology=Topology(host_memory_bytes=1 << 30), row_bytes=64)
    saved = plan.save(tmp_path / "plan")
    meta = json.loads((saved / "plan.json").read_text())
    (saved / "plan.json").write_text(json.dumps({**meta, "row_bytes": 0}))
    done = _cli("serve", "--dataset", str(tiny_dataset), "--model", str(tiny_model), "--device", "cpu",
                "--placement", str(saved), "--port", str(free_port()), timeout=120)
    _one_error_line(done, "serve", "row_bytes must be a whole number >= 1, got 0")


def test_checking_a_model_whose_golden_outputs_are_cut_short_is_one_line(tiny_model, tmp_path):
    """The sampled path read the golden seeds' rows from them: an IndexError traceback."""
    import torch

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    saved = torch.load(model / "golden.pt", weights_only=True)
    torch.save({**saved, "out": saved["out"][:3]}, model / "golden.pt")
    done = _cli("model", "check", str(model), timeout=120)
    _one_error_line(done, "model", "golden.pt holds (3, 4) outputs for a graph of 40 nodes")


def test_a_truncated_workload_table_cache_is_computed_again_not_a_traceback(tiny_dataset, tmp_path):
    """A cached table cut short (a full disk, a killed write) was an EOFError traceback."""
    import json

    dataset = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, dataset, ignore=shutil.ignore_patterns("workload", "placement"))
    topology = tmp_path / "topo.json"
    topology.write_text(json.dumps({"host_memory_bytes": "1G"}))
    place = ("place", "--dataset", str(dataset), "--fanouts", "5,3", "--topology", str(topology))
    assert _cli(*place, "--out", str(tmp_path / "p1"), timeout=120).returncode == 0  # writes the tables
    psgs = dataset / "workload" / "psgs_5-3.npy"
    psgs.write_bytes(psgs.read_bytes()[:64])
    done = _cli(*place, "--out", str(tmp_path / "p2"), timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "is not readable" in done.stderr and "computing it again" in done.stderr


def test_serving_over_a_truncated_embedding_store_serves_by_sampling_and_precompute_remakes_it(
        tiny_dataset, tiny_model_pe, tmp_path):
    """A layer file cut short was a traceback (serve, precompute) or, with its header
    intact, an IndexError for every node past its rows."""
    import requests

    from hybridgnn.graph.store import GraphStore
    from tests.support.server import ServerProcess

    model = tmp_path / "model"
    shutil.copytree(tiny_model_pe, model)
    layer = model / "embeddings" / GraphStore.open(tiny_dataset).fingerprint / "layer_2.npy"
    np.save(layer, np.load(layer)[:10])
    srv = ServerProcess(tiny_dataset, model, "--device", "cpu").wait_ready()
    try:
        body = {"inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [2999]}]}
        answer = requests.post(f"{srv.url}/v2/models/hybridgnn/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        stored = requests.post(f"{srv.url}/v2/models/hybridgnn/infer", timeout=30,
                               json={**body, "parameters": {"mode": "precomputed"}})
        assert stored.status_code == 409, stored.text  # none served: not a 500 from past its rows
    finally:
        assert srv.stop() == 0
    done = _cli("precompute", "--dataset", str(tiny_dataset), "--model", str(model), timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert np.load(layer).shape[0] == 3000


def test_importing_an_edge_list_naming_node_10_to_the_12_is_one_line(tmp_path):
    """Dense ids that high asked for terabytes: a MemoryError traceback."""
    edges = tmp_path / "edges.txt"
    edges.write_text("0 1000000000000\n1 2\n")
    done = _cli("dataset", "import", str(edges), "--out", str(tmp_path / "out"), "--ids", "dense", timeout=120)
    _one_error_line(done, "dataset", "1,000,000,000,001 nodes do not fit in memory")
