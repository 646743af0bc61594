"""Mini-batch training with the CPU sampler: sample → gather → forward on the seeds."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hybridgnn.graph.host import host_tensor
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.sampling.cpu import CPUSampler


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "sage"
    hidden_dim: int = 64
    num_layers: int = 2
    heads: int = 4
    dropout: float = 0.3
    fanouts: tuple[int, ...] = (10, 5)
    epochs: int = 5
    batch_size: int = 512
    lr: float = 0.005
    weight_decay: float = 5e-4
    seed: int = 0

    def __post_init__(self):
        if len(self.fanouts) < self.num_layers:
            raise ValueError(
                f"need at least one fanout per layer: {self.num_layers} layers, fanouts {self.fanouts}"
            )
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"epochs, batch_size and lr must be positive, got {self.epochs}, {self.batch_size}, {self.lr}"
            )


def predict(model: GNN, graph: GraphStore, sampler: CPUSampler, node_ids: np.ndarray, batch_size: int = 1024):
    """Logits for node_ids by sampled inference."""
    feats = host_tensor(graph.features)
    outs = []
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(node_ids), batch_size):
            sub = sampler.sample(node_ids[start : start + batch_size])
            x = feats[torch.from_numpy(sub.node_ids)]
            out = model(x, torch.from_numpy(sub.edge_index), sub.num_sampled_nodes, sub.num_sampled_edges)
            outs.append(out[torch.from_numpy(sub.seed_index)])
    return torch.cat(outs) if outs else torch.empty(0, model.spec.out_dim)


def accuracy(model: GNN, graph: GraphStore, sampler: CPUSampler, mask_name: str) -> float:
    ids = np.flatnonzero(np.asarray(graph.masks[mask_name]))
    if ids.size == 0:
        return float("nan")
    pred = predict(model, graph, sampler, ids).argmax(1).numpy()
    return float((pred == np.asarray(graph.labels)[ids]).mean())


def _class_count(graph: GraphStore, train_ids: np.ndarray) -> int:
    """The classes the model predicts: meta.json's num_classes, at least 2. ValueError (one
    line) when no node is in train_mask, a training node's label is not in [0, num_classes)
    (the loss failed mid-epoch with an IndexError), or num_classes exceeds the node count
    (labels mis-imported: a million-fold output layer was allocated before anything else)."""
    if train_ids.size == 0:
        raise ValueError(f"dataset {graph.root} has no node in train_mask: nothing to train on")
    classes = max(graph.num_classes, 2)
    if classes > max(graph.num_nodes, 2):
        raise ValueError(f"dataset {graph.root} says num_classes={graph.num_classes:,} for {graph.num_nodes:,} nodes: "
                         "more classes than nodes (are the labels class numbers?)")
    labels = np.asarray(graph.labels)[train_ids]
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        raise ValueError(f"dataset {graph.root}: training nodes' labels lie in [{low}, {high}], not in "
                         f"[0, {classes}) (num_classes); unlabelled nodes (-1) must not be in train_mask")
    return classes


def train(graph: GraphStore, cfg: TrainConfig, *, progress: bool = True) -> tuple[GNN, dict]:
    """(model, metrics) trained as cfg says; ValueError (one line) for a dataset it cannot
    train on or a width or batch that does not fit in memory."""
    try:
        return _train(graph, cfg, progress)
    except RuntimeError as exc:
        # torch's allocator raises RuntimeError, not MemoryError: --hidden-dim 10**8 ended
        # in a traceback from inside a layer's forward
        if "can't allocate memory" not in str(exc) and "out of memory" not in str(exc).lower():
            raise
        raise ValueError(f"training ran out of memory (hidden width {cfg.hidden_dim}, batch size {cfg.batch_size}, "
                         f"fanouts {list(cfg.fanouts)}): lower --hidden-dim, --batch-size or --fanouts") from None


def _train(graph: GraphStore, cfg: TrainConfig, progress: bool) -> tuple[GNN, dict]:
    if graph.labels is None:
        raise ValueError(f"dataset {graph.root} has no labels; training needs a labelled dataset (e.g. csbm)")
    if "train_mask" not in graph.masks:
        raise ValueError(f"dataset {graph.root} has labels but no train_mask: import a PyG Data with a train_mask "
                         "(bool, one per node) to say which nodes to train on")
    train_ids = np.flatnonzero(np.asarray(graph.masks["train_mask"]))
    classes = _class_count(graph, train_ids)
    torch.manual_seed(cfg.seed)
    spec = ModelSpec(cfg.kind, graph.feature_dim, cfg.hidden_dim, classes, cfg.num_layers, cfg.heads, cfg.dropout)
    try:
        model = GNN(spec)
    except MemoryError:
        raise ValueError(f"a model of {classes:,} classes and hidden width {cfg.hidden_dim} does not fit in "
                         "memory") from None
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = CPUSampler(graph, cfg.fanouts, seed=cfg.seed)
    feats = host_tensor(graph.features)
    labels = torch.from_numpy(np.asarray(graph.labels))
    rng = np.random.default_rng(cfg.seed)
    history = []
    t0 = time.perf_counter()
    steps = cfg.epochs * ((len(train_ids) + cfg.batch_size - 1) // cfg.batch_size)
    with tqdm(total=steps, desc="train", unit="batch", disable=not progress) as bar:
        for epoch in range(cfg.epochs):
            model.train()
            order = rng.permutation(train_ids)
            total_loss = 0.0
            for start in range(0, len(order), cfg.batch_size):
                seeds = order[start : start + cfg.batch_size]
                sub = sampler.sample(seeds)
                out = model(feats[torch.from_numpy(sub.node_ids)], torch.from_numpy(sub.edge_index),
                            sub.num_sampled_nodes, sub.num_sampled_edges)
                loss = F.cross_entropy(out[torch.from_numpy(sub.seed_index)], labels[torch.from_numpy(seeds)])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total_loss += loss.item() * len(seeds)
                bar.update(1)
            val = accuracy(model, graph, sampler, "val_mask") if "val_mask" in graph.masks else float("nan")
            history.append({"epoch": epoch + 1, "loss": total_loss / len(train_ids), "val_acc": val})
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", val_acc=f"{val:.3f}")
    model.eval()
    metrics = {
        "train_s": time.perf_counter() - t0,
        "history": history,
        "val_acc": history[-1]["val_acc"],
        "test_acc": accuracy(model, graph, sampler, "test_mask") if "test_mask" in graph.masks else float("nan"),
    }
    return model, metrics
