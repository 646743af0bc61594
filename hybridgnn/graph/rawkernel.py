"""CUDA kernels written as source and compiled at first use with CuPy (NVRTC), launched
on torch's current stream over torch tensors (no copies: kernels get raw pointers).

Used by the sampling kernels (sampling/cuda_hop.py) and the feature gather
(features/cuda_gather.py). CuPy is optional: `cupy_or_none()` is None without it or
without a usable CUDA runtime, and callers keep a torch-op path for that case.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

THREADS = 128


@functools.cache
def cupy_or_none():
    try:
        import cupy
    except Exception:  # not installed, or no usable CUDA runtime for it
        return None
    return cupy


@functools.cache
def compile_module(source: str):
    """A compiled module (cached per source text; NVRTC runs once per process)."""
    return cupy_or_none().RawModule(code=source, options=("--std=c++17",))


def ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """CuPy launches inside go to torch's current stream on `device`, so they are ordered
    with the torch ops around them and nothing needs an extra synchronisation."""
    cupy = cupy_or_none()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index):
        yield


def launch(kernel, n: int, args, threads: int = THREADS) -> None:
    """One thread per item (n of them); call inside on_torch_stream."""
    if n > 0:
        kernel(((n + threads - 1) // threads,), (threads,), args)
