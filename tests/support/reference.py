"""Reference results tests compare the fast paths with."""

from __future__ import annotations

import numpy as np
import torch


def full_graph_forward(graph, model):
    """Node-wise full-neighbourhood inference, done as one whole-graph forward."""
    deg = graph.degrees()
    dst = np.repeat(np.arange(graph.num_nodes), deg)
    ei = torch.from_numpy(np.stack([np.asarray(graph.indices, dtype=np.int64), dst]))
    with torch.inference_mode():
        return model(torch.from_numpy(np.asarray(graph.features)), ei).numpy()


_M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """The CUDA sampler's counter hash (sampling/cuda_hop.py), on Python ints."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def kernel_draw_row(indptr, indices, v: int, r: int, fanout: int, seed: int) -> list[int]:
    """cuda_hop's draw_row: row r's picks for node v, -1 past its degree."""
    start, deg = int(indptr[v]), int(indptr[v + 1] - indptr[v])
    if deg <= fanout:
        return [int(indices[start + j]) if j < deg else -1 for j in range(fanout)]
    base = mix64((seed & _M64) ^ mix64(r))
    taken, row = [], []
    for j in range(fanout):
        upper = deg - fanout + j
        t = mix64((base + j) & _M64) % (upper + 1)
        if t in taken:
            t = upper
        taken.append(t)
        row.append(int(indices[start + t]))
    return row


def kernel_batch_sample(indptr, indices, seeds, fanouts, hop_seeds):
    """What cuda_hop.sample_batch computes, one node at a time: (node ids, [2, E] edges,
    nodes per hop, edges per hop). New nodes are numbered by the first tile position
    that reaches them; edges follow tile order, hop by hop."""
    nodes = [int(s) for s in seeds]
    local = {v: i for i, v in enumerate(nodes)}
    per_hop_nodes, per_hop_edges, src, dst = [len(nodes)], [], [], []
    lo = 0
    for fanout, seed in zip(fanouts, hop_seeds, strict=True):
        hi = len(nodes)
        tile = [v for r in range(hi - lo) for v in kernel_draw_row(indptr, indices, nodes[lo + r], r, fanout, seed)]
        edges = 0
        for p, v in enumerate(tile):
            if v < 0:
                continue
            if v not in local:
                local[v] = len(nodes)
                nodes.append(v)
            src.append(local[v])
            dst.append(lo + p // fanout)
            edges += 1
        per_hop_nodes.append(len(nodes) - hi)
        per_hop_edges.append(edges)
        lo = hi
    return np.array(nodes, dtype=np.int64), np.array([src, dst], dtype=np.int64).reshape(2, -1), \
        per_hop_nodes, per_hop_edges
