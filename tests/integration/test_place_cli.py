"""`hybridgnn place` run as a process."""

import json

from hybridgnn.features.placement import GPU, Plan
from hybridgnn.graph.store import GraphStore


def test_place_command_prints_tiers_saves_the_plan_and_simulates(tiny_dataset, tmp_path):
    import subprocess
    import sys

    topo_file = tmp_path / "topo.json"
    topo_file.write_text(json.dumps({"servers": 2, "gpus_per_server": 2, "nvlink_cliques": 1,
                                     "gpu_memory_bytes": "8K", "host_memory_bytes": "64K",
                                     "network": "infiniband"}))
    log = tmp_path / "seeds.txt"
    log.write_text(" ".join(str(i) for i in [1, 1, 1, 5, 9, 200]))
    out = tmp_path / "plan"
    done = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "place", "--dataset",
                           str(tiny_dataset), "--fanouts", "5,3", "--topology", str(topo_file), "--from-log", str(log),
                           "--simulate", "20", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "gpu" in done.stdout and "host" in done.stdout and "p99" in done.stdout
    plan = Plan.load(out)
    made_for = plan.made_for
    assert made_for["dataset_fingerprint"] == GraphStore.open(tiny_dataset).fingerprint
    assert made_for["fanouts"] == [5, 3] and made_for["seeds"].startswith("log-")
    assert plan.num_nodes == 3000 and plan.topology.servers == 2
    assert plan.tier[1] == GPU  # the most requested node is among the hottest rows
    bad = subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "place", "--dataset", str(tiny_dataset),
                          "--topology", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no topology file" in bad.stderr
