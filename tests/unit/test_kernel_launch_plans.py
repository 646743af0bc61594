"""The host-side plans of the CUDA kernels (chunk width, threads per row, argument
checks): pure Python, so they run without a GPU; the kernels themselves are in tests/gpu."""

import numpy as np
import pytest
import torch

from hybridgnn.features import cuda_gather
from hybridgnn.sampling import cuda_hop


@pytest.mark.parametrize("row_bytes,addresses,width", [
    (400, (0, 256, 4096), 16), (400, (0, 8), 8), (12, (0, 0), 4), (14, (0,), 2), (7, (0,), 1), (64, (4,), 4)])
def test_gather_reads_the_widest_chunk_every_row_and_address_allows(row_bytes, addresses, width):
    assert cuda_gather.chunk_bytes(row_bytes, *addresses) == width


@pytest.mark.parametrize("chunks,threads", [(1, 1), (2, 2), (3, 4), (25, 32), (32, 32), (100, 32)])
def test_gather_gives_each_row_a_power_of_two_group_of_at_most_a_warp(chunks, threads):
    assert 1 << cuda_gather.group_shift(chunks) == threads


def test_kernels_are_not_used_on_cpu_tensors():
    t = torch.zeros((4, 3))
    assert not cuda_gather.usable(t, t, torch.zeros(4, dtype=torch.int32))
    assert not cuda_hop.available(torch.device("cpu"))


def test_device_batch_sampler_refuses_what_it_cannot_run_before_launching():
    indptr, indices = torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    seeds, scratch = torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="fanouts 1..64"):
        cuda_hop.sample_batch(indptr, indices, seeds, [cuda_hop.MAX_FANOUT + 1], [0], scratch, scratch)
    with pytest.raises(ValueError, match="int64 indptr"):
        cuda_hop.sample_batch(indptr.int(), indices, seeds, [3], [0], scratch, scratch)


def test_compacting_known_many_edges_equals_the_boolean_index():
    """sample_batch compacts its padded tiles with compact_edges (no wait for the count,
    which it already read): the same edges in the same order as src[keep], dst[keep]."""
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 1000):
        src = torch.as_tensor(rng.integers(-1, 50, n))
        dst = torch.as_tensor(rng.integers(0, 50, n))
        keep = src >= 0
        got = cuda_hop.compact_edges(src, dst, keep, int(keep.sum()))
        assert torch.equal(got, torch.stack([src[keep], dst[keep]]))
        assert got.shape == (2, int(keep.sum())) and got.is_contiguous()  # as torch.stack's (tests/gpu hold it)
