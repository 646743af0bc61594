"""A sample laid out in its CUDA-graph bucket's slots (pipelines/graphed.py) in one launch.

graphed.py's torch ops do it in about a dozen launches (bucketize, index, add and
index_copy for the rows and for each edge row, a copy of the dummy edges); for a one-seed
batch those launches cost more than the replay they feed. This kernel does the same in
one: thread i either moves one element of a real node's feature row to its slot, or fills
one edge slot of the bucket, with a real edge relabelled into slot numbering or, past a
hop's real edges, the hop's dummy edge. The torch ops stay the reference and the path
without CuPy; tests run this source on the CPU (one thread at a time: it has no barrier)
and on a GPU against them, and GraphedForward's first replay of each bucket is checked
against the eager forward as before.

On by default on a CUDA device with CuPy; HYBRIDGNN_CUDA_LAYOUT=0 turns it off.
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

_SOURCE = r"""
// plan: real[hops + 2] (where each hop's real nodes begin, then their total),
// starts[hops + 2] (where each hop's node slots begin, then the slots' total),
// ereal[hops + 1] (where each hop's real edges begin, then their total),
// estarts[hops + 1] (where each hop's edge slots begin, then the slots' total).
__device__ __forceinline__ long long to_slot(long long v, const long long* real, const long long* starts) {
    int k = 0;
    while (v >= real[k + 1]) ++k;
    return starts[k] + v - real[k];
}

// Threads [0, real nodes * row_elems) move feature elements; the next edge_slots threads
// fill the bucket's edge slots (row 0: sources, row 1: targets).
extern "C" __global__ void lay_out(const ELEM_T* __restrict__ x, long long row_elems,
                                   const long long* __restrict__ src, const long long* __restrict__ dst,
                                   const long long* __restrict__ plan, int hops,
                                   ELEM_T* __restrict__ bucket_x, long long* __restrict__ bucket_edges,
                                   long long edge_slots) {
    const long long* real = plan;
    const long long* starts = plan + hops + 2;
    const long long* ereal = plan + 2 * (hops + 2);
    const long long* estarts = ereal + hops + 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long cells = real[hops + 1] * row_elems;
    if (i < cells) {
        const long long row = i / row_elems;
        bucket_x[to_slot(row, real, starts) * row_elems + (i - row * row_elems)] = x[i];
        return;
    }
    const long long j = i - cells;
    if (j >= edge_slots) return;
    int k = 0;  // edges of hop k + 1: targets in node hop k, sources in node hop k + 1
    while (j >= estarts[k + 1]) ++k;
    const long long at = j - estarts[k];
    long long s, t;
    if (at < ereal[k + 1] - ereal[k]) {
        s = to_slot(src[ereal[k] + at], real, starts);
        t = to_slot(dst[ereal[k] + at], real, starts);
    } else {  // a dummy edge: hop k + 1's last (dummy) node slot into hop k's
        s = starts[k + 2] - 1;
        t = starts[k + 1] - 1;
    }
    bucket_edges[j] = s;
    bucket_edges[edge_slots + j] = t;
}
"""

_ELEMENT = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def available(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("HYBRIDGNN_CUDA_LAYOUT", "1") != "0"
            and cupy_or_none() is not None)


def kernel_source(itemsize: int) -> str:
    """The CUDA source for feature elements of `itemsize` bytes (copied as raw bits)."""
    return _SOURCE.replace("ELEM_T", _ELEMENT[itemsize])


@functools.cache
def _kernel(itemsize: int):
    return compile_module(kernel_source(itemsize)).get_function("lay_out")


def plan(nodes: list[int], edges: list[int], node_starts: list[int], edge_starts: list[int]) -> list[int]:
    """The kernel's plan (see the source) for a sample's nodes and edges per hop in a
    bucket whose slots begin at node_starts and edge_starts (each ending with its total)."""
    real = [0]
    for n in nodes:
        real.append(real[-1] + n)
    ereal = [0]
    for e in edges:
        ereal.append(ereal[-1] + e)
    return real + list(node_starts) + ereal + list(edge_starts)


def lay_out(x: torch.Tensor, edge_index: torch.Tensor, staged_plan: torch.Tensor, hops: int, total_nodes: int,
            bucket_x: torch.Tensor, bucket_edges: torch.Tensor) -> None:
    """Write the sample (x: its [total_nodes, F] rows; edge_index: [2, E] local ids) into
    the bucket's buffers, on the current torch stream. staged_plan: plan() on the device."""
    if edge_index.dtype != torch.int64 or edge_index.stride(1) != 1:  # the kernel reads int64 rows
        edge_index = edge_index.to(torch.int64).contiguous()
    x = x[:total_nodes].contiguous()
    row_elems = int(x.shape[1]) if x.dim() == 2 else 0
    edge_slots = int(bucket_edges.shape[1])
    n = total_nodes * row_elems + edge_slots
    with on_torch_stream(x.device):
        launch(_kernel(x.element_size()), n,
               (ptr(x), np.int64(row_elems), ptr(edge_index[0]), ptr(edge_index[1]), ptr(staged_plan),
                np.int32(hops), ptr(bucket_x), ptr(bucket_edges), np.int64(edge_slots)), threads=256)
