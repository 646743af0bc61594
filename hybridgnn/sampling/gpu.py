"""Batched K-hop uniform sampling without replacement in torch ops (Quiver §4.3).

The same code runs wherever the topology tensors live: CUDA tensors in device memory,
CUDA views of pinned host memory read zero-copy over UVA (graph/uva.py), or plain CPU
tensors (how CI exercises it). Per hop, every frontier node draws min(deg, fanout)
distinct neighbours at once: rows with deg <= fanout take all, the others run Robert
Floyd's algorithm vectorised across rows (fanout steps, each a handful of element-wise
ops on an [m, fanout] tile), which yields every fanout-subset with equal probability.
New nodes are found through a dense global→local map owned by the sampler, so no
per-node Python runs and no hash table is needed.

On a GPU with CuPy installed each hop's draw is one CUDA kernel (sampling/cuda_hop.py);
by default the whole batch runs in kernels (HYBRIDGNN_CUDA_BATCH=0: per hop), new nodes
numbered on the device by first occurrence, no host round trip between hops; a small
batch runs whole in one launch of one block (sampling/cuda_small.py,
HYBRIDGNN_CUDA_SMALL=0 turns it off), checked against the batch kernels on its first.
This torch-op path is the reference they are tested against, and the fallback (fanouts
above cuda_hop.MAX_FANOUT use it too).

The output contract is SampledSubgraph's (seeds first, then nodes by the hop that first
reached them; local edge_index ordered by hop), held as tensors on the sampler's device.
"""

from __future__ import annotations

import logging

import torch

from hybridgnn.sampling import cuda_hop, cuda_small
from hybridgnn.sampling.cpu import _mix_seed
from hybridgnn.types import TensorSubgraph

log = logging.getLogger(__name__)


def floyd_positions(degrees: torch.Tensor, fanout: int, generator: torch.Generator) -> torch.Tensor:
    """[m, fanout] distinct positions in [0, degree) per row, each fanout-subset equally
    likely (rows must have degree >= fanout). Floyd: for j = d-k .. d-1 draw t in [0, j];
    keep t unless already taken, else take j."""
    m = degrees.shape[0]
    out = torch.empty((m, fanout), dtype=torch.int64, device=degrees.device)
    if m == 0:
        return out
    # float64 draws: exact enough for any degree below 2**52 (float32 would bias large rows)
    draws = torch.rand((fanout, m), dtype=torch.float64, device=degrees.device, generator=generator)
    for j in range(fanout):
        upper = degrees - (fanout - j)  # inclusive bound of this step's draw
        t = torch.minimum((draws[j] * (upper + 1).to(torch.float64)).to(torch.int64), upper)
        if j:
            taken = (out[:, :j] == t.unsqueeze(1)).any(dim=1)
            t = torch.where(taken, upper, t)
        out[:, j] = t
    return out


class TorchSampler:
    """Sampler over CSR tensors on one device. One instance per worker (it owns the id
    map and the generator); the topology tensors are shared. Same seed and same call
    sequence give the same samples on the same device."""

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, fanouts, *, seed: int = 0,
                 kernel: bool | None = None):
        if indptr.device != indices.device:
            raise ValueError(f"indptr is on {indptr.device} but indices on {indices.device}")
        self.fanouts = tuple(int(f) for f in fanouts)
        if not self.fanouts or min(self.fanouts) < 1:
            raise ValueError(f"fanouts must be positive integers, got {fanouts!r}")
        self.device = indptr.device
        self.indptr = indptr
        self.indices = indices
        self.num_nodes = int(indptr.shape[0]) - 1
        self._local = torch.full((self.num_nodes,), -1, dtype=torch.int64, device=self.device)
        if self.device.type == "cuda":  # filled on this stream; read on a worker's, which does not wait for it
            torch.cuda.current_stream(self.device).synchronize()
        self._generator = torch.Generator(device=self.device)
        self._bid: torch.Tensor | None = None  # the device path's second scratch map, made on first use
        # The one-launch CUDA hop (None: wherever it can run). It needs int64 indptr, and
        # indices of int32 or int64 (a dataset may store others: its kernels refused every batch).
        can = (cuda_hop.available(self.device) and indptr.dtype == torch.int64
               and indices.dtype in (torch.int32, torch.int64))
        if kernel and not can:
            raise ValueError(f"the CUDA sampling kernel needs CuPy, a CUDA device, int64 indptr and int32 or int64 "
                             f"indices (device {self.device}, indptr {indptr.dtype}, indices {indices.dtype})")
        self.kernel = can if kernel is None else bool(kernel)
        # Small batches in one launch (cuda_small), checked against sample_batch on the first.
        self._small = (cuda_small.SmallBatches(indptr, indices, self.fanouts)
                       if self.kernel and cuda_small.max_tile() > 0 else None)
        self._small_checked = False
        self.reseed(seed)

    @classmethod
    def from_graph(cls, graph, fanouts, *, device: str | torch.device = "cpu", seed: int = 0) -> TorchSampler:
        """Over a GraphStore's arrays: zero-copy for CPU; copied to device memory otherwise
        (the UVA path builds its views with graph/uva.py and uses the constructor)."""
        from hybridgnn.graph.host import host_tensor

        indptr, indices = host_tensor(graph.indptr), host_tensor(graph.indices)
        return cls(indptr.to(device), indices.to(device), fanouts, seed=seed)

    def reseed(self, seed: int) -> None:
        self._seed = int(_mix_seed(seed)[0]) & 0x7FFF_FFFF_FFFF_FFFF
        self._generator.manual_seed(self._seed)
        self._hops_drawn = 0  # the kernel's random stream: (seed, hop count, row, step)

    def sample(self, seeds) -> TensorSubgraph:
        seeds = torch.as_tensor(seeds, dtype=torch.int64)
        if seeds.ndim != 1:
            raise ValueError(f"seeds must be 1-D, got shape {tuple(seeds.shape)}")
        # checked where the ids are (on the host for a request: no device round trip)
        if seeds.numel() and (int(seeds.min()) < 0 or int(seeds.max()) >= self.num_nodes):
            raise ValueError(f"seed ids must lie in [0, {self.num_nodes})")
        # De-duplicated where the ids are: on the device, unique waits for its output's size.
        unique_seeds, seed_index = torch.unique(seeds, return_inverse=True)
        if seeds.device.type != "cpu":
            return self._sample_unique(unique_seeds, seed_index)
        sub = self._sample_unique(unique_seeds, seed_index, on_host=True)
        sub.host_seed_index = seed_index.numpy()
        return sub

    def _sample_unique(self, unique_seeds: torch.Tensor, seed_index: torch.Tensor, on_host: bool = False
                       ) -> TensorSubgraph:
        if on_host:
            if (self._small is not None and cuda_hop.batch_enabled()
                    and self._small.fits(int(unique_seeds.shape[0]))):
                return self._sample_small(unique_seeds, seed_index)
            unique_seeds = unique_seeds.to(self.device, non_blocking=True)
            seed_index = seed_index.to(self.device, non_blocking=True)
        if self.kernel and max(self.fanouts) <= cuda_hop.MAX_FANOUT and cuda_hop.batch_enabled():
            return self._sample_on_device(unique_seeds, seed_index)
        nodes = [unique_seeds]
        count = unique_seeds.shape[0]
        self._local[unique_seeds] = torch.arange(count, device=self.device)
        frontier, frontier_local = unique_seeds, torch.arange(count, device=self.device)
        src_parts, dst_parts, edges_per_hop = [], [], []
        try:
            for fanout in self.fanouts:
                src_global, dst_local = self._hop(frontier, frontier_local, fanout)
                known = self._local[src_global]
                new = torch.unique(src_global[known < 0])
                new_local = torch.arange(count, count + new.shape[0], device=self.device)
                nodes.append(new)  # before it is numbered: the finally clears what is numbered
                self._local[new] = new_local
                count += new.shape[0]
                src_parts.append(self._local[src_global])
                dst_parts.append(dst_local)
                edges_per_hop.append(int(src_global.shape[0]))
                frontier, frontier_local = new, new_local
        finally:
            node_ids = torch.cat(nodes)
            self._local[node_ids] = -1  # leave the map clean for the next batch
        edge_index = torch.stack([torch.cat(src_parts), torch.cat(dst_parts)])
        return TensorSubgraph(node_ids=node_ids, edge_index=edge_index,
                              num_sampled_nodes=[int(n.shape[0]) for n in nodes],
                              num_sampled_edges=edges_per_hop, seed_index=seed_index)

    def _sample_on_device(self, unique_seeds: torch.Tensor, seed_index: torch.Tensor) -> TensorSubgraph:
        """Every hop in CUDA kernels, numbering new nodes by first occurrence (cuda_hop)."""
        hop_seeds = self._next_hop_seeds()
        node_ids, edge_index, nodes, edges = cuda_hop.sample_batch(
            self.indptr, self.indices, unique_seeds, self.fanouts, hop_seeds, self._local, self._scratch_bid())
        return TensorSubgraph(node_ids=node_ids, edge_index=edge_index, num_sampled_nodes=nodes,
                              num_sampled_edges=edges, seed_index=seed_index)

    def _sample_small(self, unique_seeds: torch.Tensor, seed_index: torch.Tensor) -> TensorSubgraph:
        """A small batch in one launch (cuda_small). The first is sampled by sample_batch
        too, first, with the same random seeds, and answered with that sample: the one
        launch must give it exactly and leave the scratch maps clean, else (or if it
        cannot run at all: a compiler error, say) this sampler keeps to sample_batch,
        logged, with its maps reset."""
        hop_seeds = self._next_hop_seeds()
        count = int(unique_seeds.shape[0])
        staged, at = self._small.stage(unique_seeds, seed_index, hop_seeds)
        if self._small_checked:
            got = self._small.sample(staged, count, self._local, self._scratch_bid())
        else:
            got = self._check_small(staged[at - count:at], count, staged, hop_seeds)
        node_ids, edge_index, nodes, edges = got
        return TensorSubgraph(node_ids=node_ids, edge_index=edge_index, num_sampled_nodes=nodes,
                              num_sampled_edges=edges, seed_index=staged[at:])

    def _check_small(self, unique_seeds: torch.Tensor, count: int, staged: torch.Tensor, hop_seeds: list[int]):
        """sample_batch's sample of the first small batch, and the one launch's against it.
        Checked once it has been compared: a sample_batch that fails first (out of memory,
        say) fails its batch, and the next small batch is checked instead."""
        local, bid = self._local, self._scratch_bid()
        want = cuda_hop.sample_batch(self.indptr, self.indices, unique_seeds, self.fanouts, hop_seeds, local, bid)
        self._small_checked = True
        try:
            got = self._small.sample(staged, count, local, bid)
            clean = bool((local == -1).all()) and bool((bid == cuda_hop.INT64_MAX).all())
            problem = None if clean else "left its scratch maps dirty"
            if problem is None and not (got[2:] == want[2:] and torch.equal(got[0], want[0])
                                        and torch.equal(got[1], want[1])):
                problem = "sampled other than the batch kernels"
        except Exception as exc:  # noqa: BLE001 - until its check has passed, the kernel is optional
            problem = f"failed ({type(exc).__name__}: {str(exc)[:200]})"
        if problem is not None:
            local.fill_(-1)
            bid.fill_(cuda_hop.INT64_MAX)
            self._small = None
            log.warning("the one-launch sampler %s on its first batch; this worker samples small batches with "
                        "the batch kernels", problem)
        return want

    def _next_hop_seeds(self) -> list[int]:
        """One random seed per hop for the kernels, advancing this sampler's stream."""
        seeds = []
        for _ in self.fanouts:
            self._hops_drawn += 1
            seeds.append(int(_mix_seed(self._seed + self._hops_drawn)[0]))
        return seeds

    def _scratch_bid(self) -> torch.Tensor:
        if self._bid is None:  # made on first use: the CPU paths never need it
            self._bid = torch.full((self.num_nodes,), cuda_hop.INT64_MAX, dtype=torch.int64, device=self.device)
        return self._bid

    def _hop(self, frontier: torch.Tensor, frontier_local: torch.Tensor, fanout: int):
        """(sampled neighbours' global ids, their targets' local ids) for one hop."""
        kernel_seed = None
        if self.kernel and fanout <= cuda_hop.MAX_FANOUT:
            self._hops_drawn += 1
            kernel_seed = int(_mix_seed(self._seed + self._hops_drawn)[0])
        return draw_hop(self.indptr, self.indices, frontier, frontier_local, fanout, self._generator, kernel_seed)


def draw_hop(indptr: torch.Tensor, indices: torch.Tensor, frontier: torch.Tensor, frontier_local: torch.Tensor,
             fanout: int, generator: torch.Generator, kernel_seed: int | None = None):
    """One hop over one CSR: (sampled neighbours' global ids, their targets' local ids).
    kernel_seed: draw with the one-launch CUDA kernel (cuda_hop) seeded so; None: torch ops."""
    if kernel_seed is not None:
        tile = cuda_hop.sample_hop(indptr, indices, frontier, fanout, kernel_seed)
        valid = tile >= 0
        return tile[valid], frontier_local.unsqueeze(1).expand(-1, fanout)[valid]
    device = indptr.device
    start = indptr[frontier]
    degree = indptr[frontier + 1] - start
    m = frontier.shape[0]
    # A tile no wider than the largest degree: "take every neighbour" fanouts stay cheap.
    width = min(fanout, int(degree.max())) if m else 0
    column = torch.arange(width, device=device)
    positions = column.expand(m, width).clone()
    big = torch.nonzero(degree > fanout).squeeze(1)
    if big.numel():
        positions[big] = floyd_positions(degree[big], fanout, generator)
    valid = column.unsqueeze(0) < degree.unsqueeze(1)
    flat = (start.unsqueeze(1) + positions)[valid]
    targets = frontier_local.unsqueeze(1).expand(m, width)[valid]
    return indices[flat].to(torch.int64), targets
