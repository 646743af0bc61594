"""The one-launch small-batch sampler's host side (sampling/cuda_small.py): which batches
it takes, what it stages, and TorchSampler's first-batch check against the batch kernels.
The kernel runs on the CPU in tests/integration/test_cuda_small_on_host.py and on a GPU
in tests/gpu."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from hybridgnn.sampling import cuda_hop, cuda_small
from hybridgnn.sampling.gpu import TorchSampler
from tests.support.reference import kernel_batch_sample


def _csr(num_nodes=50, seed=0):
    rng = np.random.default_rng(seed)
    degrees = rng.integers(0, 20, num_nodes)
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(degrees)]).astype(np.int64))
    indices = torch.from_numpy(rng.integers(0, num_nodes, int(indptr[-1])).astype(np.int64))
    return indptr, indices


def test_worst_case_sizes_follow_the_fanouts_and_the_graph():
    assert cuda_hop.worst_case(1, (15, 10, 5), 10**6) == ((1, 15, 150), 750, 915)
    assert cuda_hop.worst_case(2, (3, 3), 4) == ((2, 4), 12, 18)  # a frontier never exceeds the graph


def test_it_takes_batches_up_to_its_limit_and_kernels_it_can_run():
    indptr, indices = _csr(10_000)
    small = cuda_small.SmallBatches(indptr, indices, [15, 10, 5], limit=32768)
    assert small.fits(1) and small.fits(35) and not small.fits(36) and not small.fits(0)
    assert not cuda_small.SmallBatches(indptr, indices, [cuda_hop.MAX_FANOUT + 1], limit=10**9).fits(1)
    assert not cuda_small.SmallBatches(indptr, indices, [2] * (cuda_small.MAX_HOPS + 1), limit=10**9).fits(1)
    assert not cuda_small.SmallBatches(indptr.int(), indices, [3], limit=10**9).fits(1)
    assert not cuda_small.SmallBatches(indptr, indices, [3], limit=0).fits(1)


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDGNN_CUDA_SMALL", "0")
    assert cuda_small.max_tile() == 0
    monkeypatch.setenv("HYBRIDGNN_CUDA_SMALL", "many")
    with pytest.raises(ValueError, match="HYBRIDGNN_CUDA_SMALL must be an integer"):
        cuda_small.max_tile()
    monkeypatch.delenv("HYBRIDGNN_CUDA_SMALL")
    assert cuda_small.max_tile() == cuda_small.DEFAULT_MAX_TILE


def test_staging_lays_out_what_the_kernel_reads_in_one_buffer():
    indptr, indices = _csr()
    small = cuda_small.SmallBatches(indptr, indices, [4, 3], limit=10**6)
    hop_seeds = [(1 << 64) - 5, 12345]
    staged, at = small.stage(torch.tensor([7, 2, 9]), torch.tensor([0, 1, 1, 2]), hop_seeds)
    assert at == 2 * 2 + 3
    assert staged[:2].tolist() == [4, 3]
    assert [v & 0xFFFF_FFFF_FFFF_FFFF for v in staged[2:4].tolist()] == hop_seeds  # the kernel reads them unsigned
    assert staged[4:at].tolist() == [7, 2, 9] and staged[at:].tolist() == [0, 1, 1, 2]
    # the staging buffer is reused, grown when a batch needs more
    again, at2 = small.stage(torch.arange(100), torch.arange(100), hop_seeds)
    assert at2 == 104 and again[4:at2].tolist() == list(range(100))
    with pytest.raises(ValueError, match="power of two"):
        cuda_small.kernel_source("int64", 12)


class _ReferenceSmall(cuda_small.SmallBatches):
    """The one-launch sampler with the kernel replaced by its reference (on CPU tensors),
    optionally wrong, to test what TorchSampler does with it."""

    def __init__(self, *args, wrong=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.wrong = wrong
        self.calls = 0

    def sample(self, staged, count, local, bid):
        self.calls += 1
        hops = len(self.fanouts)
        fanouts = staged[:hops].tolist()
        hop_seeds = [v & 0xFFFF_FFFF_FFFF_FFFF for v in staged[hops:2 * hops].tolist()]
        seeds = staged[2 * hops:2 * hops + count].tolist()
        nodes, edges, per_hop_nodes, per_hop_edges = kernel_batch_sample(
            self.indptr.numpy(), self.indices.numpy(), seeds, fanouts, hop_seeds)
        edges = torch.from_numpy(edges)
        if self.wrong and edges.numel():
            edges = edges.flip(1)
        return torch.from_numpy(nodes), edges, per_hop_nodes, per_hop_edges


def _reference_batch(indptr, indices, unique_seeds, fanouts, hop_seeds, local, bid):
    nodes, edges, n, e = kernel_batch_sample(indptr.numpy(), indices.numpy(), unique_seeds.tolist(), list(fanouts),
                                             hop_seeds)
    return torch.from_numpy(nodes), torch.from_numpy(edges), n, e


@pytest.mark.parametrize("wrong", [False, True])
def test_the_first_small_batch_is_checked_against_the_batch_kernels(monkeypatch, caplog, wrong):
    indptr, indices = _csr()
    monkeypatch.setattr(cuda_hop, "sample_batch", _reference_batch)
    sampler = TorchSampler(indptr, indices, (5, 3), seed=4)
    small = sampler._small = _ReferenceSmall(indptr, indices, (5, 3), limit=10**6, wrong=wrong)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.sampling.gpu"):
        first = sampler.sample(np.array([3, 3, 8]))
        second = sampler.sample(np.array([11]))
    # the answer is the batch kernels' sample either way, seed_index from the staged copy
    nodes, edges, n, e = kernel_batch_sample(indptr.numpy(), indices.numpy(), [3, 8], [5, 3],
                                             [int(cuda_hop_seed) for cuda_hop_seed in _seeds_of(4, 2, 0)])
    assert np.array_equal(first.node_ids.numpy(), nodes) and np.array_equal(first.edge_index.numpy(), edges)
    assert first.seed_index.tolist() == [0, 0, 1] and first.num_sampled_nodes == n and first.num_sampled_edges == e
    assert second.node_ids[0].item() == 11
    if wrong:
        assert sampler._small is None and small.calls == 1
        assert "sampled other than the batch kernels on its first batch" in caplog.text
    else:
        assert sampler._small is small and small.calls == 2 and not caplog.text


def _seeds_of(seed: int, hops: int, drawn: int) -> list[int]:
    """The per-hop random seeds a TorchSampler reseeded with `seed` draws next."""
    from hybridgnn.sampling.cpu import _mix_seed

    base = int(_mix_seed(seed)[0]) & 0x7FFF_FFFF_FFFF_FFFF
    return [int(_mix_seed(base + drawn + i + 1)[0]) for i in range(hops)]


def test_a_kernel_that_cannot_run_leaves_the_batch_kernels_in_charge(monkeypatch, caplog):
    indptr, indices = _csr()
    monkeypatch.setattr(cuda_hop, "sample_batch", _reference_batch)
    sampler = TorchSampler(indptr, indices, (5, 3), seed=4)

    class Broken(_ReferenceSmall):
        def sample(self, staged, count, local, bid):
            raise RuntimeError("nvrtc: error: identifier undefined")

    sampler._small = Broken(indptr, indices, (5, 3), limit=10**6)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.sampling.gpu"):
        sub = sampler.sample(np.array([9, 4, 9]))
    assert sampler._small is None and "failed (RuntimeError: nvrtc" in caplog.text
    assert sub.seed_index.tolist() == [1, 0, 1] and sorted(sub.node_ids[:2].tolist()) == [4, 9]


def test_a_kernel_that_leaves_its_maps_dirty_is_dropped_and_the_maps_reset(monkeypatch, caplog):
    """The check's answer comes from the batch kernels, run first on clean maps; a one
    launch that then leaves a stale entry (on a node the batch never reached, say) is
    dropped and the maps are reset, so no later batch reads the stale entry."""
    indptr, indices = _csr()
    monkeypatch.setattr(cuda_hop, "sample_batch", _reference_batch)
    sampler = TorchSampler(indptr, indices, (5, 3), seed=4)

    class Dirty(_ReferenceSmall):
        def sample(self, staged, count, local, bid):
            local[49] = 3
            bid[48] = 0
            return super().sample(staged, count, local, bid)

    sampler._small = Dirty(indptr, indices, (5, 3), limit=10**6)
    with caplog.at_level(logging.WARNING, logger="hybridgnn.sampling.gpu"):
        sampler.sample(np.array([1]))
    assert sampler._small is None and "left its scratch maps dirty" in caplog.text
    assert bool((sampler._local == -1).all()) and bool((sampler._bid == cuda_hop.INT64_MAX).all())


def test_a_check_whose_batch_kernels_fail_leaves_the_next_small_batch_checked(monkeypatch, caplog):
    """The kernel was marked checked before its check ran: a sample_batch that failed on
    the first small batch (out of memory on a busy GPU) left every later one unchecked."""
    indptr, indices = _csr()
    calls = {"n": 0}

    def fails_first(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA out of memory")
        return _reference_batch(*args)

    monkeypatch.setattr(cuda_hop, "sample_batch", fails_first)
    sampler = TorchSampler(indptr, indices, (5, 3), seed=4)
    sampler._small = _ReferenceSmall(indptr, indices, (5, 3), limit=10**6, wrong=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        sampler.sample(np.array([3]))
    with caplog.at_level(logging.WARNING, logger="hybridgnn.sampling.gpu"):
        sampler.sample(np.array([11]))
    assert sampler._small is None and "sampled other than the batch kernels" in caplog.text


def test_the_torch_sampler_leaves_its_node_map_clean_when_a_hop_fails_midway():
    """A hop's new nodes were numbered before they were listed for the cleanup: an error
    between the two (out of memory on the next index) left them numbered, and later
    batches' edges read them as their own."""
    indptr, indices = _csr()
    sampler = TorchSampler(indptr, indices, (5, 3), seed=4, kernel=False)
    real = sampler._local

    class FailsOnSecondRead:
        reads = 0

        def __getitem__(self, index):
            FailsOnSecondRead.reads += 1
            if FailsOnSecondRead.reads == 2:  # the hop's edges, after its new nodes were numbered
                raise RuntimeError("CUDA out of memory")
            return real[index]

        def __setitem__(self, index, value):
            real[index] = value

    sampler._local = FailsOnSecondRead()
    with pytest.raises(RuntimeError, match="out of memory"):
        sampler.sample(np.array([3, 8]))
    assert bool((real == -1).all())


def test_indices_the_kernels_cannot_read_leave_the_torch_path_in_charge(monkeypatch):
    """A dataset's indices of another integer type (int16 here) turned the kernels on, and
    the kernels refused every batch."""
    indptr, indices = _csr()
    monkeypatch.setattr(cuda_hop, "available", lambda device: True)
    sampler = TorchSampler(indptr, indices.to(torch.int16), (5, 3), seed=4)
    assert not sampler.kernel and sampler._small is None
    assert sampler.sample(np.array([3])).node_ids[0].item() == 3
    with pytest.raises(ValueError, match="int32 or int64 indices"):
        TorchSampler(indptr, indices.to(torch.int16), (5, 3), kernel=True)
