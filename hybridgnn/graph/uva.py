"""One graph in host memory, shared by CPU workers and GPU kernels (UVA zero-copy).

`HostRegistration.register` registers an existing host buffer (the dataset's mmap'd
arrays) with cudaHostRegister, so the pages are locked and mapped into the GPU's address
space; with unified virtual addressing the device pointer equals the host pointer, and
`uva_view` wraps it as a CUDA tensor without copying. CPU samplers keep reading the
same numpy arrays: the graph exists once. Where registration is refused (some kernels
refuse read-only file mappings), `DeviceGraph.host_visible` copies the array once into a
pinned allocation that the device reads instead (the CPU side keeps reading the original,
so that array is then held twice).

`DeviceGraph` gives the GPU sampler its CSR tensors for a placement:
    uva  topology stays in pinned host memory, read zero-copy by the kernels
    gpu  topology copied to device memory (fastest when it fits)
On a CPU device both are the host tensors themselves, which is how CI runs this code.
`TypedDeviceGraph` does the same for a heterogeneous graph, one DeviceGraph per edge type.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridgnn.capabilities import DEVICE_GATE
from hybridgnn.graph.host import host_tensor

log = logging.getLogger(__name__)

PLACEMENTS = ("uva", "gpu")
# cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterReadOnly
_REGISTER_FLAGS = 0x1 | 0x2 | 0x8


class _CudaArrayView:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to alias a pointer."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner):
        self._owner = owner  # keeps the host buffer alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": np.dtype(dtype).str, "data": (ptr, False), "version": 3, "strides": None,
        }


@dataclass
class HostRegistration:
    """Pinned host buffers registered by this process; released once, in reverse order."""

    pointers: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, array: np.ndarray) -> bool:
        """Pin `array`'s pages in place. False (and nothing pinned) where CUDA refuses."""
        if not array.flags.c_contiguous:
            raise ValueError("only C-contiguous arrays can be pinned in place")
        ptr, nbytes = array.ctypes.data, array.nbytes
        if nbytes == 0:
            return True
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
        code = int(getattr(err, "value", err))
        if code != 0:
            _absorb_last_cuda_error()
            log.warning("cudaHostRegister of %d bytes failed (error %d); copying into pinned memory", nbytes, code)
            return False
        with self._lock:
            self.pointers.append(ptr)
        return True

    def release(self) -> None:
        with self._lock:
            pointers, self.pointers = self.pointers[::-1], []
        for ptr in pointers:
            torch.cuda.cudart().cudaHostUnregister(ptr)


def _absorb_last_cuda_error() -> None:
    """A failed runtime call leaves cudaGetLastError set, and torch's next kernel-launch
    check would report it as that kernel's failure; one throwaway launch takes it."""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except RuntimeError:
        pass


def uva_view(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory (registered or pin_memory-allocated): kernels
    read it over PCIe/NVLink-C2C without a copy."""
    view = _CudaArrayView(array.ctypes.data, tuple(array.shape), array.dtype, array)
    with torch.cuda.device(device):
        return torch.as_tensor(view, device=device)


class DeviceGraph:
    """The CSR (and optionally the features) as tensors a sampler on `device` reads."""

    def __init__(self, graph, device: str | torch.device, placement: str = "uva"):
        if placement not in PLACEMENTS:
            raise ValueError(f"graph placement must be one of {PLACEMENTS}, got {placement!r}")
        self.device = torch.device(device)
        self.placement = placement
        self.registration = HostRegistration()
        self._pinned_copies: list[torch.Tensor] = []
        indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices)
        if self.device.type == "cpu":
            self.indptr, self.indices = host_tensor(indptr), host_tensor(indices)
        elif placement == "gpu":
            self.indptr = host_tensor(indptr).to(self.device)
            self.indices = host_tensor(indices).to(self.device)
        else:
            self.indptr = self.host_visible(indptr)
            self.indices = self.host_visible(indices)

    def host_visible(self, array: np.ndarray) -> torch.Tensor:
        """`array` as a tensor the device reads zero-copy: pinned in place when CUDA allows,
        else copied once into a pinned allocation."""
        if self.device.type == "cpu":
            return host_tensor(array)
        if array.nbytes == 0:  # nothing to pin, and a view of its unregistered pointer may be refused
            return host_tensor(array).to(self.device)
        array = np.ascontiguousarray(array)
        if self.registration.register(array):
            return uva_view(array, self.device)
        pinned = torch.empty(array.shape, dtype=host_tensor(array[:0]).dtype, pin_memory=True)
        pinned.numpy()[...] = array
        self._pinned_copies.append(pinned)
        return uva_view(pinned.numpy(), self.device)

    def close(self) -> None:
        """Unregister pinned buffers (once the kernels that read them are done)."""
        if self.device.type == "cuda":
            with DEVICE_GATE.work():  # no CUDA call while a graph is captured
                torch.cuda.synchronize(self.device)
                self.registration.release()
        self._pinned_copies.clear()


class TypedDeviceGraph:
    """A heterogeneous graph's CSR per edge type as tensors typed samplers on `device` read
    (one DeviceGraph per edge type, same placements): made once per process and device and
    shared by every worker there (each sampler owns only its id maps), closed once."""

    def __init__(self, graph, device: str | torch.device, placement: str = "uva"):
        self.device = torch.device(device)
        self.placement = placement
        self._parts: dict = {}
        try:
            for edge_type, data in graph.edges.items():
                self._parts[edge_type] = DeviceGraph(data, self.device, placement)
        except BaseException:
            self.close()
            raise
        self.csr = {e: (g.indptr, g.indices) for e, g in self._parts.items()}

    def close(self) -> None:
        """Unregister the pinned buffers (once the kernels that read them are done)."""
        parts, self._parts = list(self._parts.values()), {}
        for part in parts:
            part.close()
