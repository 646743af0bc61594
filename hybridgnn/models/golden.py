"""Golden outputs: a model's answers on a small fixed graph, saved beside its weights and
recomputed on load, so a model directory can only serve the model it was saved from.

Three ways of computing the answers must agree with the saved ones (GOLDEN_TOLERANCE,
relative to the largest output): the rebuilt model's own forward (catches weights of
another architecture or a changed option or library), hybridgnn's layer-by-layer
evaluation over the whole graph (what precompute, new nodes and updates run), and its
sampled evaluation of a few seeds with every neighbour taken (what the sampling
pipelines run). The graph is directed, has a self-loop, a node without in-edges and
nodes of very different degrees, so degree handling and edge direction are exercised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridgnn.models.gnn import gcn_edge_weights, gcn_norm_degrees

GOLDEN_TOLERANCE = 1e-4
GOLDEN_NODES = 40
GOLDEN_SEEDS = (0, 3, 17, 39)  # 0 has no in-edges; 17 is a hub (see golden_graph)


@dataclass(frozen=True)
class GoldenGraph:
    x: torch.Tensor  # float32 [n, in_dim]
    edge_index: torch.Tensor  # int64 [2, e], (source, target)


def golden_graph(in_dim: int) -> GoldenGraph:
    """The fixed test graph for `in_dim`-wide features (the same bytes on every machine:
    numpy's PCG64 stream is stable)."""
    rng = np.random.default_rng(20261123)
    n = GOLDEN_NODES
    src = np.concatenate([np.arange(n - 1), rng.integers(0, n, 90), rng.integers(0, n, 12), [5]])
    dst = np.concatenate([np.arange(1, n), rng.integers(0, n, 90), np.full(12, 17), [5]])
    keep = dst != 0  # node 0 reads nothing
    pairs = np.unique(np.stack([src[keep], dst[keep]]), axis=1)  # no duplicate edges
    x = rng.standard_normal((n, in_dim)).astype(np.float32)
    return GoldenGraph(torch.from_numpy(x), torch.from_numpy(pairs.astype(np.int64)))


def full_neighbourhood_sample(edge_index: np.ndarray, seeds: np.ndarray, hops: int):
    """A sample in the samplers' layout with every in-neighbour taken: node ids (seeds
    first, then each hop's new nodes in first-occurrence order), local (source, target)
    edges grouped by hop, and per-hop node and edge counts."""
    src, dst = edge_index
    n = int(edge_index.max(initial=int(seeds.max())) + 1)
    local = np.full(n, -1, dtype=np.int64)
    local[seeds] = np.arange(len(seeds))
    nodes, frontier = [seeds], seeds
    edges, per_hop_nodes, per_hop_edges = [], [len(seeds)], []
    for _ in range(hops):
        pos = np.full(n, -1, dtype=np.int64)
        pos[frontier] = np.arange(len(frontier))
        mask = pos[dst] >= 0
        order = np.argsort(pos[dst[mask]], kind="stable")
        e_src, e_dst = src[mask][order], dst[mask][order]
        unseen = e_src[local[e_src] < 0]
        _, first = np.unique(unseen, return_index=True)
        new = unseen[np.sort(first)]
        local[new] = len(np.concatenate(nodes)) + np.arange(len(new))
        edges.append(np.stack([local[e_src], local[e_dst]]))
        nodes.append(new)
        per_hop_nodes.append(len(new))
        per_hop_edges.append(len(e_src))
        frontier = new
    return (np.concatenate(nodes), np.concatenate(edges, axis=1), per_hop_nodes, per_hop_edges)


def reference_outputs(model: torch.nn.Module, graph: GoldenGraph) -> torch.Tensor:
    """The model's own forward on the whole golden graph, in eval mode."""
    model.eval()
    with torch.inference_mode():
        return model(graph.x, graph.edge_index).float()


def layerwise_outputs(stack, graph: GoldenGraph) -> torch.Tensor:
    """hybridgnn's layer-by-layer evaluation over the whole graph (as precompute runs it:
    GCN with whole-graph degree weights)."""
    x, ei = graph.x, graph.edge_index.numpy()
    n = x.shape[0]
    weight = None
    if stack.gcn_normalised:
        norm_degree, has_loop = gcn_norm_degrees(ei, n)
        ei, w = gcn_edge_weights(ei, np.arange(n), n, norm_degree, has_loop)
        weight = torch.from_numpy(w)
    outs = []
    with torch.inference_mode():
        for i in range(stack.num_layers):
            x = stack.layer(i, x, torch.from_numpy(ei), n, gcn_weight=weight)
            outs.append(x)
        return stack.readout(outs).float()


def sampled_outputs(stack, graph: GoldenGraph) -> tuple[np.ndarray, torch.Tensor]:
    """(seeds, their rows) from hybridgnn's sampled evaluation with every neighbour taken."""
    seeds = np.asarray(GOLDEN_SEEDS, dtype=np.int64)
    edge_index = graph.edge_index.numpy()
    ids, ei, nodes, edges = full_neighbourhood_sample(edge_index, seeds, stack.num_layers)
    norm_degree, has_loop = gcn_norm_degrees(edge_index, graph.x.shape[0])
    in_degree = norm_degree - ~has_loop
    degrees = (torch.from_numpy(in_degree[ids]), torch.from_numpy(has_loop[ids]))
    with torch.inference_mode():
        out = stack(graph.x[torch.from_numpy(ids)], torch.from_numpy(ei), nodes, edges, degrees)
    return seeds, out.float()


def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| relative to b's largest magnitude (at least 1); inf for different
    shapes or any non-finite value: NaN compares false with every tolerance, so NaN
    outputs (NaN weights, or golden answers overwritten with NaN) would otherwise pass."""
    if a.shape != b.shape:
        return float("inf")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return float("inf")
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def mismatches(model: torch.nn.Module, stack, graph: GoldenGraph, golden: torch.Tensor) -> list[str]:
    """Which evaluation paths differ from `golden` beyond GOLDEN_TOLERANCE (empty: none)."""
    found = []
    err = max_relative_error(reference_outputs(model, graph), golden)
    if err > GOLDEN_TOLERANCE:
        found.append(f"the model's own forward differs by {err:.3g}")
    err = max_relative_error(layerwise_outputs(stack, graph), golden)
    if err > GOLDEN_TOLERANCE:
        found.append(f"layer-by-layer evaluation (precompute, new nodes, updates) differs by {err:.3g}")
    seeds, rows = sampled_outputs(stack, graph)
    err = max_relative_error(rows, golden[torch.from_numpy(seeds)])
    if err > GOLDEN_TOLERANCE:
        found.append(f"sampled evaluation with every neighbour taken differs by {err:.3g}")
    return found
