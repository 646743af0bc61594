"""`hybridgnn precompute` on a GPU against the CPU: layer-wise embeddings of every node,
same graph, model and code, timed on each device in one run (the CPU side with one torch
thread per core).

    .venv/bin/python bench/precompute_device.py [--heavy] [--devices cpu,cuda]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit_report, heavy_setup, machine, progress  # noqa: E402
from hybridgnn.capabilities import CPU_COUNT, HAS_CUDA  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.checkpoint import load_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heavy", action="store_true", help="products-scale graph, 3-layer SAGE of width 256")
    ap.add_argument("--devices", default="cpu,cuda" if HAS_CUDA else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not HAS_CUDA and any(d.startswith("cuda") for d in args.devices.split(",")):
        sys.exit(f"{ap.prog}: --devices {args.devices}: CUDA is not available here (--devices cpu, the default "
                 "without it, times the CPU side alone)")
    dataset, model_dir = heavy_setup() if args.heavy else ensure_demo()
    torch.set_num_threads(CPU_COUNT)
    graph = GraphStore.open(dataset)
    model, _ = load_checkpoint(model_dir)
    report = {"machine": machine(), "graph": {"nodes": graph.num_nodes, "edges": graph.num_edges},
              "model": model.spec.to_dict(), "seconds": {}}
    outputs = {}
    for device in args.devices.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp) / "model"
            shutil.copytree(model_dir, scratch, ignore=shutil.ignore_patterns("embeddings"))
            t0 = time.perf_counter()
            store = precompute(graph, model, scratch, PrecomputeConfig(device=device), progress=False)
            report["seconds"][device] = round(time.perf_counter() - t0, 2)
            rows = np.random.default_rng(0).choice(graph.num_nodes, size=min(1000, graph.num_nodes), replace=False)
            outputs[device] = np.asarray(store.layers[-1][np.sort(rows)], dtype=np.float64)
        progress({device: report["seconds"][device]})
    if "cpu" in outputs and len(outputs) > 1:
        ref = outputs["cpu"]
        for device, out in outputs.items():
            if device != "cpu":
                report[f"{device}_vs_cpu_speedup"] = round(report["seconds"]["cpu"] / report["seconds"][device], 2)
                report[f"{device}_max_abs_diff_vs_cpu"] = float(np.abs(out - ref).max())
    else:
        report["ratio"] = "none: one device timed (the ratio needs cpu and a GPU in --devices)"
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
