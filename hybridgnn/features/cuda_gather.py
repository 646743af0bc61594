"""The device feature cache's gather as one CUDA kernel (CuPy RawKernel, NVRTC).

The torch-op gather (features/store.py) splits ids into hits and misses with two
nonzero calls (each a host wait), sorts the misses and scatters two index_selects into
the output: five to eight launches and a few hundred microseconds for a batch. This
kernel does it in one launch: a group of threads per output row looks the node up in
the slot map and copies its row, from the device cache on a hit or, on a miss, from the
pinned host matrix through its UVA view (so misses need no staging copy), in 16-, 8-,
4-, 2- or 1-byte chunks (the widest that the row size and every base address allow). A
block-level count gives the hits. Misses are read in request order, not id order: a
row is one contiguous read either way.

Available when CuPy imports, the cache, the host view and the output are on one CUDA
device; `usable()` says. On by default since it was measured on an H200 (0.64 of a
device-to-device copy); HYBRIDGNN_CUDA_GATHER=0 turns it off (torch ops then gather).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from hybridgnn.graph.rawkernel import compile_module, cupy_or_none, on_torch_stream, ptr

_SOURCE = r"""
extern "C" __global__ void gather_cached(const long long* __restrict__ ids, long long n, int chunks, int group_shift,
                                         const int* __restrict__ slot, const CHUNK_T* __restrict__ cache,
                                         const CHUNK_T* __restrict__ host, CHUNK_T* __restrict__ out,
                                         unsigned long long* __restrict__ hits) {
    // 2**group_shift threads per row; blockDim.x is a multiple of the group size.
    long long i = (long long)blockIdx.x * (blockDim.x >> group_shift) + (threadIdx.x >> group_shift);
    int lane = threadIdx.x & ((1 << group_shift) - 1);
    int hit = 0;
    if (i < n) {
        long long id = ids[i];
        int s = slot[id];
        const CHUNK_T* src = s >= 0 ? cache + (long long)s * chunks : host + id * chunks;
        CHUNK_T* dst = out + i * chunks;
        for (int c = lane; c < chunks; c += (1 << group_shift)) dst[c] = src[c];
        hit = (lane == 0 && s >= 0);
    }
    int block_hits = __syncthreads_count(hit);
    if (threadIdx.x == 0 && block_hits) atomicAdd(hits, (unsigned long long)block_hits);
}
"""

_CHUNK_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_BLOCK = 256


def kernel_source(width: int) -> str:
    """The CUDA source for chunks of `width` bytes (tests compile it with nvcc)."""
    return _SOURCE.replace("CHUNK_T", _CHUNK_TYPES[width])


@functools.cache
def _kernel(width: int):
    return compile_module(kernel_source(width)).get_function("gather_cached")


def usable(cache: torch.Tensor, host: torch.Tensor, slot: torch.Tensor) -> bool:
    device = cache.device
    return (device.type == "cuda" and os.environ.get("HYBRIDGNN_CUDA_GATHER", "1") != "0"
            and cupy_or_none() is not None and host.device == device and slot.device == device
            and host.dtype == cache.dtype and slot.dtype == torch.int32 and cache.dim() == host.dim() == 2
            and cache.shape[1] == host.shape[1] and cache.is_contiguous() and host.is_contiguous())


def chunk_bytes(row_bytes: int, *addresses: int) -> int:
    """The widest chunk that divides the row size and every base address."""
    for width in (16, 8, 4, 2):
        if row_bytes % width == 0 and all(a % width == 0 for a in addresses):
            return width
    return 1


def group_shift(chunks: int) -> int:
    """log2 of the threads per row: the smallest power of two >= chunks, at most a warp."""
    return min(5, max(0, (chunks - 1).bit_length()))


def gather_cached(ids: torch.Tensor, slot: torch.Tensor, cache: torch.Tensor, host: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, F] rows on the cache's device, a one-element device tensor counting hits).
    ids: int64 node ids on that device; slot[id] is the row in cache, -1 for a miss."""
    n = int(ids.shape[0])
    out = torch.empty((n, cache.shape[1]), dtype=cache.dtype, device=cache.device)
    hits = torch.zeros(1, dtype=torch.int64, device=cache.device)
    if n == 0 or cache.shape[1] == 0:
        return out, hits
    row_bytes = cache.shape[1] * cache.element_size()
    width = chunk_bytes(row_bytes, cache.data_ptr(), host.data_ptr(), out.data_ptr())
    chunks = row_bytes // width
    shift = group_shift(chunks)
    rows_per_block = _BLOCK >> shift
    kernel = _kernel(width)
    ids = ids.contiguous()
    with on_torch_stream(cache.device):
        kernel(((n + rows_per_block - 1) // rows_per_block,), (_BLOCK,),
               (ptr(ids), np.int64(n), np.int32(chunks), np.int32(shift), ptr(slot), ptr(cache), ptr(host),
                ptr(out), ptr(hits)))
    return out, hits
