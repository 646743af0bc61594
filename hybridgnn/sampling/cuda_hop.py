"""One sampling hop as a single CUDA kernel (compiled at first use with CuPy's NVRTC).

The torch-op hop (sampling/gpu.py) launches a few dozen small kernels per hop and waits
for the host several times; this kernel does the whole draw in one launch: one thread
per frontier row reads its CSR range (device memory or pinned host memory over UVA),
takes every neighbour when deg <= fanout, else runs Robert Floyd's algorithm with a
counter-based hash as its random source, and writes a [rows, fanout] tile of neighbour
ids padded with -1. The tile has the torch hop's layout (row-major, a row's picks in
draw order), so the caller masks it the same way. The torch hop stays the reference:
tests/gpu checks this kernel against it (uniformity, the subgraph contract).

`sample_batch` runs a whole K-hop batch this way with no host round trip between hops:
each hop is a draw launch over the frontier (its row count read on the device, the grid
sized for the largest frontier possible), then three launches that number the newly
reached nodes without sorting: every copy of an unseen node bids its tile position with
atomicMin, the lowest bid wins, a cumsum over the winners gives their local ids (so new
nodes are numbered by first occurrence, deterministically), and every tile entry is
relabelled through the sampler's global->local map. The host waits once per batch, to
read the per-hop counts; the padded tiles are then compacted into the edge list by
scatter to known positions (compact_edges), not by a boolean index, which would wait
again for its size.

Available when CuPy imports and the tensors are on a CUDA device; `available()` says.
HYBRIDGNN_CUDA_HOP=0 turns it off (the torch-op hop then runs). `sample_batch` is on by
default since it was measured on an H200 (35x one CPU thread at batch 1,024);
HYBRIDGNN_CUDA_BATCH=0 turns it off (the per-hop path then runs).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from hybridgnn.graph.rawkernel import (
    compile_module,
    cupy_or_none,
    launch,
    on_torch_stream,
    ptr,
)

MAX_FANOUT = 64  # per-thread scratch of picked positions; larger fanouts use the torch hop

DRAW_SOURCE = r"""
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Row r's draw for node v: min(deg, fanout) distinct neighbours, -1 past them.
__device__ __forceinline__ void draw_row(const long long* __restrict__ indptr, const INDEX_T* __restrict__ indices,
                                         long long v, long long r, int fanout, unsigned long long seed,
                                         long long* __restrict__ row) {
    long long start = indptr[v];
    long long deg = indptr[v + 1] - start;
    if (deg <= fanout) {
        for (int j = 0; j < fanout; ++j) row[j] = j < deg ? (long long)indices[start + j] : -1LL;
        return;
    }
    long long taken[MAX_FANOUT];
    unsigned long long base = mix64(seed ^ mix64((unsigned long long)r));
    for (int j = 0; j < fanout; ++j) {
        long long upper = deg - fanout + j;  // inclusive bound of this step's draw
        long long t = (long long)(mix64(base + (unsigned long long)j) % (unsigned long long)(upper + 1));
        for (int i = 0; i < j; ++i) {
            if (taken[i] == t) { t = upper; break; }  // upper itself was never drawn before
        }
        taken[j] = t;
        row[j] = (long long)indices[start + t];
    }
}
"""

_SOURCE = DRAW_SOURCE + r"""
extern "C" __global__ void sample_hop(const long long* __restrict__ indptr, const INDEX_T* __restrict__ indices,
                                      const long long* __restrict__ frontier, long long rows, int fanout,
                                      unsigned long long seed, long long* __restrict__ out) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    draw_row(indptr, indices, frontier[r], r, fanout, seed, out + r * fanout);
}

// The frontier of hop h is nodes[bounds[h] .. bounds[h+1]); rows past it write -1 tiles.
extern "C" __global__ void sample_frontier(const long long* __restrict__ indptr, const INDEX_T* __restrict__ indices,
                                           const long long* __restrict__ nodes, const long long* __restrict__ bounds,
                                           int hop, long long max_rows, int fanout, unsigned long long seed,
                                           long long* __restrict__ out) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= max_rows) return;
    long long lo = bounds[hop], hi = bounds[hop + 1];
    long long* row = out + r * fanout;
    if (r >= hi - lo) {
        for (int j = 0; j < fanout; ++j) row[j] = -1LL;
        return;
    }
    draw_row(indptr, indices, nodes[lo + r], r, fanout, seed, row);
}

// Every copy of a node not yet numbered bids its tile position; the lowest wins.
extern "C" __global__ void bid_new(const long long* __restrict__ tile, long long n, const long long* __restrict__ local,
                                   long long* __restrict__ bid) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    long long v = tile[p];
    if (v >= 0 && local[v] < 0) atomicMin(bid + v, p);
}

extern "C" __global__ void flag_winners(const long long* __restrict__ tile, long long n,
                                        const long long* __restrict__ local, const long long* __restrict__ bid,
                                        long long* __restrict__ flag) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    long long v = tile[p];
    flag[p] = (v >= 0 && local[v] < 0 && bid[v] == p) ? 1 : 0;
}

// rank = inclusive cumsum of the flags: winner p is the rank[p]-th new node of this hop.
// Clears the winner's bid (the only bid any copy of it left) for the next hop and batch.
extern "C" __global__ void number_new(const long long* __restrict__ tile, long long n, const long long* __restrict__ rank,
                                      long long* __restrict__ bounds, int hop, long long* __restrict__ local,
                                      long long* __restrict__ nodes, long long* __restrict__ bid) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    long long base = bounds[hop + 1];
    long long before = p ? rank[p - 1] : 0;
    if (rank[p] != before) {
        long long v = tile[p];
        local[v] = base + before;
        nodes[base + before] = v;
        bid[v] = 0x7FFFFFFFFFFFFFFFLL;
    }
    if (p == n - 1) bounds[hop + 2] = base + rank[p];
}

// Tile -> (source local id, target local id), -1 for padding; the target of row r is
// frontier node r, whose local id is bounds[hop] + r.
extern "C" __global__ void relabel(const long long* __restrict__ tile, long long n, int fanout,
                                   const long long* __restrict__ local, const long long* __restrict__ bounds, int hop,
                                   long long* __restrict__ src, long long* __restrict__ dst) {
    long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    long long v = tile[p];
    src[p] = v >= 0 ? local[v] : -1LL;
    dst[p] = v >= 0 ? bounds[hop] + p / fanout : -1LL;
}
"""

INT64_MAX = (1 << 63) - 1


def available(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("HYBRIDGNN_CUDA_HOP", "1") != "0" and cupy_or_none() is not None


def batch_enabled() -> bool:
    """Whether `sample_batch` replaces the per-hop path: unless HYBRIDGNN_CUDA_BATCH=0."""
    return os.environ.get("HYBRIDGNN_CUDA_BATCH", "1") != "0"


def kernel_source(index_dtype: str) -> str:
    """The CUDA source for int32 or int64 column indices (tests compile it with nvcc)."""
    ctype = {"int32": "int", "int64": "long long"}[index_dtype]
    return _SOURCE.replace("INDEX_T", ctype).replace("MAX_FANOUT", str(MAX_FANOUT))


@functools.cache
def _kernel(index_dtype: str, name: str = "sample_hop"):
    return compile_module(kernel_source(index_dtype)).get_function(name)


def sample_hop(indptr: torch.Tensor, indices: torch.Tensor, frontier: torch.Tensor, fanout: int,
               seed: int) -> torch.Tensor:
    """[len(frontier), fanout] int64 neighbour ids (-1 past a row's degree), on the
    current torch stream. indptr must be int64; indices int32 or int64; all on one GPU."""
    if not 1 <= fanout <= MAX_FANOUT:
        raise ValueError(f"the CUDA hop takes fanouts 1..{MAX_FANOUT}, got {fanout}")
    if indptr.dtype != torch.int64 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"need int64 indptr and int32/int64 indices, got {indptr.dtype} and {indices.dtype}")
    rows = int(frontier.shape[0])
    out = torch.empty((rows, fanout), dtype=torch.int64, device=frontier.device)
    if rows == 0:
        return out
    frontier = frontier.contiguous()
    kernel = _kernel(str(indices.dtype).removeprefix("torch."))
    with on_torch_stream(frontier.device):
        launch(kernel, rows, (ptr(indptr), ptr(indices), ptr(frontier), np.int64(rows), np.int32(fanout),
                              np.uint64(seed & 0xFFFF_FFFF_FFFF_FFFF), ptr(out)))
    return out


@functools.lru_cache(maxsize=256)
def worst_case(count: int, fanouts: tuple[int, ...], num_nodes: int) -> tuple[tuple[int, ...], int, int]:
    """(largest frontier per hop, largest hop's tile entries, total tile entries) of a
    batch of `count` distinct seeds: what the kernels' buffers are sized for."""
    rows = [count]
    for f in fanouts[:-1]:
        rows.append(min(rows[-1] * f, num_nodes))
    tiles = [r * f for r, f in zip(rows, fanouts, strict=True)]
    return tuple(rows), max(tiles), sum(tiles)


def sample_batch(indptr: torch.Tensor, indices: torch.Tensor, unique_seeds: torch.Tensor, fanouts,
                 hop_seeds, local: torch.Tensor, bid: torch.Tensor):
    """A whole K-hop batch on the device: (node_ids, edge_index, nodes per hop, edges per
    hop). unique_seeds: distinct seed ids on the device; hop_seeds: one random seed per
    hop. local (-1 everywhere) and bid (INT64_MAX everywhere), both [num_nodes] int64,
    are the caller's scratch maps and are left as they were found."""
    if indptr.dtype != torch.int64 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"need int64 indptr and int32/int64 indices, got {indptr.dtype} and {indices.dtype}")
    fanouts = [int(f) for f in fanouts]
    if not fanouts or not all(1 <= f <= MAX_FANOUT for f in fanouts):
        raise ValueError(f"the CUDA sampler takes fanouts 1..{MAX_FANOUT}, got {fanouts}")
    device = unique_seeds.device
    num_nodes = int(indptr.shape[0]) - 1
    count = int(unique_seeds.shape[0])
    # Largest frontier each hop can have: the tiles and grids are sized for it, so no hop
    # waits for the previous one's count.
    max_rows, _, total_tiles = worst_case(count, tuple(fanouts), num_nodes)
    capacity = min(count + total_tiles, num_nodes)
    name = str(indices.dtype).removeprefix("torch.")
    src_parts, dst_parts = [], []
    try:
        nodes = torch.empty(max(capacity, count), dtype=torch.int64, device=device)
        nodes[:count] = unique_seeds
        local[unique_seeds] = torch.arange(count, dtype=torch.int64, device=device)
        bounds = torch.zeros(len(fanouts) + 2, dtype=torch.int64, device=device)
        bounds[1] = count
        with on_torch_stream(device):
            for hop, (fanout, rows) in enumerate(zip(fanouts, max_rows, strict=True)):
                n = rows * fanout
                tile = torch.empty(n, dtype=torch.int64, device=device)
                launch(_kernel(name, "sample_frontier"), rows,
                        (ptr(indptr), ptr(indices), ptr(nodes), ptr(bounds), np.int32(hop), np.int64(rows),
                         np.int32(fanout), np.uint64(int(hop_seeds[hop]) & 0xFFFF_FFFF_FFFF_FFFF), ptr(tile)))
                flag = torch.empty(n, dtype=torch.int64, device=device)
                launch(_kernel(name, "bid_new"), n, (ptr(tile), np.int64(n), ptr(local), ptr(bid)))
                launch(_kernel(name, "flag_winners"), n,
                        (ptr(tile), np.int64(n), ptr(local), ptr(bid), ptr(flag)))
                rank = torch.cumsum(flag, 0)
                launch(_kernel(name, "number_new"), n,
                        (ptr(tile), np.int64(n), ptr(rank), ptr(bounds), np.int32(hop), ptr(local), ptr(nodes),
                         ptr(bid)))
                if n == 0:  # an empty hop still closes its bounds entry
                    bounds[hop + 2] = bounds[hop + 1]
                src, dst = torch.empty_like(tile), torch.empty_like(tile)
                launch(_kernel(name, "relabel"), n,
                        (ptr(tile), np.int64(n), np.int32(fanout), ptr(local), ptr(bounds), np.int32(hop),
                         ptr(src), ptr(dst)))
                src_parts.append(src)
                dst_parts.append(dst)
        src, dst = torch.cat(src_parts), torch.cat(dst_parts)
        keep = src >= 0
        per_hop = torch.stack([(s >= 0).sum() for s in src_parts])
        counts = torch.cat([bounds, per_hop]).tolist()  # the one wait for the counts
    except BaseException:
        # Which entries were written is only known on the device: reset the maps whole.
        local.fill_(-1)
        bid.fill_(INT64_MAX)
        raise
    ends, num_sampled_edges = counts[:len(fanouts) + 2], counts[len(fanouts) + 2:]
    node_ids = nodes[:ends[-1]].clone()  # not a view pinning the worst-case buffer
    local[node_ids] = -1
    num_sampled_nodes = [ends[i + 1] - ends[i] for i in range(len(fanouts) + 1)]
    edge_index = compact_edges(src, dst, keep, sum(num_sampled_edges))
    return node_ids, edge_index, num_sampled_nodes, num_sampled_edges


def compact_edges(src: torch.Tensor, dst: torch.Tensor, keep: torch.Tensor, count: int) -> torch.Tensor:
    """[2, count] edge list of the kept (src, dst) pairs, in order: what
    torch.stack([src[keep], dst[keep]]) gives when `count` pairs are kept, without the
    boolean index's wait for the device to say how many (the caller knows). Each kept
    pair is scattered to its rank among the kept; the others to one spare slot. Contiguous
    (rows of `count`, the spare slot past both), as torch.stack's is."""
    rank = torch.cumsum(keep, 0) - 1
    where = torch.where(keep, rank, 2 * count)
    flat = torch.empty(2 * count + 1, dtype=src.dtype, device=src.device)
    flat.scatter_(0, where, src)
    flat.scatter_(0, torch.where(keep, rank + count, 2 * count), dst)
    return flat[:2 * count].view(2, count)
