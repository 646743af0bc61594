"""The GPU pipeline's code on CPU tensors: device feature cache, device executor, the
hybrid engine (routing by threshold, spill, fallback to the CPU pipeline), config."""


import numpy as np
import pytest
import torch

from hybridgnn.config import (
    DeviceMemoryConfig,
    PipelineConfig,
    ServeConfig,
    parse_bytes,
)
from hybridgnn.features.store import CachedFeatureStore, HostFeatureStore, hottest_first
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.checkpoint import load_checkpoint
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.gpu import DeviceExecutor
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.sampling.gpu import TorchSampler

EVERYTHING = (1 << 30, 1 << 30)  # fanouts that take every neighbour: sampling is deterministic


def test_a_store_swapped_out_mid_gather_lives_until_its_count_is_read(skewed_graph):
    """A placement refresh swaps the cache while a gather may still be queued on a worker's
    stream: the old store was freed at once, and its device memory could go to other work
    before the gather had read it. The pending count holds it until read (after the sync)."""
    import gc
    import weakref

    from hybridgnn.features.store import SwappableFeatureStore

    feats = np.asarray(skewed_graph.features)
    served = SwappableFeatureStore(CachedFeatureStore(feats, "cpu", 7 * feats.shape[1] * 4))
    old = weakref.ref(served.current)
    rows, tiers = served.gather_pending(np.arange(10))
    served.swap(CachedFeatureStore(feats, "cpu", 7 * feats.shape[1] * 4, order=np.arange(60)[::-1].copy()))
    gc.collect()
    assert old() is not None
    assert tiers() == {"gpu": 7, "host": 3}
    del tiers
    gc.collect()
    assert old() is None


@pytest.mark.parametrize("cache_rows", [0, 7, 40, 60])
def test_cached_store_returns_exactly_the_source_rows(skewed_graph, cache_rows):
    feats = np.asarray(skewed_graph.features)
    order = np.random.default_rng(0).permutation(60)
    store = CachedFeatureStore(feats, "cpu", cache_rows * feats.shape[1] * 4, order=order)
    assert store.cached_rows == cache_rows
    ids = np.random.default_rng(1).integers(0, 60, size=200)
    rows, tiers = store.gather_counted(ids)
    assert torch.equal(rows, torch.from_numpy(feats[ids]))
    hot = set(order[:cache_rows].tolist())
    assert tiers == {"gpu": sum(i in hot for i in ids.tolist()), "host": sum(i not in hot for i in ids.tolist())}
    assert store.rows_by_tier(ids) == tiers


def test_hottest_first_orders_by_fap_with_stable_ties():
    assert hottest_first(np.array([0.1, 0.5, 0.1, 0.9])).tolist() == [3, 1, 0, 2]


@pytest.mark.parametrize("seeds", [[3, 17, 17, 400, 2999], [2999, 3, 17, 3, 400], [5], []])
def test_device_executor_matches_the_cpu_executor_when_sampling_is_deterministic(tiny_dataset, tiny_model, seeds):
    """Answers in the request's order (unsorted, repeated seeds), empty batches too."""
    graph = GraphStore.open(tiny_dataset)
    model, _ = load_checkpoint(tiny_model)
    seeds = np.array(seeds, dtype=np.int64)
    cpu = BatchExecutor(CPUSampler(graph, EVERYTHING), HostFeatureStore(graph.features), model).run(seeds)
    dg = DeviceGraph(graph, "cpu")
    dev = DeviceExecutor(TorchSampler(dg.indptr, dg.indices, EVERYTHING),
                         CachedFeatureStore(graph.features, "cpu", 64 * 1024), model).run(seeds)
    np.testing.assert_allclose(dev.logits, cpu.logits, rtol=1e-5, atol=1e-5)
    assert dev.logits.shape[0] == len(seeds) and dev.embeddings.shape[0] == len(seeds)
    assert np.array_equal(dev.predictions, cpu.predictions)
    assert dev.sampled_edges == cpu.sampled_edges
    assert sum(dev.gathered_rows.values()) == sum(cpu.gathered_rows.values())


def test_config_checks():
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("0") == 0
    for text in ("lots", "inf", "1e999G", "nan"):
        with pytest.raises(ValueError, match="byte count"):
            parse_bytes(text)
    with pytest.raises(ValueError, match="graph_placement"):
        DeviceMemoryConfig(graph_placement="disk")
    with pytest.raises(ValueError, match="pipeline device"):
        ServeConfig(dataset_dir=".", model_dir=".", gpu_pipeline=PipelineConfig(name="gpu", device="tpu"))
    with pytest.raises(ValueError, match="named 'gpu'"):
        ServeConfig(dataset_dir=".", model_dir=".", gpu_pipeline=PipelineConfig(name="cpu", device="cuda"))
    with pytest.raises(ValueError, match="cpu, cuda"):
        ServeConfig(dataset_dir=".", model_dir=".", cpu_pipeline=PipelineConfig(device="mps"))


def test_device_executor_weights_gcn_samples_by_whole_graph_degrees(tiny_dataset):
    import torch

    from hybridgnn.graph.degrees import DeviceNodeDegrees, NodeDegrees
    from hybridgnn.models.gnn import GNN, ModelSpec
    from tests.support.reference import full_graph_forward

    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(0)
    model = GNN(ModelSpec("gcn", graph.feature_dim, 8, 3)).eval()
    seeds = np.array([3, 17, 400, 2999])
    dg = DeviceGraph(graph, "cpu")
    has_loop = NodeDegrees(graph).lookup(np.arange(graph.num_nodes))[1]
    dev = DeviceExecutor(TorchSampler(dg.indptr, dg.indices, EVERYTHING),
                         CachedFeatureStore(graph.features, "cpu", 64 * 1024), model,
                         DeviceNodeDegrees(dg.indptr, has_loop, torch.device("cpu"))).run(seeds)
    np.testing.assert_allclose(dev.logits, full_graph_forward(graph, model)[seeds], rtol=1e-4, atol=1e-5)
