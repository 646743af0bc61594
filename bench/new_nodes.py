"""New-node serving, Reforge's workload: hold out 25% of the test nodes and remove their
edges, train on the rest, precompute PEs, then send requests of 1,024 query nodes with
their edges reinstated. For each model, accuracy and mean latency per request of the
full K-hop expansion from raw features (Reforge's baseline), `full` (exact, from PEs),
sampled (15,10,5), pe, and srpe at several γ (each with its speedup over the full K-hop
expansion), and SRPE's query-edge-ratio policy against random and degree-importance
selection at equal γ.

    .venv/bin/python bench/new_nodes.py [--num-nodes 44000] [--epochs 4] [--requests 2]
    NEWNODES_MODELS=gcn .venv/bin/python bench/new_nodes.py    # a subset of gcn,sage,gat

Latency is the evaluation itself, in process, one thread (no HTTP). The full K-hop
expansion runs on the graph with the request's query nodes added (built outside the timing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, strict_json  # noqa: E402
from hybridgnn.embeddings.newnodes import NewNodeEvaluator  # noqa: E402
from hybridgnn.embeddings.precompute import precompute  # noqa: E402
from hybridgnn.features.store import HostFeatureStore  # noqa: E402
from hybridgnn.graph.csr import coo_to_csr  # noqa: E402
from hybridgnn.graph.generate import generate_csbm  # noqa: E402
from hybridgnn.graph.store import GraphStore, write_dataset  # noqa: E402
from hybridgnn.models.train import TrainConfig, train  # noqa: E402
from hybridgnn.pipelines.executor import BatchExecutor  # noqa: E402
from hybridgnn.sampling.cpu import CPUSampler  # noqa: E402

GAMMAS = (0.01, 0.03, 0.07, 0.10, 0.20)
EVERY_NEIGHBOUR = 1 << 30
MODELS = tuple((k, l) for k, l in (("gcn", 2), ("sage", 3), ("gat", 3)) if k in os.environ.get("NEWNODES_MODELS", "gcn,sage,gat").split(","))


def split(graph: GraphStore, rng) -> tuple[np.ndarray, np.ndarray]:
    """(base node ids, held-out node ids): a quarter of the test nodes are held out."""
    test = np.flatnonzero(np.asarray(graph.masks["test_mask"]))
    held = np.sort(rng.choice(test, size=len(test) // 4, replace=False))
    return np.setdiff1d(np.arange(graph.num_nodes), held), held


def relabel_edges(graph: GraphStore, new_id: np.ndarray):
    rows = np.repeat(np.arange(graph.num_nodes), graph.degrees())
    return new_id[rows], new_id[np.asarray(graph.indices, dtype=np.int64)]


def build(path: Path, num_nodes: int, rows, cols, feats, labels, masks) -> GraphStore:
    indptr, indices = coo_to_csr([rows], [cols], num_nodes, dedup=True)
    write_dataset(path, indptr=indptr, indices=indices, features=feats, labels=labels, masks=masks)
    return GraphStore.open(path)


def evaluate_model(kind: str, layers: int, base, requests: list[dict], work: Path, b: int, epochs: int) -> dict:
    """Train one model on the base graph, precompute it, and time every new-node mode on the
    requests (accuracy against the held-out labels, mean latency per request)."""
    fanouts = (15, 10, 5)[:layers]
    model, metrics = train(base, TrainConfig(kind=kind, num_layers=layers, hidden_dim=64, fanouts=fanouts,
                                             epochs=epochs), progress=False)
    mdir = work / f"model-{kind}"
    t0 = time.perf_counter()
    store = precompute(base, model, mdir, progress=False)
    pre_s = time.perf_counter() - t0
    ev = NewNodeEvaluator(base, model, store)
    rows_out = []

    def measure(name, fn):
        fn(requests[0])  # warm-up: compiled kernels and first-call allocations stay out of the timing
        correct, total, secs = 0, 0, 0.0
        for req in requests:
            t = time.perf_counter()
            emb = fn(req)
            secs += time.perf_counter() - t
            correct += int((emb.argmax(1) == req["labels"]).sum())
            total += len(req["labels"])
        rows_out.append({"mode": name, "accuracy": round(correct / total, 4),
                         "mean_latency_ms": round(secs / len(requests) * 1000, 2)})

    def expand(r, hops):
        aug = r["aug"]
        ex = BatchExecutor(CPUSampler(aug, hops), HostFeatureStore(aug.features), model)
        return ex.run(np.arange(b, b + len(r["labels"]))).logits

    # Reforge's "full computation": every query node's whole K-hop neighbourhood expanded
    # and computed from raw features (GCN normalised inside the expanded subgraph).
    measure("full K-hop expansion", lambda r: expand(r, (EVERY_NEIGHBOUR,) * layers))
    measure("full", lambda r: ev.infer(r["features"], r["edges"], mode="full").logits)
    measure("sampled " + ",".join(map(str, fanouts)),
            lambda r: ev.infer(r["features"], r["edges"], mode="sampled", fanouts=fanouts).logits)
    measure("pe", lambda r: ev.infer(r["features"], r["edges"], mode="pe").logits)
    for g in GAMMAS:
        for policy in ("ratio", "random", "degree"):
            measure(f"srpe γ={g:.0%} {policy}",
                    lambda r, g=g, p=policy: ev.infer(r["features"], r["edges"], mode="srpe", gamma=g,
                                                      policy=p).logits)
    baseline_ms = rows_out[0]["mean_latency_ms"]  # the full K-hop expansion, Reforge's baseline
    for row in rows_out:
        row["speedup_vs_full_expansion"] = round(baseline_ms / row["mean_latency_ms"], 2) if row["mean_latency_ms"] else None
    print(f"{kind} ({layers} layers): " + json.dumps(rows_out), flush=True)
    return {"kind": kind, "layers": layers, "trained_test_acc": round(metrics["test_acc"], 4),
            "precompute_s": round(pre_s, 2), "results": rows_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-nodes", type=int, default=44_000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--request-size", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="hybridgnn-newnodes-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the graphs and models generated for this run


def run(args: argparse.Namespace, work: Path) -> None:
    rng = np.random.default_rng(0)
    full = GraphStore.open(generate_csbm(work / "full", num_nodes=args.num_nodes, seed=11))
    base_ids, held = split(full, rng)
    b = len(base_ids)
    new_id = np.empty(full.num_nodes, dtype=np.int64)
    new_id[base_ids] = np.arange(b)
    new_id[held] = b + np.arange(len(held))
    rows, cols = relabel_edges(full, new_id)
    feats_all = np.empty_like(np.asarray(full.features))
    feats_all[new_id] = np.asarray(full.features)
    labels_all = np.empty(full.num_nodes, dtype=np.int64)
    labels_all[new_id] = np.asarray(full.labels)
    inside = (rows < b) & (cols < b)
    masks = {k: np.asarray(m)[base_ids] for k, m in full.masks.items()}
    base = build(work / "base", b, rows[inside], cols[inside], feats_all[:b], labels_all[:b], masks)

    requests = []
    for r in range(min(args.requests, len(held) // args.request_size)):
        lo, hi = b + r * args.request_size, b + (r + 1) * args.request_size
        touch = ((rows >= lo) & (rows < hi)) | ((cols >= lo) & (cols < hi))
        other = ((rows >= b) & ~((rows >= lo) & (rows < hi))) | ((cols >= b) & ~((cols >= lo) & (cols < hi)))
        keep = touch & ~other
        # query edges as (source, target) = (neighbour, node that aggregates); one direction
        # each, the evaluator adds the other
        src, dst = cols[keep], rows[keep]
        one_way = src < dst
        q_edges = np.stack([src[one_way], dst[one_way]])
        q_edges = np.where(q_edges >= lo, q_edges - lo + b, q_edges)
        aug_rows = np.concatenate([rows[inside], rows[keep] - np.where(rows[keep] >= lo, lo - b, 0)])
        aug_cols = np.concatenate([cols[inside], cols[keep] - np.where(cols[keep] >= lo, lo - b, 0)])
        aug = build(work / f"aug{r}", b + args.request_size, aug_rows, aug_cols,
                    np.concatenate([feats_all[:b], feats_all[lo:hi]]), None, {})
        requests.append({"features": feats_all[lo:hi], "edges": q_edges, "labels": labels_all[lo:hi], "aug": aug})

    if not requests:
        raise SystemExit(f"only {len(held)} held-out nodes: too few for a request of {args.request_size}; "
                         "raise --num-nodes")
    report = {"machine": machine(), "graph": full.describe(), "held_out": int(len(held)),
              "request_size": args.request_size, "requests": len(requests), "models": []}
    for kind, layers in MODELS:
        report["models"].append(evaluate_model(kind, layers, base, requests, work, b, args.epochs))
    print(strict_json(report, default=str))


if __name__ == "__main__":
    main()
