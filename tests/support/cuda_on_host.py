"""The project's CUDA kernels run on the CPU, through the Python that launches them.

Every kernel module compiles its source with `compile_module(source).get_function(name)`
and launches the result as CuPy does, `kernel(grid, block, args)`, with raw pointers.
`kernels_on_host(monkeypatch, workdir)` replaces those compilers with g++: each source is
built, with tests/support/cuda_host_shim.h, into a shared library holding one runner per
kernel, and each launch runs the grid on the CPU over the very tensors (CPU tensors: a
pointer is a host address). A block's threads run as std::threads meeting at a barrier
where the source has __syncthreads, else one after another. Each launch's arguments are
checked against the kernel's signature (count and width: a pointer or unsigned long long
as np.uint64, long long as np.int64, int as np.int32), which is what CuPy packs.

So the launch code, the buffer sizes, the argument order and the kernels themselves are
tested without a GPU; what is left to a GPU is speed, the memory model beyond a block's
barrier, and the CUDA runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

SUPPORT = Path(__file__).resolve().parent
GXX = shutil.which("g++")

_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_SCALARS = {"long long": (ctypes.c_longlong, np.int64), "int": (ctypes.c_int, np.int32),
            "unsigned long long": (ctypes.c_ulonglong, np.uint64)}


def kernel_params(source: str) -> dict[str, list[tuple[str, bool, str]]]:
    """Per kernel: its parameters as (C type, is a pointer, name)."""
    kernels = {}
    for name, text in _SIGNATURE.findall(source):
        params = []
        for raw in text.split(","):
            words = raw.replace("__restrict__", " ").replace("const", " ").replace("*", " * ").split()
            pointer = "*" in words
            words = [w for w in words if w != "*"]
            params.append((" ".join(words[:-1]), pointer, words[-1]))
        kernels[name] = params
    return kernels


_HOST_EXTRAS = r"""
// What the kernels use beyond the shim: CUDA's vector chunk types, atomicAdd and
// __syncthreads_count.
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
    return std::atomic_ref<unsigned long long>(*address).fetch_add(value, std::memory_order_relaxed);
}
inline int __syncthreads_count(int predicate) {
    static std::atomic<int> count{0};
    if (predicate) count.fetch_add(1, std::memory_order_relaxed);
    __syncthreads();
    int total = count.load(std::memory_order_relaxed);
    __syncthreads();
    if (threadIdx.x == 0) count.store(0, std::memory_order_relaxed);
    __syncthreads();
    return total;
}
"""


def _runner_source(source: str) -> str:
    concurrent = "__syncthreads" in source
    parts = ['#include <thread>', '#include "cuda_host_shim.h"', _HOST_EXTRAS, source]
    for name, params in kernel_params(source).items():
        decl = ", ".join(f"{ctype}{' *' if ptr else ''} {p}" for ctype, ptr, p in params)
        args = ", ".join(p for _, _, p in params)
        if concurrent:
            body = (f"std::barrier<> bar(threads); host_barrier = &bar; std::vector<std::thread> ts;"
                    f" for (unsigned int t = 0; t < threads; ++t) ts.emplace_back([&, t] {{ threadIdx.x = t;"
                    f" {name}({args}); }}); for (auto& th : ts) th.join();")
        else:
            body = f"for (unsigned int t = 0; t < threads; ++t) {{ threadIdx.x = t; {name}({args}); }}"
        parts.append(f'extern "C" void host_{name}(unsigned int blocks, unsigned int threads, {decl}) {{\n'
                     f"    blockDim.x = threads; gridDim.x = blocks;\n"
                     f"    for (unsigned int b = 0; b < blocks; ++b) {{ blockIdx.x = b; {body} }}\n}}\n")
    return "\n".join(parts)


class HostKernel:
    """A kernel callable as CuPy's RawKernel is, run on the CPU."""

    def __init__(self, lib, name: str, params):
        self.name, self.params = name, params
        self.fn = getattr(lib, f"host_{name}")
        self.fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [
            ctypes.c_void_p if ptr else _SCALARS[ctype][0] for ctype, ptr, _ in params]
        self.fn.restype = None
        self.launches = 0

    def __call__(self, grid, block, args) -> None:
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments for {len(self.params)} parameters"
        values = []
        for arg, (ctype, ptr, pname) in zip(args, self.params, strict=True):
            want = np.uint64 if ptr else _SCALARS[ctype][1]
            assert type(arg) is want, f"{self.name}: {pname} ({ctype}{' *' if ptr else ''}) passed as {type(arg)}"
            values.append(int(arg))
        assert grid[1:] in ((), (1,), (1, 1)) and block[1:] in ((), (1,), (1, 1)), "1-D launches only"
        self.launches += 1
        self.fn(int(grid[0]), int(block[0]), *values)


class HostModule:
    """compile_module()'s result, built with g++ (cached by source under workdir)."""

    def __init__(self, source: str, workdir: Path):
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        lib = workdir / f"kernels-{digest}.so"
        if not lib.exists():
            cpp = workdir / f"kernels-{digest}.cpp"
            cpp.write_text(_runner_source(source))
            done = subprocess.run([GXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{SUPPORT}",
                                   str(cpp), "-o", str(lib)], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-4000:]
        self._lib = ctypes.CDLL(str(lib))
        self._params = kernel_params(source)
        self.kernels: dict[str, HostKernel] = {}

    def get_function(self, name: str) -> HostKernel:
        if name not in self.kernels:
            self.kernels[name] = HostKernel(self._lib, name, self._params[name])
        return self.kernels[name]


def kernels_on_host(monkeypatch, workdir: Path) -> dict[str, HostModule]:
    """Make every kernel module compile and launch on the CPU (module docstring) for the
    rest of the test, and say the kernels are available on CPU tensors. Returns the
    modules built so far, by source hash (tests count launches through them)."""
    from hybridgnn.features import cuda_gather
    from hybridgnn.pipelines import cuda_lay_out
    from hybridgnn.sampling import cuda_hop, cuda_small

    built: dict[str, HostModule] = {}

    def compile_module(source: str) -> HostModule:
        key = hashlib.sha256(source.encode()).hexdigest()
        if key not in built:
            built[key] = HostModule(source, workdir)
        return built[key]

    @contextlib.contextmanager
    def on_host_stream(device):
        yield

    for module in (cuda_hop, cuda_small, cuda_lay_out, cuda_gather):
        monkeypatch.setattr(module, "compile_module", compile_module)
        monkeypatch.setattr(module, "on_torch_stream", on_host_stream)
        # a cache of this test's own: host kernels must not outlive it in the module's
        monkeypatch.setattr(module, "_kernel", functools.cache(module._kernel.__wrapped__))
    monkeypatch.setattr(cuda_hop, "available", lambda device: True)
    monkeypatch.setattr(cuda_lay_out, "available", lambda device: True)
    monkeypatch.setattr(cuda_gather, "usable", lambda cache, host, slot: True)
    return built
