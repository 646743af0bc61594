"""The one-launch bucket lay-out (pipelines/cuda_lay_out.py) run on the CPU: its CUDA
source, compiled with g++ against the host shim (tests/support/cuda_grid_on_host.cpp: the
grid's threads one at a time), must write the bucket buffers exactly as GraphedForward's
torch ops do, for real samples of every depth and bucket, with edge_index rows that are
not contiguous with each other (a staging buffer's view). Skipped without g++."""

from __future__ import annotations

import shutil
import subprocess
from itertools import accumulate
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridgnn.graph.store import GraphStore
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.pipelines import cuda_lay_out
from hybridgnn.pipelines.graphed import GraphedForward, bucket_seeds
from hybridgnn.sampling.cpu import CPUSampler

GXX = shutil.which("g++")
HARNESS = Path(__file__).resolve().parents[1] / "support" / "cuda_grid_on_host.cpp"
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not installed")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("lay_out")
    (where / "kernel.inc").write_text(cuda_lay_out.kernel_source(4))
    exe = where / "lay_out"
    done = subprocess.run([GXX, "-std=c++20", "-O2", f"-I{where}", str(HARNESS), "-o", str(exe)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return exe


def _run(exe, x: torch.Tensor, edge_index: torch.Tensor, plan: list[int], hops: int, edge_slots: int, slots: int):
    bits = x.contiguous().view(torch.int32).numpy().astype(np.int64).ravel()
    head = [x.shape[1], x.shape[0], edge_index.shape[1], hops, edge_slots, slots]
    payload = b"".join(np.asarray(a, dtype="<i8").tobytes() for a in
                       (head, bits, edge_index[0].numpy(), edge_index[1].numpy(), plan))
    done = subprocess.run([str(exe)], input=payload, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    out = np.frombuffer(done.stdout, dtype="<i8")
    cells = slots * x.shape[1]
    assert out.shape[0] == cells + 2 * edge_slots
    return out[:cells].reshape(slots, x.shape[1]), out[cells:].reshape(2, edge_slots)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_one_launch_lays_a_sample_out_as_the_torch_ops_do(tiny_dataset, harness, layers):
    graph = GraphStore.open(tiny_dataset)
    fanouts = (5, 3, 2)[:layers]
    model = GNN(ModelSpec("sage", graph.feature_dim, 8, 4, num_layers=layers)).eval()
    forward = GraphedForward(model, fanouts, "cpu", max_seeds=8, capture=lambda fn: fn)
    rng = np.random.default_rng(layers)
    for size in (1, 2, 3, 5, 8):
        seeds = rng.choice(graph.num_nodes, size, replace=False)
        sub = CPUSampler(graph, fanouts, seed=size).sample(seeds)
        x = torch.from_numpy(rng.standard_normal((sub.num_nodes, graph.feature_dim)).astype(np.float32))
        # edge rows apart in memory, as a staging slot's view [2, cap][:, :m] has them
        staging = torch.full((2, sub.num_edges + 7), -1, dtype=torch.int64)
        staging[:, :sub.num_edges] = torch.from_numpy(sub.edge_index)
        edge_index = staging[:, :sub.num_edges]
        nodes, edges = [int(n) for n in sub.num_sampled_nodes], [int(e) for e in sub.num_sampled_edges]
        bucket = forward._bucket(bucket_seeds(nodes[0], 8), x)
        bucket.x.zero_()
        forward._lay_out(bucket, x, edge_index, nodes, edges)
        plan = cuda_lay_out.plan(nodes, edges, bucket.node_starts, bucket.edge_starts)
        assert plan[:layers + 2] == list(accumulate(nodes, initial=0))
        got_x, got_edges = _run(harness, x, edge_index, plan, layers, bucket.edge_index.shape[1],
                                bucket.x.shape[0])
        want_x = bucket.x.view(torch.int32).numpy().astype(np.int64) & 0xFFFF_FFFF
        assert np.array_equal(got_x, want_x), size
        assert np.array_equal(got_edges, bucket.edge_index.numpy()), size
