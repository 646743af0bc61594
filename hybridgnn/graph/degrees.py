"""Whole-graph in-degrees and self-loop flags per node: what a degree-normalised layer
(GCN) needs to weight a sample as the whole graph would (models.gnn.stack_forward)."""

from __future__ import annotations

import numpy as np
import torch


def self_loops(indptr: np.ndarray, indices: np.ndarray, num_nodes: int) -> np.ndarray:
    """Which nodes list themselves among their in-neighbours (CSR rows are targets)."""
    rows = np.repeat(np.arange(num_nodes), np.diff(indptr))
    has_loop = np.zeros(num_nodes, dtype=bool)
    has_loop[rows[indices == rows]] = True
    return has_loop


class NodeDegrees:
    """In-degree and has-self-loop of any node of a graph: a stored graph (flags computed
    once, degrees read from its CSR) or a DynamicGraph (read as it is now; call under
    its read lock, as samplers do)."""

    def __init__(self, graph):
        self.graph = graph
        self._dynamic = hasattr(graph, "self_loop") and hasattr(graph, "in_degree")
        if not self._dynamic:
            self._indptr = np.asarray(graph.indptr)
            self._has_loop = self_loops(self._indptr, np.asarray(graph.indices), graph.num_nodes)

    def lookup(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nodes = np.asarray(nodes, dtype=np.int64)
        if self._dynamic:
            return self.graph.in_degree(nodes).astype(np.int64), self.graph.self_loop[nodes].copy()
        return (self._indptr[nodes + 1] - self._indptr[nodes]).astype(np.int64), self._has_loop[nodes]

    def tensors(self, nodes: np.ndarray, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        deg, loop = self.lookup(nodes)
        return torch.from_numpy(deg).to(device), torch.from_numpy(loop).to(device)


class DeviceNodeDegrees:
    """NodeDegrees for sample node ids already on a device (the GPU pipeline): the CSR row
    pointers (device or UVA-mapped) and the flags live there, so lookups stay on it."""

    def __init__(self, indptr: torch.Tensor, has_loop: np.ndarray, device: torch.device):
        self.indptr = indptr
        self.has_loop = torch.from_numpy(has_loop).to(device)

    def tensors(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.indptr[nodes + 1] - self.indptr[nodes], self.has_loop[nodes]
