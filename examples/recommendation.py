"""Serve a heterogeneous recommendation model, end to end:

1. build a user-rates-item graph as a PyG `HeteroData` and train `to_hetero(GraphSAGE)`
   for link prediction (dot-product scores) in plain PyG;
2. save the model with `hybridgnn.save_model(..., metadata=data.metadata(),
   link_decoder="dot")` and the graph with `torch.save`;
3. `hybridgnn dataset import graph.pt`;
4. `hybridgnn precompute` (every user's and item's embeddings, stored beside the model);
5. `hybridgnn serve`, ask it for the scores of held-out ratings, each user's top-k items
   among candidates (sampled) and among every item (precomputed), and the top-k items of a
   new user who rated a few items (a cold start, mode full), and compare each with the
   model run in PyG.

Run: .venv/bin/python examples/recommendation.py [--workdir DIR] [--users N]   (about a minute on 2 cores)
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
import torch_geometric.transforms as T
from torch_geometric.data import HeteroData
from torch_geometric.nn import GraphSAGE, to_hetero

import hybridgnn

HYBRIDGNN = [sys.executable, "-m", "hybridgnn.cli.main"]


def make_graph(users: int, items: int, groups: int = 8, ratings_per_user: int = 12, seed: int = 0):
    """Users rate items of their own taste group far more often; features are noisy
    group centres. Returns the graph to train and serve on, and held-out ratings."""
    rng = np.random.default_rng(seed)
    user_group, item_group = rng.integers(0, groups, users), rng.integers(0, groups, items)
    members = [np.flatnonzero(item_group == g) for g in range(groups)]
    u = np.repeat(np.arange(users), ratings_per_user)
    own = rng.random(u.size) < 0.85
    i = np.where(own, [rng.choice(members[g]) for g in user_group[u]], rng.integers(0, items, u.size))
    pairs = np.unique(np.stack([u, i]), axis=1)
    held_out = rng.random(pairs.shape[1]) < 0.1
    centres = rng.standard_normal((groups, 16)).astype(np.float32)
    data = HeteroData()
    data["user"].x = torch.from_numpy(centres[user_group] + rng.standard_normal((users, 16)).astype(np.float32))
    data["item"].x = torch.from_numpy(np.concatenate([centres[item_group], rng.standard_normal((items, 8))], 1)
                                      .astype(np.float32))
    data["user", "rates", "item"].edge_index = torch.from_numpy(pairs[:, ~held_out])
    data = T.ToUndirected()(data)  # adds (item, rev_rates, user): users read their items
    return data, torch.from_numpy(pairs[:, held_out])


def train(data: HeteroData, epochs: int = 60) -> torch.nn.Module:
    """Link prediction: observed ratings against random (user, item) pairs, dot scores."""
    torch.manual_seed(0)
    model = to_hetero(GraphSAGE((-1, -1), 32, num_layers=2, out_channels=16), data.metadata(), aggr="sum")
    with torch.no_grad():
        model(data.x_dict, data.edge_index_dict)  # materialise the lazy (-1) sizes
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    pos = data["user", "rates", "item"].edge_index
    for _ in range(epochs):
        model.train()
        opt.zero_grad()
        z = model(data.x_dict, data.edge_index_dict)
        neg = torch.stack([torch.randint(0, data["user"].num_nodes, (pos.shape[1],)),
                           torch.randint(0, data["item"].num_nodes, (pos.shape[1],))])
        logits = torch.cat([(z["user"][e[0]] * z["item"][e[1]]).sum(-1) for e in (pos, neg)])
        labels = torch.cat([torch.ones(pos.shape[1]), torch.zeros(pos.shape[1])])
        F.binary_cross_entropy_with_logits(logits, labels).backward()
        opt.step()
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def infer(url: str, inputs: dict[str, list], **parameters) -> dict[str, np.ndarray]:
    """One KServe v2 request: integer lists as INT64 [n], rows of floats as FP32 [q, F]."""
    tensors = []
    for name, values in inputs.items():
        if values and isinstance(values[0], list):
            tensors.append({"name": name, "datatype": "FP32", "shape": [len(values), len(values[0])],
                            "data": [v for row in values for v in row]})
        else:
            tensors.append({"name": name, "datatype": "INT64", "shape": [len(values)], "data": values})
    body = {"inputs": tensors, "parameters": parameters}
    req = urllib.request.Request(f"{url}/v2/models/hybridgnn/infer", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}


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
    parser.add_argument("--users", type=int, default=2000, help="users (items: half as many)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="hybridgnn-recsys-"))
    work.mkdir(parents=True, exist_ok=True)

    data, held_out = make_graph(args.users, args.users // 2)
    model = train(data)
    with torch.inference_mode():
        z = model(data.x_dict, data.edge_index_dict)
    max_degree = max(int(torch.bincount(ei[1]).max()) for ei in data.edge_index_dict.values())
    print(f"trained in plain PyG on {data['user'].num_nodes} users, {data['item'].num_nodes} items "
          f"(largest in-degree {max_degree})")

    torch.save(data, work / "graph.pt")
    # fanouts above the largest degree: every neighbour is read, so served scores are PyG's
    fanouts = [max_degree + 1] * 2
    hybridgnn.save_model(model, work / "model", metadata=data.metadata(), fanouts=fanouts, link_decoder="dot")
    subprocess.run([*HYBRIDGNN, "dataset", "import", str(work / "graph.pt"), "--out", str(work / "data")],
                   check=True, stdout=subprocess.DEVNULL)

    subprocess.run([*HYBRIDGNN, "--log-level", "WARNING", "precompute", "--dataset", str(work / "data"), "--model",
                    str(work / "model")], check=True, stdout=subprocess.DEVNULL)
    # a new user much like user 0: nearby features and five of the items user 0 rated
    ratings = data["user", "rates", "item"].edge_index
    rated = ratings[1][ratings[0] == 0][:5].tolist()
    newcomer = (data["user"].x[0] + 0.1).tolist()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*HYBRIDGNN, "--log-level", "WARNING", "serve", "--dataset", str(work / "data"),
                               "--model", str(work / "model"), "--port", str(port)])
    try:
        wait_ready(url, server)
        src, dst = held_out[0].tolist(), held_out[1].tolist()
        scores = infer(url, {"src_ids": src, "dst_ids": dst}, src_type="user", dst_type="item")["scores"]
        users = list(range(0, data["user"].num_nodes, max(1, data["user"].num_nodes // 20)))
        items = list(range(data["item"].num_nodes))
        top = infer(url, {"src_ids": users, "candidate_ids": items}, src_type="user", dst_type="item", k=10)
        every = infer(url, {"src_ids": users}, src_type="user", dst_type="item", k=10, mode="precomputed")
        cold = infer(url, {"features": [newcomer], "neighbor_ids": rated}, node_type="user",
                     edge_type="user__rates__item", mode="full", dst_type="item", k=10)
    finally:
        server.terminate()
        server.wait(30)

    want = (z["user"][held_out[0]] * z["item"][held_out[1]]).sum(-1).numpy()
    err = float(np.abs(scores - want).max())
    best = torch.topk(z["user"][users] @ z["item"].T, 10, dim=1)
    same_topk = bool((top["topk_ids"] == best.indices.numpy()).all())
    same_every = bool((every["topk_ids"] == best.indices.numpy()).all())
    # PyG with the new user and its ratings (both directions) added to the graph
    grown = data.clone()
    grown["user"].x = torch.cat([data["user"].x, torch.tensor([newcomer])])
    n = data["user"].num_nodes
    added = torch.tensor([[n] * len(rated), rated])
    grown["user", "rates", "item"].edge_index = torch.cat([data["user", "rates", "item"].edge_index, added], 1)
    grown["item", "rev_rates", "user"].edge_index = torch.cat([data["item", "rev_rates", "user"].edge_index,
                                                               added.flip(0)], 1)
    with torch.inference_mode():
        z_new = model(grown.x_dict, grown.edge_index_dict)["user"][n:]
    cold_best = torch.topk(z_new @ z["item"].T, 10, dim=1)  # against the stored item embeddings
    same_cold = bool((cold["topk_ids"] == cold_best.indices.numpy()).all())
    random_pairs = (z["user"][torch.randint(0, len(z["user"]), (len(want),))]
                    * z["item"][torch.randint(0, len(z["item"]), (len(want),))]).sum(-1).numpy()
    auc = float((want[:, None] > random_pairs[None, :]).mean())
    print(f"held-out ratings outscore random pairs {auc:.0%} of the time (AUC)")
    print(f"served scores of {len(want)} held-out ratings differ from PyG by at most {err:.2e}")
    print(f"served top-10 items of {len(users)} users {'equal' if same_topk else 'DIFFER FROM'} PyG's")
    print(f"precomputed top-10 of every item for {len(users)} users {'equal' if same_every else 'DIFFER FROM'} "
          "PyG's")
    print(f"a new user's top-10 items (rated {len(rated)}, mode full) {'equal' if same_cold else 'DIFFER FROM'} "
          "PyG's with the user added")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if err <= 1e-4 and same_topk and same_every and same_cold else 1


if __name__ == "__main__":
    sys.exit(main())
