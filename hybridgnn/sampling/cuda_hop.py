"""One sampling hop as a single CUDA kernel (compiled at first use with CuPy's NVRTC).

The torch-op hop (sampling/gpu.py) launches a few dozen small kernels per hop and waits
for the host several times; this kernel does the whole draw in one launch: one thread
per frontier row reads its CSR range (device memory or pinned host memory over UVA),
takes every neighbour when deg <= fanout, else runs Robert Floyd's algorithm with a
counter-based hash as its random source, and writes a [rows, fanout] tile of neighbour
ids padded with -1. The tile has the torch hop's layout (row-major, a row's picks in
draw order), so the caller masks it the same way. The torch hop stays the reference:
tests/gpu checks this kernel against it (uniformity, the subgraph contract).

Available when CuPy imports and the tensors are on a CUDA device; `available()` says.
HYBRIDGNN_CUDA_HOP=0 turns it off (the torch-op hop then runs).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

MAX_FANOUT = 64  # per-thread scratch of picked positions; larger fanouts use the torch hop

_SOURCE = r"""
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void sample_hop(const long long* __restrict__ indptr, const INDEX_T* __restrict__ indices,
                                      const long long* __restrict__ frontier, long long rows, int fanout,
                                      unsigned long long seed, long long* __restrict__ out) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    long long v = frontier[r];
    long long start = indptr[v];
    long long deg = indptr[v + 1] - start;
    long long* row = out + r * fanout;
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

_THREADS = 128


@functools.cache
def _cupy():
    try:
        import cupy
    except Exception:  # not installed, or no usable CUDA runtime for it
        return None
    return cupy


def available(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("HYBRIDGNN_CUDA_HOP", "1") != "0" and _cupy() is not None


@functools.cache
def _kernel(index_dtype: str):
    cupy = _cupy()
    ctype = {"int32": "int", "int64": "long long"}[index_dtype]
    source = _SOURCE.replace("INDEX_T", ctype).replace("MAX_FANOUT", str(MAX_FANOUT))
    return cupy.RawKernel(source, "sample_hop", options=("--std=c++17",))


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
    cupy = _cupy()
    kernel = _kernel(str(indices.dtype).removeprefix("torch."))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(frontier.device).cuda_stream)
    with cupy.cuda.Device(frontier.device.index or 0), stream:
        kernel(((rows + _THREADS - 1) // _THREADS,), (_THREADS,),
               (np.uint64(indptr.data_ptr()), np.uint64(indices.data_ptr()), np.uint64(frontier.data_ptr()),
                np.int64(rows), np.int32(fanout), np.uint64(seed & 0xFFFF_FFFF_FFFF_FFFF), np.uint64(out.data_ptr())))
    return out
