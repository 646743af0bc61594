"""The CUDA kernel sources compile (nvcc to PTX for Hopper), checked where nvcc is
installed, so a typo in a kernel shows without a GPU. Skipped without nvcc."""

import shutil
import subprocess

import pytest

from hybridgnn.features import cuda_gather
from hybridgnn.pipelines import cuda_lay_out
from hybridgnn.sampling import cuda_hop, cuda_small

NVCC = shutil.which("nvcc")
SOURCES = ([(f"cuda_hop-{t}", cuda_hop.kernel_source(t)) for t in ("int32", "int64")]
           + [(f"cuda_small-{t}", cuda_small.kernel_source(t)) for t in ("int32", "int64")]
           + [(f"cuda_lay_out-{w}", cuda_lay_out.kernel_source(w)) for w in (8, 4, 2, 1)]
           + [(f"cuda_gather-{w}", cuda_gather.kernel_source(w)) for w in (16, 8, 4, 2, 1)])


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("name,source", SOURCES, ids=[n for n, _ in SOURCES])
def test_kernel_source_compiles(tmp_path, name, source):
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    done = subprocess.run([NVCC, "--ptx", "-arch=sm_90", "-std=c++17", "-o", str(tmp_path / f"{name}.ptx"), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
