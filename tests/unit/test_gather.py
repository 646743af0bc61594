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
