"""Helpers shared by the benchmark scripts: the machine line and the products-scale graph."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from hybridgnn.capabilities import describe_line

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("HYBRIDGNN_BENCH_DATA", ROOT / "data"))
PRODUCTS = DATA / "products-powerlaw"
PRODUCTS_ARGS = ["--num-nodes", "2400000", "--avg-degree", "51.5", "--feature-dim", "100", "--seed", "0"]


def machine() -> str:
    return describe_line()


def ensure_products(path: Path = PRODUCTS) -> dict:
    """Generate the ogbn-products-scale power-law graph (once) in a child process and return
    its wall time and peak RSS; reuse an existing one (times then None)."""
    return ensure_graph(path, PRODUCTS_ARGS)


def ensure_graph(path: Path, generate_args: list[str]) -> dict:
    """Generate a power-law graph with these `dataset generate powerlaw` flags (once)."""
    if (path / "meta.json").is_file():
        return {"generate_s": None, "peak_rss_gib": None}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING", "dataset", "generate",
                    "powerlaw", "--out", str(path), *generate_args], check=True)
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"generate_s": time.perf_counter() - t0, "peak_rss_gib": rss_kib / 2**20}


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each named thread of a process, summed by name (Linux)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process's main thread, where its event loop runs (Linux)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def heavy_setup():
    """The products-scale graph and a 3-layer SAGE (hidden 256) with random weights."""
    import torch

    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.gnn import GNN, ModelSpec

    ensure_products(PRODUCTS)
    model_dir = PRODUCTS.parent / "products-sage3-256"
    if not (model_dir / "model.pt").is_file():
        graph = GraphStore.open(PRODUCTS)
        torch.manual_seed(0)
        model = GNN(ModelSpec("sage", graph.feature_dim, 256, 47, num_layers=3)).eval()
        save_checkpoint(model, model_dir, extra={"fanouts": [15, 10, 5], "dataset_fingerprint": graph.fingerprint})
    return PRODUCTS, model_dir
