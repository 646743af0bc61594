"""One partition rank's share of a served graph: the edges whose source it owns (seen
from both ends), and the feature rows, precomputed embedding rows and whole-graph degrees
of its own nodes. Computation graph parallelism aggregates exactly these edges here.

Edges are placed with their source, as Reforge places them: a rank then aggregates every
message it can send without fetching a row. The rank scans the stored CSR once at start
(memory-mapped, in bounded chunks) and keeps only its edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridgnn.distributed.partition import Partition
from hybridgnn.graph.csr import gather_rows

SCAN_EDGES = 1 << 22  # edges read per step of the start-up scan (bounded memory)


@dataclass
class ServingPart:
    rank: int
    partition: Partition
    num_nodes: int              # nodes of the whole graph
    nodes: np.ndarray           # [n] owned global ids, ascending
    out_indptr: np.ndarray      # [n+1] out-edges of own nodes ...
    out_targets: np.ndarray     # ... their targets (global ids)
    in_nodes: np.ndarray        # sorted targets of edges from own nodes ...
    in_indptr: np.ndarray       # ... [len(in_nodes)+1]
    in_sources: np.ndarray      # ... their sources (global ids, own nodes)
    in_degree: np.ndarray       # [n] whole-graph in-degree of own nodes
    has_loop: np.ndarray        # [n] whether an own node lists itself
    features: torch.Tensor      # [n, f] own feature rows
    layers: list[torch.Tensor]  # per layer 1..K: [n, d] own precomputed rows (float32)
    output: torch.Tensor | None = None  # [n, out] own stored outputs (jumping-knowledge models)

    def owner_of(self, ids: np.ndarray) -> np.ndarray:
        return self.partition.owner_of(ids)

    def position(self, ids: np.ndarray) -> np.ndarray:
        """Row of each own id in this rank's tables (ids must be own)."""
        return np.searchsorted(self.nodes, ids)

    def rows(self, layer: int, ids: np.ndarray) -> torch.Tensor:
        """Layer-`layer` rows (0: features) of own nodes, float32."""
        table = self.features if layer == 0 else self.layers[layer - 1]
        return table.index_select(0, torch.from_numpy(self.position(ids))).float()

    def local_in(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, sources): the own in-neighbours of any nodes (0 for those with none)."""
        if len(self.in_nodes) == 0 or len(targets) == 0:
            return np.zeros(len(targets), dtype=np.int64), np.empty(0, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.in_nodes, targets), len(self.in_nodes) - 1)
        hit = self.in_nodes[pos] == targets
        starts = np.where(hit, self.in_indptr[pos], 0)
        lens = np.where(hit, self.in_indptr[pos + 1] - self.in_indptr[pos], 0)
        offs = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        return lens, self.in_sources[offs]

    def local_out(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, targets): out-neighbours of the own nodes among ids (others: none)."""
        own = self.owner_of(ids) == self.rank if len(ids) else np.zeros(0, dtype=bool)
        lens = np.zeros(len(ids), dtype=np.int64)
        lens_own, targets = gather_rows(self.out_indptr, self.out_targets, self.position(ids[own]))
        lens[own] = lens_own
        return lens, targets

    def memory_bytes(self) -> int:
        arrays = [self.nodes, self.out_indptr, self.out_targets, self.in_nodes, self.in_indptr, self.in_sources,
                  self.in_degree, self.has_loop]
        tensors = [self.features, *self.layers] + ([self.output] if self.output is not None else [])
        return sum(a.nbytes for a in arrays) + sum(t.numel() * t.element_size() for t in tensors)


def _own_rows(table, nodes: np.ndarray) -> torch.Tensor:
    """A copy of `nodes`' rows of a (memory-mapped) table, as float32 unless float16."""
    if len(nodes) and nodes[-1] - nodes[0] + 1 == len(nodes):  # a range: one slice
        rows = np.asarray(table[int(nodes[0]): int(nodes[-1]) + 1])
    else:
        rows = np.asarray(table)[nodes]
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    return torch.from_numpy(rows)


def open_serving_part(graph, partition: Partition, rank: int, layers: list | None,
                      output=None) -> ServingPart:
    """Rank `rank`'s share of `graph` (a GraphStore) and of the precomputed `layers` (and
    `output`, a jumping-knowledge model's stored outputs)."""
    n = graph.num_nodes
    indptr = np.asarray(graph.indptr)
    nodes = partition.nodes_of(rank)
    src_parts, dst_parts = [], []
    total = int(indptr[-1])
    for lo in range(0, total, SCAN_EDGES):
        hi = min(total, lo + SCAN_EDGES)
        src = np.asarray(graph.indices[lo:hi], dtype=np.int64)
        mine = partition.owner_of(src) == rank
        if mine.any():
            at = np.flatnonzero(mine)
            src_parts.append(src[at])
            dst_parts.append(np.searchsorted(indptr, lo + at, side="right") - 1)
    src = np.concatenate(src_parts) if src_parts else np.empty(0, dtype=np.int64)
    dst = np.concatenate(dst_parts).astype(np.int64) if dst_parts else np.empty(0, dtype=np.int64)
    by_dst = np.lexsort((src, dst))
    in_nodes, first = np.unique(dst[by_dst], return_index=True)
    in_indptr = np.append(first, len(dst)).astype(np.int64)
    by_src = np.lexsort((dst, src))
    out_indptr = np.zeros(len(nodes) + 1, dtype=np.int64)
    np.cumsum(np.bincount(np.searchsorted(nodes, src), minlength=len(nodes)), out=out_indptr[1:])
    has_loop = np.zeros(len(nodes), dtype=bool)
    has_loop[np.searchsorted(nodes, src[src == dst])] = True
    return ServingPart(
        rank=rank, partition=partition, num_nodes=n, nodes=nodes, out_indptr=out_indptr,
        out_targets=dst[by_src], in_nodes=in_nodes, in_indptr=in_indptr, in_sources=src[by_dst],
        in_degree=(indptr[nodes + 1] - indptr[nodes]).astype(np.int64), has_loop=has_loop,
        features=_own_rows(graph.features, nodes), layers=[_own_rows(a, nodes) for a in (layers or [])],
        output=_own_rows(output, nodes) if output is not None else None)
