"""What batching saves in the model path alone: time per seed of sample → gather → model
(one thread, one torch thread, in process, no HTTP) at several batch sizes, as a ratio to
a batch of one. Demo graph and model by default.

    .venv/bin/python bench/batch_cost.py [--sizes 1,4,16,64,256] [--batches 300] [--heavy]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import heavy_setup, machine, progress, strict_json  # noqa: E402
from hybridgnn.demo import ensure_demo  # noqa: E402
from hybridgnn.features.store import HostFeatureStore  # noqa: E402
from hybridgnn.graph.store import GraphStore  # noqa: E402
from hybridgnn.models.checkpoint import load_checkpoint  # noqa: E402
from hybridgnn.pipelines.executor import BatchExecutor  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,4,16,64,256", help="seeds per batch")
    ap.add_argument("--batches", type=int, default=300, help="timed batches per size (after 20 warm-up ones)")
    ap.add_argument("--heavy", action="store_true", help="products-scale graph and a 3-layer SAGE of width 256")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dataset, model_dir = heavy_setup() if args.heavy else ensure_demo()
    graph = GraphStore.open(dataset)
    model, cfg = load_checkpoint(model_dir)
    executor = BatchExecutor(CPUSampler(graph, tuple(cfg["fanouts"])), HostFeatureStore(graph.features), model)
    rng = np.random.default_rng(0)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        batches = [rng.integers(0, graph.num_nodes, size, dtype=np.int64) for _ in range(args.batches + 20)]
        for seeds in batches[:20]:
            executor.run(seeds)
        t0 = time.perf_counter()
        for seeds in batches[20:]:
            executor.run(seeds)
        per_batch = (time.perf_counter() - t0) / args.batches
        rows.append({"batch_seeds": size, "us_per_batch": round(per_batch * 1e6, 1),
                     "us_per_seed": round(per_batch / size * 1e6, 2)})
        progress(rows[-1])
    base = rows[0]["us_per_seed"]
    for row in rows:
        row["per_seed_saving_vs_first"] = round(base / row["us_per_seed"], 1)
    print(strict_json({"machine": machine(), "dataset": str(dataset), "model": str(model_dir), "rows": rows}))


if __name__ == "__main__":
    main()
