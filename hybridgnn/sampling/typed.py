"""Neighbour sampling of heterogeneous graphs with fanouts per edge type (PyG's
NeighborLoader on a HeteroData, disjoint=False).

At hop k, for every edge type e = (s, rel, t) in stored order, each node of type t
first reached at hop k-1 draws min(deg_e, l_{k,e}) distinct s-type neighbours, every
subset equally likely (Floyd's algorithm, as the homogeneous samplers). An s-type node
reached for the first time joins s's nodes (and the next frontier), so node ids are
unique per type and ordered by hop. Two implementations share the contract
(TypedSampledSubgraph): TypedCPUSampler compiles each (hop, edge type) draw with numba;
TypedTorchSampler runs torch ops wherever the CSR tensors live (CUDA, or CPU in CI).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridgnn.sampling import cuda_hop
from hybridgnn.sampling.cpu import _grow, _mix_seed, expand_row
from hybridgnn.sampling.gpu import draw_hop
from hybridgnn.types import EdgeType, TypedSampledSubgraph


@numba.njit(nogil=True, cache=True)
def typed_hop(indptr, indices, frontier, fanout, local, nodes, n, state, chosen):
    """One edge type's draw for one hop. frontier: target-type ids; local/nodes/n: the
    source type's global->local map, node list and count. Returns (nodes, perhaps grown;
    n; source local ids; target positions in frontier)."""
    bound = 0
    for j in range(frontier.shape[0]):
        u = frontier[j]
        bound += min(indptr[u + 1] - indptr[u], fanout)
    nodes = _grow(nodes, n + bound)
    src = np.empty(bound, np.int64)
    dst = np.empty(bound, np.int64)
    e = 0
    for j in range(frontier.shape[0]):
        u = frontier[j]
        n, e = expand_row(indices, indptr[u], indptr[u + 1] - indptr[u], fanout, j, nodes, n, src, dst, e, local,
                          state, chosen)
    return nodes, n, src, dst


def check_seeds(seeds: dict, num_nodes: dict[str, int]) -> dict[str, np.ndarray]:
    """Seeds per node type as int64 arrays, every id in range; ValueError naming the type."""
    out = {}
    for ntype, ids in seeds.items():
        if ntype not in num_nodes:
            raise ValueError(f"unknown node type {ntype!r}; the graph has {list(num_nodes)}")
        ids = np.ascontiguousarray(np.asarray(ids), dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"seeds of node type {ntype!r} must be 1-D, got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= num_nodes[ntype]):
            raise ValueError(f"seeds of node type {ntype!r} must lie in [0, {num_nodes[ntype]})")
        out[ntype] = ids
    return out


def _first_occurrences(ids: np.ndarray) -> np.ndarray:
    """The distinct ids in the order they first appear."""
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)]


class TypedCPUSampler:
    """Sampler over a shared HeteroGraphStore; one instance per worker thread (it owns the
    per-type id maps and the RNG). Same seed and same call sequence give the same samples."""

    def __init__(self, graph, fanouts, seed: int = 0):
        from hybridgnn.workload.typed import num_hops, typed_fanouts

        self.fanouts = typed_fanouts(graph.edge_types, fanouts)
        self.num_hops = num_hops(self.fanouts)
        self._csr = {e: (np.asarray(d.indptr), np.asarray(d.indices)) for e, d in graph.edges.items()}
        self._num_nodes = {t: graph.num_nodes(t) for t in graph.node_types}
        self._local = {t: np.full(n, -1, dtype=np.int64) for t, n in self._num_nodes.items()}
        self._chosen = np.empty(max([1] + [max(v) for v in self.fanouts.values()]), np.int64)
        self._state = _mix_seed(seed)

    def sample(self, seeds: dict[str, np.ndarray]) -> TypedSampledSubgraph:
        seeds = check_seeds(seeds, self._num_nodes)
        nodes, count, seed_index = {}, {}, {}
        for t in self._num_nodes:
            first = _first_occurrences(seeds[t]) if t in seeds else np.empty(0, np.int64)
            nodes[t] = np.empty(max(16, 2 * first.size), np.int64)
            nodes[t][: first.size] = first
            count[t] = first.size
            self._local[t][first] = np.arange(first.size)
        for t, ids in seeds.items():
            seed_index[t] = self._local[t][ids]
        per_hop = {t: [count[t]] for t in nodes}
        parts: dict[EdgeType, list] = {e: [] for e in self._csr}
        lo = dict.fromkeys(nodes, 0)
        try:
            for k in range(self.num_hops):
                hi = dict(count)
                frontier = {t: nodes[t][lo[t]:hi[t]].copy() for t in nodes}
                for e, (indptr, indices) in self._csr.items():
                    s, _, t = e
                    fanout = self.fanouts[e][k]
                    if fanout == 0 or not frontier[t].size:
                        parts[e].append((np.empty(0, np.int64), np.empty(0, np.int64)))
                        continue
                    nodes[s], count[s], src, dst = typed_hop(indptr, indices, frontier[t], fanout, self._local[s],
                                                             nodes[s], count[s], self._state, self._chosen)
                    parts[e].append((src, dst + lo[t]))
                for t in nodes:
                    per_hop[t].append(count[t] - hi[t])
                lo = hi
        except BaseException:
            # a hop that failed midway (MemoryError) may have numbered nodes its lost arrays
            # held: reset the maps whole, or later calls would read them as reached
            for m in self._local.values():
                m.fill(-1)
            raise
        finally:
            for t in nodes:
                self._local[t][nodes[t][: count[t]]] = -1  # leave the maps clean for the next call
        return TypedSampledSubgraph(
            node_ids={t: nodes[t][: count[t]].copy() for t in nodes},
            edge_index={e: np.stack([np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps])])
                        for e, ps in parts.items()},
            num_sampled_nodes={t: np.asarray(v, np.int64) for t, v in per_hop.items()},
            num_sampled_edges={e: np.asarray([p[0].size for p in ps], np.int64) for e, ps in parts.items()},
            seed_index=seed_index,
        )


class TypedTorchSampler:
    """The same draw in torch ops over CSR tensors on one device (CUDA tensors, or CPU ones
    in CI); one instance per worker. On a GPU with CuPy each (hop, edge type) draw is one
    kernel launch (sampling/cuda_hop.py)."""

    def __init__(self, csr: dict[EdgeType, tuple[torch.Tensor, torch.Tensor]], num_nodes: dict[str, int],
                 fanouts, *, seed: int = 0):
        from hybridgnn.workload.typed import num_hops, typed_fanouts

        self.fanouts = typed_fanouts(list(csr), fanouts)
        self.num_hops = num_hops(self.fanouts)
        self.csr = csr
        self.device = next(iter(csr.values()))[0].device
        self._num_nodes = dict(num_nodes)
        self._local = {t: torch.full((n,), -1, dtype=torch.int64, device=self.device) for t, n in num_nodes.items()}
        # the one-launch hop reads int64 indptr and int32 or int64 indices (a dataset may store others)
        self._kernel = {e: cuda_hop.available(self.device) and ip.dtype == torch.int64
                        and ix.dtype in (torch.int32, torch.int64) for e, (ip, ix) in csr.items()}
        self._generator = torch.Generator(device=self.device)
        self.reseed(seed)

    @classmethod
    def from_graph(cls, graph, fanouts, *, device: str | torch.device = "cpu", seed: int = 0) -> TypedTorchSampler:
        """Over a HeteroGraphStore's arrays: zero-copy on CPU, copied to device memory otherwise
        (a copy per call: a server's workers share one graph.uva.TypedDeviceGraph's csr instead)."""
        from hybridgnn.graph.host import host_tensor

        csr = {e: (host_tensor(d.indptr).to(device), host_tensor(d.indices).to(device)) for e, d in graph.edges.items()}
        return cls(csr, {t: graph.num_nodes(t) for t in graph.node_types}, fanouts, seed=seed)

    def reseed(self, seed: int) -> None:
        self._seed = int(_mix_seed(seed)[0]) & 0x7FFF_FFFF_FFFF_FFFF
        self._generator.manual_seed(self._seed)
        self._hops_drawn = 0

    def sample(self, seeds: dict[str, np.ndarray]) -> TypedSampledSubgraph:
        seeds = check_seeds(seeds, self._num_nodes)
        dev = self.device
        nodes = {t: [torch.from_numpy(_first_occurrences(seeds.get(t, np.empty(0, np.int64)))).to(dev)]
                 for t in self._num_nodes}
        count = {t: int(v[0].shape[0]) for t, v in nodes.items()}
        for t, v in nodes.items():
            self._local[t][v[0]] = torch.arange(count[t], device=dev)
        seed_index = {t: self._local[t][torch.from_numpy(ids).to(dev)].cpu().numpy() for t, ids in seeds.items()}
        frontier = {t: (v[0], torch.arange(count[t], device=dev)) for t, v in nodes.items()}
        parts: dict[EdgeType, list] = {e: [] for e in self.csr}
        try:
            for k in range(self.num_hops):
                reached: dict[str, list] = {t: [] for t in nodes}
                for e, (indptr, indices) in self.csr.items():
                    s, _, t = e
                    fanout = self.fanouts[e][k]
                    if fanout == 0 or not frontier[t][0].numel():
                        parts[e].append((torch.empty(0, dtype=torch.int64, device=dev),) * 2)
                        continue
                    kernel_seed = None
                    if self._kernel[e] and fanout <= cuda_hop.MAX_FANOUT:
                        self._hops_drawn += 1
                        kernel_seed = int(_mix_seed(self._seed + self._hops_drawn)[0])
                    src_global, dst_local = draw_hop(indptr, indices, *frontier[t], fanout, self._generator,
                                                     kernel_seed)
                    new = torch.unique(src_global[self._local[s][src_global] < 0])
                    self._local[s][new] = torch.arange(count[s], count[s] + new.shape[0], device=dev)
                    count[s] += int(new.shape[0])
                    reached[s].append(new)
                    parts[e].append((self._local[s][src_global], dst_local))
                for t, new_parts in reached.items():
                    new = torch.cat(new_parts) if new_parts else torch.empty(0, dtype=torch.int64, device=dev)
                    nodes[t].append(new)
                    frontier[t] = (new, self._local[t][new])
        except BaseException:
            # an error midway (out of memory in a later edge type's draw) left this hop's new
            # nodes numbered but not yet listed for the cleanup: reset the maps whole
            for m in self._local.values():
                m.fill_(-1)
            raise
        finally:
            for t, v in nodes.items():
                self._local[t][torch.cat(v)] = -1  # leave the maps clean for the next call
        return TypedSampledSubgraph(
            node_ids={t: torch.cat(v).cpu().numpy() for t, v in nodes.items()},
            edge_index={e: torch.stack([torch.cat([p[0] for p in ps]), torch.cat([p[1] for p in ps])]).cpu().numpy()
                        for e, ps in parts.items()},
            num_sampled_nodes={t: np.asarray([int(x.shape[0]) for x in v], np.int64) for t, v in nodes.items()},
            num_sampled_edges={e: np.asarray([int(p[0].shape[0]) for p in ps], np.int64) for e, ps in parts.items()},
            seed_index=seed_index,
        )
