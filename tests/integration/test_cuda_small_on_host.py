"""The one-block sampling kernel (sampling/cuda_small.py) run on the CPU: its CUDA source,
compiled with g++ against a host shim (tests/support/cuda_block_on_host.cpp: a thread per
CUDA thread, a barrier per __syncthreads), must give what sample_batch's kernels give
(tests/support/reference.kernel_batch_sample), leave the scratch maps clean, and, built
with ThreadSanitizer, show no data race (a missing barrier). Skipped without g++."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hybridgnn.sampling import cuda_small
from tests.support.reference import kernel_batch_sample

GXX = shutil.which("g++")
HARNESS = Path(__file__).resolve().parents[1] / "support" / "cuda_block_on_host.cpp"
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not installed")


def _build(tmp_path: Path, index_dtype: str, threads: int, sanitize: bool) -> Path:
    (tmp_path / "kernel.inc").write_text(cuda_small.kernel_source(index_dtype, threads))
    exe = tmp_path / f"small-{index_dtype}-{threads}{'-tsan' if sanitize else ''}"
    ctype = {"int32": "int", "int64": "long long"}[index_dtype]
    flags = ["-fsanitize=thread", "-O1", "-g"] if sanitize else ["-O2"]
    cmd = [GXX, "-std=c++20", "-pthread", *flags, f"-I{tmp_path}", f"-DHOST_INDEX_T={ctype}",
           f"-DHOST_THREADS={threads}", str(HARNESS), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if sanitize and done.returncode != 0 and "sanitize" in done.stderr:
        pytest.skip("this g++ cannot build with ThreadSanitizer")
    assert done.returncode == 0, done.stderr[-3000:]
    return exe


def _run(exe: Path, indptr, indices, seeds, fanouts, hop_seeds):
    hops, count = len(fanouts), len(seeds)
    params = list(fanouts) + [s - (1 << 64) if s >= 1 << 63 else s for s in hop_seeds] + list(seeds)
    payload = b"".join(np.asarray(a, dtype="<i8").tobytes() for a in
                       ([len(indptr) - 1, len(indices), hops, count], indptr, indices, params))
    # a missing barrier can deadlock the threads: fail in a minute, not at the suite's limit
    done = subprocess.run([str(exe)], input=payload, capture_output=True, timeout=60)
    err = done.stderr.decode(errors="replace")
    if done.returncode != 0 and "FATAL: ThreadSanitizer" in err and "data race" not in err:
        pytest.skip(f"ThreadSanitizer cannot run here: {err.strip().splitlines()[0][:200]}")  # e.g. the kernel's ASLR
    assert done.returncode == 0, err[-3000:]
    out = np.frombuffer(done.stdout, dtype="<i8")
    counts = out[:2 * hops + 2]
    bounds, per_hop = counts[:hops + 2].tolist(), counts[hops + 2:].tolist()
    total_nodes, total_edges = bounds[-1], sum(per_hop)
    nodes = out[2 * hops + 2:2 * hops + 2 + total_nodes]
    edges = out[2 * hops + 2 + total_nodes:2 * hops + 2 + total_nodes + 2 * total_edges].reshape(2, total_edges)
    clean = int(out[-1])
    assert out.shape[0] == 2 * hops + 2 + total_nodes + 2 * total_edges + 1
    return nodes, edges, [bounds[i + 1] - bounds[i] for i in range(hops + 1)], per_hop, clean


def _graph(num_nodes: int, max_degree: int, seed: int):
    rng = np.random.default_rng(seed)
    degrees = rng.integers(0, max_degree + 1, num_nodes)
    degrees[rng.random(num_nodes) < 0.2] = 0
    indptr = np.concatenate([[0], np.cumsum(degrees)]).astype(np.int64)
    indices = rng.integers(0, num_nodes, int(indptr[-1])).astype(np.int64)
    return indptr, indices


def _hop_seeds(rng, hops):
    return [int(x) for x in rng.integers(0, 1 << 63, hops, dtype=np.uint64) * 2 + rng.integers(0, 2, hops)]


@pytest.mark.parametrize("index_dtype,threads", [("int64", cuda_small.THREADS), ("int64", 32), ("int32", 8),
                                                 ("int64", 1)])
def test_one_block_kernel_samples_what_the_batch_kernels_sample(tmp_path, index_dtype, threads):
    """Random graphs (rows above and below the fanout, isolated nodes, repeated
    neighbours), batches from one seed to more than a block's width of rows."""
    exe = _build(tmp_path, index_dtype, threads, sanitize=False)
    rng = np.random.default_rng(threads)
    cases = 0
    for trial in range(12):
        num_nodes = int(rng.choice([5, 40, 300]))
        indptr, indices = _graph(num_nodes, int(rng.choice([3, 12, 40])), trial)
        fanouts = [int(f) for f in rng.integers(1, 16, int(rng.integers(1, 4)))]
        count = int(rng.integers(1, min(num_nodes, 20) + 1))
        seeds = rng.choice(num_nodes, count, replace=False).tolist()
        hop_seeds = _hop_seeds(rng, len(fanouts))
        got = _run(exe, indptr, indices, seeds, fanouts, hop_seeds)
        want = kernel_batch_sample(indptr, indices, seeds, fanouts, hop_seeds)
        assert np.array_equal(got[0], want[0]), (trial, fanouts, seeds)
        assert np.array_equal(got[1], want[1]), (trial, fanouts, seeds)
        assert got[2] == want[2] and got[3] == want[3]
        assert got[4] == 1, "scratch maps left dirty"
        cases += 1
    assert cases == 12


def test_one_block_kernel_has_no_data_race(tmp_path):
    """Built with ThreadSanitizer: every phase's reads of another thread's writes are
    ordered by a barrier (a missing __syncthreads is reported as a race)."""
    exe = _build(tmp_path, "int64", 16, sanitize=True)
    rng = np.random.default_rng(7)
    indptr, indices = _graph(60, 12, 1)
    for count, fanouts in ((1, [5, 4, 3]), (9, [7, 3])):
        seeds = rng.choice(60, count, replace=False).tolist()
        hop_seeds = _hop_seeds(rng, len(fanouts))
        got = _run(exe, indptr, indices, seeds, fanouts, hop_seeds)
        want = kernel_batch_sample(indptr, indices, seeds, fanouts, hop_seeds)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_the_harness_reads_what_it_is_given():
    """The input layout the harness parses (guards the test itself)."""
    assert struct.calcsize("<q") == 8
    assert HARNESS.exists()
