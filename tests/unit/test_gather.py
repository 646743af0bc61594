"""The plan-driven tiered feature store: every gather returns exactly the source rows,
whatever tier, server and GPU they come from; serving reads through it."""


import numpy as np
import pytest
import torch

from hybridgnn.features.gather import TieredFeatureStore
from hybridgnn.features.placement import (
    degree_plan,
    fap_plan,
    hash_plan,
    importance_plan,
)
from hybridgnn.features.topology import Topology

ROW = 32  # 8 float32


def plans(fap, topo):
    n = fap.size
    return [fap_plan(fap, topo, ROW), hash_plan(n, topo, ROW), degree_plan(fap, topo, ROW),
            importance_plan(fap, topo, ROW)]


TOPOLOGIES = [
    Topology(gpus_per_server=1, nvlink_cliques=1, gpu_memory_bytes=30 * ROW, host_memory_bytes=100 * ROW,
             disk_bytes=1000 * ROW),
    Topology(gpus_per_server=4, nvlink_cliques=2, gpu_memory_bytes=20 * ROW, host_memory_bytes=100 * ROW),
    Topology(servers=2, gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=20 * ROW, host_memory_bytes=80 * ROW,
             disk_bytes=400 * ROW, network="infiniband"),
    Topology(servers=3, gpus_per_server=2, nvlink_cliques=2, gpu_memory_bytes=20 * ROW, host_memory_bytes=80 * ROW,
             network="ethernet"),
]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: t.describe())
def test_gathers_return_exactly_the_source_rows_on_every_tier(topo, tmp_path):
    rng = np.random.default_rng(0)
    n = 500
    feats = rng.standard_normal((n, 8)).astype(np.float32)
    fap = rng.pareto(1.2, n)
    seen = set()
    for plan in plans(fap, topo):
        for server in range(topo.servers):
            for gpu in range(max(1, topo.gpus_per_server)):
                store = TieredFeatureStore(feats, plan, server=server, gpu=gpu, plan_dir=tmp_path)
                ids = rng.integers(0, n, 400)
                rows, tiers = store.gather_counted(ids)
                assert torch.equal(rows, torch.from_numpy(feats[ids])), (plan.method, server, gpu)
                assert sum(tiers.values()) == 400
                seen |= set(tiers)
    assert {"gpu", "host"} <= seen


def test_cpu_pipeline_view_reads_gpu_rows_from_host_and_disk_tier_is_memory_mapped(tmp_path):
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((300, 8)).astype(np.float32)
    topo = Topology(gpus_per_server=2, nvlink_cliques=1, gpu_memory_bytes=20 * ROW, host_memory_bytes=50 * ROW)
    plan = fap_plan(rng.random(300), topo, ROW)
    store = TieredFeatureStore(feats, plan, gpu_tiers=False, plan_dir=tmp_path)
    rows, tiers = store.gather_counted(np.arange(300))
    assert torch.equal(rows, torch.from_numpy(feats)) and set(tiers) == {"host", "disk"}
    assert len(list(tmp_path.glob("disk-server0-*.npy"))) == 1
    assert set(store.bytes_by_store) == {"disk"}  # GPU- and host-tier rows read in place, not copied
    again = TieredFeatureStore(feats, plan, gpu_tiers=False, plan_dir=tmp_path)  # reuses the file
    assert torch.equal(again.gather(np.arange(300)), rows)
    with pytest.raises(ValueError, match="covers"):
        TieredFeatureStore(feats[:10], plan)


def _disk_plan(n: int):
    topo = Topology(gpus_per_server=1, nvlink_cliques=1, gpu_memory_bytes=10 * ROW, host_memory_bytes=20 * ROW)
    return fap_plan(np.random.default_rng(2).random(n), topo, ROW)


@pytest.mark.parametrize("change", ["all rows", "one row"])
def test_a_dataset_rewritten_under_a_kept_plan_is_served_its_new_disk_rows(tmp_path, change):
    # the disk tier's copy was named by its row ids alone: a dataset rewritten with as many
    # nodes (a plan kept outside it, --out) was served its old rows from the copy
    rng = np.random.default_rng(3)
    n = 3000  # about 2970 disk rows: more than the copy's check samples
    path = tmp_path / "features.npy"
    np.save(path, rng.standard_normal((n, 8)).astype(np.float32))
    plan, plan_dir = _disk_plan(n), tmp_path / "plan"
    plan_dir.mkdir()
    TieredFeatureStore(np.load(path, mmap_mode="r"), plan, plan_dir=plan_dir).gather(np.arange(n))
    new = np.load(path) + 1 if change == "all rows" else np.load(path)
    if change == "one row":  # the copy's second row, which its spread sample skips: the file's identity tells
        new[np.flatnonzero(plan.tier == 2)[1]] += 1
    np.save(tmp_path / "new.npy", new)
    (tmp_path / "new.npy").replace(path)
    store = TieredFeatureStore(np.load(path, mmap_mode="r"), plan, plan_dir=plan_dir)
    assert torch.equal(store.gather(np.arange(n)), torch.from_numpy(new))
    assert len(list(plan_dir.glob("disk-server0-*.npy"))) == 1  # replaced, not one more copy


@pytest.mark.parametrize("damage", ["truncated", "not an array", "another shape", "other rows"])
def test_a_damaged_disk_copy_is_written_again(tmp_path, damage):
    feats = np.random.default_rng(4).standard_normal((300, 8)).astype(np.float32)
    plan = _disk_plan(300)
    TieredFeatureStore(feats, plan, plan_dir=tmp_path)
    (copy,) = tmp_path.glob("disk-server0-*.npy")
    if damage == "truncated":
        with open(copy, "r+b") as f:
            f.truncate(copy.stat().st_size - 100)
    elif damage == "not an array":
        copy.write_bytes(b"junk")
    elif damage == "another shape":
        np.save(copy, np.zeros((3, 8), np.float32))
    else:
        np.save(copy, np.zeros(np.load(copy).shape, np.float32))
    store = TieredFeatureStore(feats, plan, plan_dir=tmp_path)
    assert torch.equal(store.gather(np.arange(300)), torch.from_numpy(feats))


def test_a_sound_disk_copy_in_a_directory_that_cannot_be_written_is_still_served(tmp_path, monkeypatch):
    # a copy that an earlier version made (no .source beside it) in a read-only plan directory
    import hybridgnn.capabilities as capabilities

    path = tmp_path / "features.npy"
    np.save(path, np.random.default_rng(5).standard_normal((300, 8)).astype(np.float32))
    plan = _disk_plan(300)
    TieredFeatureStore(np.load(path, mmap_mode="r"), plan, plan_dir=tmp_path)
    for stamp in tmp_path.glob("disk-server0-*.source"):
        stamp.unlink()

    def refuse(path, write):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(capabilities, "write_replacing", refuse)
    store = TieredFeatureStore(np.load(path, mmap_mode="r"), plan, plan_dir=tmp_path)
    assert torch.equal(store.gather(np.arange(300)), torch.from_numpy(np.load(path)))


def test_a_plan_directory_with_disk_copies_and_their_temporaries_is_still_only_a_plan(tmp_path):
    from hybridgnn.features.placement import holds_only_a_plan

    plan = _disk_plan(300)
    plan.save(tmp_path)
    TieredFeatureStore(np.zeros((300, 8), np.float32), plan, plan_dir=tmp_path)
    (tmp_path / ".disk-server0-0123456789ab.4242.tmp.npy").write_bytes(b"")  # a server killed while writing
    assert holds_only_a_plan(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert not holds_only_a_plan(tmp_path)


def test_a_plan_for_more_gpus_than_this_machine_has_is_one_line(monkeypatch):
    # a plan made for 4 GPUs, served on a machine with 1: copying rows to cuda:1 was a CUDA
    # traceback at start (checked before any CUDA call, so it runs without a GPU)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    topo = Topology(gpus_per_server=4, nvlink_cliques=1, gpu_memory_bytes=10 * ROW, host_memory_bytes=20 * ROW)
    plan = fap_plan(np.random.default_rng(6).random(100), topo, ROW)
    with pytest.raises(ValueError, match="on GPU 1 of 4 per server; this machine has 1"):
        TieredFeatureStore(np.zeros((100, 8), np.float32), plan, device="cuda", gpu=0)


@pytest.mark.parametrize("gpu", range(4))
def test_a_gpu_reads_rows_replicated_across_cliques_from_its_own_clique(gpu):
    """4 GPUs in 2 NVLink cliques: the FAP plan partitions the GPU rows across a clique's 2
    GPUs and replicates them in both cliques, so every row a GPU lacks is on its clique
    peer. GPU 2 read the rows its peer (GPU 3) holds from GPU 1, in the other clique (no
    NVLink between them), because the stores were taken in GPU order; GPU 3 then held
    none of them."""
    topo = TOPOLOGIES[1]
    n = 500
    feats = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
    plan = fap_plan(np.random.default_rng(1).pareto(1.2, n), topo, ROW)
    store = TieredFeatureStore(feats, plan, gpu=gpu)
    peer = gpu ^ 1  # the other GPU of its clique
    assert store.names[:2] == ["gpu", f"peer{peer}"], store.names
    assert not any(name.startswith("peer") and name != f"peer{peer}" for name in store.names), store.names
    rows, tiers = store.gather_counted(np.arange(n))
    assert torch.equal(rows, torch.from_numpy(feats))
    assert tiers["gpu"] + tiers["peer_gpu"] == int((plan.tier == 0).sum())
