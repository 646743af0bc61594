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

from hybridgnn.distributed.keyed_rows import KeyedRows
from hybridgnn.distributed.partition import Partition

SCAN_EDGES = 1 << 22  # edges read per step of the start-up scan (bounded memory)


@dataclass
class ServingPart:
    rank: int
    partition: Partition
    num_nodes: int              # nodes of the whole graph (grows with graph updates)
    nodes: np.ndarray           # [n] owned global ids, ascending (new nodes are appended)
    out_rows: KeyedRows         # own node -> its out-neighbours (global ids)
    in_rows: KeyedRows          # any target -> its in-neighbours among own nodes
    in_degree: np.ndarray       # [n] whole-graph in-degree of own nodes
    has_loop: np.ndarray        # [n] whether an own node lists itself
    features: torch.Tensor      # [n, f] own feature rows
    layers: list[torch.Tensor]  # per layer 1..K: [n, d] own precomputed rows (float32)
    output: torch.Tensor | None = None  # [n, out] own stored outputs (jumping-knowledge models)
    base_nodes: int = -1        # nodes of the stored graph (-1: num_nodes); later ones were added by updates
    alive: np.ndarray | None = None  # [num_nodes] whether each node of the whole graph exists (updates remove)

    def __post_init__(self):
        if self.base_nodes < 0:
            self.base_nodes = self.num_nodes
        if self.alive is None:
            self.alive = np.ones(self.num_nodes, dtype=bool)

    def owner_of(self, ids: np.ndarray) -> np.ndarray:
        """The owner rank of each node: the partition's for stored nodes, id mod the ranks
        for nodes graph updates added (known to every rank without a message)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0 or ids.max() < self.base_nodes:
            return self.partition.owner_of(ids)
        out = ids % self.partition.parts
        stored = ids < self.base_nodes
        out[stored] = self.partition.owner_of(ids[stored])
        return out

    def position(self, ids: np.ndarray) -> np.ndarray:
        """Row of each own id in this rank's tables (ids must be own)."""
        return np.searchsorted(self.nodes, ids)

    def rows(self, layer: int, ids: np.ndarray) -> torch.Tensor:
        """Layer-`layer` rows (0: features) of own nodes, float32."""
        table = self.features if layer == 0 else self.layers[layer - 1]
        return table.index_select(0, torch.from_numpy(self.position(ids))).float()

    def local_in(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, sources): the own in-neighbours of any nodes (0 for those with none)."""
        return self.in_rows.rows(targets)

    def local_out(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, targets): out-neighbours of the own nodes among ids (others: none)."""
        return self.out_rows.rows(ids)  # only own nodes have out-rows here

    def memory_bytes(self) -> int:
        arrays = [self.nodes, self.in_degree, self.has_loop]
        tensors = [self.features, *self.layers] + ([self.output] if self.output is not None else [])
        return (sum(a.nbytes for a in arrays) + self.out_rows.nbytes + self.in_rows.nbytes
                + sum(t.numel() * t.element_size() for t in tensors))


def _own_rows(table, nodes: np.ndarray) -> torch.Tensor:
    """A float32 copy of `nodes`' rows of a (memory-mapped) table: graph updates write to it."""
    if len(nodes) and nodes[-1] - nodes[0] + 1 == len(nodes):  # a range: one slice
        rows = np.array(table[int(nodes[0]): int(nodes[-1]) + 1], dtype=np.float32)
    else:
        rows = np.asarray(table)[nodes].astype(np.float32, copy=False)
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
        rank=rank, partition=partition, num_nodes=n, nodes=nodes,
        out_rows=KeyedRows(nodes, out_indptr, dst[by_src]), in_rows=KeyedRows(in_nodes, in_indptr, src[by_dst]),
        in_degree=(indptr[nodes + 1] - indptr[nodes]).astype(np.int64), has_loop=has_loop,
        features=_own_rows(graph.features, nodes), layers=[_own_rows(a, nodes) for a in (layers or [])],
        output=_own_rows(output, nodes) if output is not None else None)
