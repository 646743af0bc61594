"""A small batch's whole K-hop sample in one CUDA launch of one thread block.

Why: `cuda_hop.sample_batch` runs a hop as five launches over the whole device, so a
one-seed three-hop sample is some twenty launches from Python plus torch's ops around
them; on an H200 that, not the draws, set its cost (about 0.9 ms). A small batch fits in
one block: its threads draw each hop's rows, then number the hop's new nodes and write
its edges in chunks of the block's width, with a barrier between phases instead of a
launch. The host stages everything the kernel reads (fanouts, per-hop random seeds, the
unique seeds, the seed index) with one copy from a pinned buffer, launches once, and
waits once, to read the counts.

The kernel computes what sample_batch computes, bit for bit: the same draws (cuda_hop's
draw_row, seeded per hop and row), new nodes numbered by the first tile position that
reaches them (the lowest bid wins), edges in tile order hop by hop, the same scratch maps
left as they were found. TorchSampler checks this on its first small batch and keeps to
sample_batch if they differ (tests/gpu compare them over many batches).

Which batches: those whose worst-case tiles (seeds·f1 + seeds·f1·f2 + …) hold at most
HYBRIDGNN_CUDA_SMALL entries (default 32,768: up to 35 seeds at fanouts 15,10,5; 0 turns
it off). Past that the block's serial chunks cost more than the launches they save.

The kernel uses only barriers, global atomicMin and shared arrays, no warp intrinsics, so
tests/integration runs this very source on the CPU (one std::thread per CUDA thread,
a barrier for __syncthreads) without a GPU.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from hybridgnn.graph.rawkernel import compile_module, on_torch_stream, ptr
from hybridgnn.sampling.cuda_hop import DRAW_SOURCE, MAX_FANOUT, worst_case

THREADS = 256  # the block's width: one chunk of tile positions per barrier round
MAX_HOPS = 8  # the per-hop bounds live in shared memory
DEFAULT_MAX_TILE = 32768

_KERNEL = r"""
// Inclusive scan of (a, b) over the block, in s_a[tid], s_b[tid]; returns nothing, the
// totals are s_a[THREADS - 1], s_b[THREADS - 1]. Callers barrier before reusing s_a, s_b.
__device__ __forceinline__ void block_scan2(long long* s_a, long long* s_b, long long a, long long b, int tid) {
    s_a[tid] = a;
    s_b[tid] = b;
    __syncthreads();
    for (int off = 1; off < THREADS; off <<= 1) {
        long long add_a = tid >= off ? s_a[tid - off] : 0;
        long long add_b = tid >= off ? s_b[tid - off] : 0;
        __syncthreads();
        s_a[tid] += add_a;
        s_b[tid] += add_b;
        __syncthreads();
    }
}

// One block of THREADS threads samples `hops` hops from the `count` distinct seeds.
// params: fanouts[hops], hop seeds[hops] (as unsigned), seeds[count]. local (-1) and bid
// (INT64_MAX) are the [num_nodes] scratch maps, left as found. tile: scratch for the
// largest hop's [rows, fanout] draws. nodes: the sample's node ids by local id. edges:
// [2, E] once done (src row then dst row, E = total edges), with dst_tmp as scratch for
// the dst row until E is known. counts: bounds[hops + 2] (where each hop's nodes begin,
// then the total), then edges per hop[hops].
extern "C" __global__ void sample_small(const long long* __restrict__ indptr, const INDEX_T* __restrict__ indices,
                                        const long long* __restrict__ params, int hops, long long count,
                                        long long* __restrict__ local, long long* __restrict__ bid,
                                        long long* __restrict__ tile, long long* __restrict__ nodes,
                                        long long* __restrict__ edges, long long* __restrict__ dst_tmp,
                                        long long* __restrict__ counts) {
    __shared__ long long s_a[THREADS];
    __shared__ long long s_b[THREADS];
    __shared__ long long bnd[MAX_HOPS + 2];
    const int tid = threadIdx.x;
    const long long* fanouts = params;
    const unsigned long long* hop_seeds = (const unsigned long long*)(params + hops);
    const long long* seeds = params + 2 * hops;
    for (long long i = tid; i < count; i += THREADS) {
        nodes[i] = seeds[i];
        local[seeds[i]] = i;
    }
    if (tid == 0) {
        bnd[0] = 0;
        bnd[1] = count;
    }
    long long edge_base = 0;  // the same in every thread
    __syncthreads();
    for (int hop = 0; hop < hops; ++hop) {
        const long long lo = bnd[hop], rows = bnd[hop + 1] - lo;
        const int fanout = (int)fanouts[hop];
        const long long n = rows * fanout;
        for (long long r = tid; r < rows; r += THREADS)
            draw_row(indptr, indices, nodes[lo + r], r, fanout, hop_seeds[hop], tile + r * fanout);
        __syncthreads();
        for (long long p = tid; p < n; p += THREADS) {  // every copy of an unnumbered node bids its position
            long long v = tile[p];
            if (v >= 0 && local[v] < 0) atomicMin(bid + v, p);
        }
        __syncthreads();
        long long added = 0, linked = 0;  // this hop's new nodes and edges so far, the same in every thread
        for (long long chunk = 0; chunk < n; chunk += THREADS) {
            const long long p = chunk + tid;
            const long long v = p < n ? tile[p] : -1LL;
            const long long won = (v >= 0 && local[v] < 0 && bid[v] == p) ? 1 : 0;
            block_scan2(s_a, s_b, won, v >= 0 ? 1 : 0, tid);
            if (won) {  // the first position reaching v numbers it; its bid was the only one left
                const long long id = bnd[hop + 1] + added + s_a[tid] - 1;
                local[v] = id;
                nodes[id] = v;
                bid[v] = 0x7FFFFFFFFFFFFFFFLL;
            }
            __syncthreads();  // every node this chunk reaches is numbered (at this or an earlier position)
            if (v >= 0) {
                const long long at = edge_base + linked + s_b[tid] - 1;
                edges[at] = local[v];
                dst_tmp[at] = lo + p / fanout;
            }
            added += s_a[THREADS - 1];
            linked += s_b[THREADS - 1];
            __syncthreads();  // s_a, s_b and this chunk's numbering are read before the next chunk
        }
        if (tid == 0) {
            bnd[hop + 2] = bnd[hop + 1] + added;
            counts[hops + 2 + hop] = linked;
        }
        edge_base += linked;
        __syncthreads();
    }
    for (long long i = tid; i < edge_base; i += THREADS) edges[edge_base + i] = dst_tmp[i];
    for (long long i = tid; i < bnd[hops + 1]; i += THREADS) local[nodes[i]] = -1;
    for (int i = tid; i < hops + 2; i += THREADS) counts[i] = bnd[i];
}
"""


def max_tile() -> int:
    """HYBRIDGNN_CUDA_SMALL: the most worst-case tile entries a one-block batch may have."""
    raw = os.environ.get("HYBRIDGNN_CUDA_SMALL", str(DEFAULT_MAX_TILE))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"HYBRIDGNN_CUDA_SMALL must be an integer (0 turns it off), got {raw!r}") from None
    return max(value, 0)


def kernel_source(index_dtype: str, threads: int = THREADS) -> str:
    """The CUDA source for int32 or int64 column indices; `threads` is the block width
    it is written for (a power of two; tests run narrower blocks on the CPU)."""
    if threads < 1 or threads & (threads - 1):
        raise ValueError(f"the block width must be a power of two, got {threads}")
    ctype = {"int32": "int", "int64": "long long"}[index_dtype]
    source = DRAW_SOURCE + _KERNEL
    return (source.replace("INDEX_T", ctype).replace("MAX_FANOUT", str(MAX_FANOUT))
            .replace("MAX_HOPS", str(MAX_HOPS)).replace("THREADS", str(threads)))


@functools.cache
def _kernel(index_dtype: str):
    return compile_module(kernel_source(index_dtype)).get_function("sample_small")


class SmallBatches:
    """One worker's one-launch sampler (module docstring): owns a pinned staging buffer,
    used by one thread at a time on the current torch stream."""

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, fanouts, *, limit: int | None = None):
        self.indptr, self.indices = indptr, indices
        self.fanouts = tuple(int(f) for f in fanouts)
        self.num_nodes = int(indptr.shape[0]) - 1
        self.limit = max_tile() if limit is None else int(limit)
        self.device = indptr.device
        self._name = str(indices.dtype).removeprefix("torch.")
        self._staging = torch.empty(0, dtype=torch.int64)
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None

    def fits(self, count: int) -> bool:
        """Whether a batch of `count` distinct seeds runs in one block."""
        if not (1 <= len(self.fanouts) <= MAX_HOPS and all(1 <= f <= MAX_FANOUT for f in self.fanouts)):
            return False
        if self.indptr.dtype != torch.int64 or self.indices.dtype not in (torch.int32, torch.int64):
            return False
        return count >= 1 and worst_case(count, self.fanouts, self.num_nodes)[2] <= self.limit

    def stage(self, unique_seeds: torch.Tensor, seed_index: torch.Tensor, hop_seeds) -> tuple[torch.Tensor, int]:
        """Copy the kernel's parameters and the seed index to the device in one copy:
        (the device buffer, where the seed index begins in it). Host tensors in."""
        hops, count = len(self.fanouts), int(unique_seeds.shape[0])
        size = 2 * hops + count + int(seed_index.shape[0])
        if self._copied is not None:
            self._copied.synchronize()  # the last batch's copy has read the staging buffer
        if self._staging.numel() < size:
            self._staging = torch.empty(max(size, 2 * self._staging.numel(), 64), dtype=torch.int64,
                                        pin_memory=self.device.type == "cuda")
        host = self._staging[:size]
        host[:hops] = torch.tensor(self.fanouts, dtype=torch.int64)
        seeds64 = np.array([int(s) & 0xFFFF_FFFF_FFFF_FFFF for s in hop_seeds], dtype=np.uint64).view(np.int64)
        host[hops:2 * hops] = torch.from_numpy(seeds64)
        host[2 * hops:2 * hops + count] = unique_seeds
        host[2 * hops + count:] = seed_index
        staged = torch.empty(size, dtype=torch.int64, device=self.device)
        staged.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        return staged, 2 * hops + count

    def sample(self, staged: torch.Tensor, count: int, local: torch.Tensor, bid: torch.Tensor):
        """(node_ids, edge_index, nodes per hop, edges per hop) of the staged batch, in one
        launch and one wait. local and bid: the caller's scratch maps (cuda_hop.sample_batch).
        node_ids and edge_index are views of one worst-case buffer (at most about 1.2 MB at
        the default limit), kept alive with them rather than copied out by two more launches."""
        hops = len(self.fanouts)
        _, tile_cap, total_tiles = worst_case(count, self.fanouts, self.num_nodes)
        node_cap = min(count + total_tiles, max(self.num_nodes, count))
        edge_cap = total_tiles
        sizes = [tile_cap, node_cap, 2 * edge_cap, edge_cap, 2 * hops + 2]
        out = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        tile, nodes, edges, dst_tmp, counts = torch.split(out, sizes)
        try:
            with on_torch_stream(self.device):
                _kernel(self._name)((1,), (THREADS,), (
                    ptr(self.indptr), ptr(self.indices), ptr(staged), np.int32(hops), np.int64(count),
                    ptr(local), ptr(bid), ptr(tile), ptr(nodes), ptr(edges), ptr(dst_tmp), ptr(counts)))
            read = counts.tolist()  # the one wait
        except BaseException:
            local.fill_(-1)  # which entries were written is only known on the device
            bid.fill_((1 << 63) - 1)
            raise
        bounds, per_hop = read[:hops + 2], read[hops + 2:]
        total_edges = sum(per_hop)
        node_ids = nodes[:bounds[-1]]
        edge_index = edges[:2 * total_edges].view(2, total_edges)
        return node_ids, edge_index, [bounds[i + 1] - bounds[i] for i in range(hops + 1)], per_hop
