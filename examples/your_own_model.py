"""Serve your own graph and model, end to end:

1. build a graph as a PyG `Data` object and train a GraphSAGE on it in plain PyG;
2. save the model with `hybridgnn.save_model` and the graph with `torch.save`;
3. `hybridgnn dataset import` and `hybridgnn precompute`;
4. `hybridgnn serve`, ask it for some nodes and compare with the model run in PyG.

Run: .venv/bin/python examples/your_own_model.py [--workdir DIR]   (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn.models import GraphSAGE

import hybridgnn

HYBRIDGNN = [sys.executable, "-m", "hybridgnn.cli.main"]


def make_graph(num_nodes: int = 3000, classes: int = 4, seed: int = 0) -> Data:
    """Communities that link mostly inside themselves, with noisy class-dependent features."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, num_nodes)
    src = rng.integers(0, num_nodes, num_nodes * 8)
    same = rng.random(src.size) < 0.8
    members = [np.flatnonzero(y == c) for c in range(classes)]
    dst = np.where(same, [rng.choice(members[c]) for c in y[src]], rng.integers(0, num_nodes, src.size))
    centers = rng.standard_normal((classes, 16)).astype(np.float32)
    x = centers[y] * 0.5 + rng.standard_normal((num_nodes, 16)).astype(np.float32)
    edge_index = torch.from_numpy(np.stack([src, dst]))  # directed: a node aggregates its in-neighbours
    train_mask = torch.from_numpy(rng.random(num_nodes) < 0.6)
    return Data(x=torch.from_numpy(x), edge_index=edge_index, y=torch.from_numpy(y), train_mask=train_mask,
                test_mask=~train_mask)


def train(data: Data) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GraphSAGE(16, 32, num_layers=2, out_channels=4, aggr="max", act="tanh", norm="batch", jk="last",
                      dropout=0.2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(60):
        model.train()
        opt.zero_grad()
        loss = F.cross_entropy(model(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hybridgnn serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise SystemExit("hybridgnn serve did not become ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="hybridgnn-example-"))
    work.mkdir(parents=True, exist_ok=True)

    data = make_graph()
    model = train(data)
    with torch.inference_mode():
        reference = model(data.x, data.edge_index)
    accuracy = float((reference.argmax(1) == data.y)[data.test_mask].float().mean())
    print(f"trained in plain PyG: test accuracy {accuracy:.3f}")

    torch.save(data, work / "graph.pt")
    hybridgnn.save_model(model, work / "model", fanouts=[25, 25])
    subprocess.run([*HYBRIDGNN, "dataset", "import", str(work / "graph.pt"), "--out", str(work / "data")],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*HYBRIDGNN, "precompute", "--dataset", str(work / "data"), "--model", str(work / "model")],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*HYBRIDGNN, "--log-level", "WARNING", "serve", "--dataset", str(work / "data"),
                               "--model", str(work / "model"), "--port", str(port)])
    try:
        wait_ready(url, server)
        nodes = list(range(0, 3000, 97))
        ids = {"name": "node_ids", "datatype": "INT64", "shape": [len(nodes)], "data": nodes}
        precomputed = post(f"{url}/v2/models/hybridgnn/infer", {"inputs": [ids], "parameters": {"mode": "precomputed"}})
        sampled = post(f"{url}/v2/models/hybridgnn/infer", {"inputs": [ids]})
    finally:
        server.terminate()
        server.wait(30)

    def rows(answer: dict) -> np.ndarray:
        out = next(o for o in answer["outputs"] if o["name"] == "logits")
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])

    want = reference[nodes].numpy()
    err = float(np.abs(rows(precomputed) - want).max())
    agree = float((rows(sampled).argmax(1) == want.argmax(1)).mean())
    print(f"served precomputed rows differ from PyG by at most {err:.2e}")
    print(f"served sampled predictions (fanouts 25,25) agree with PyG on {agree:.0%} of the nodes")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if err <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
