"""A heterogeneous server's GPU pipeline reads one typed CSR per device, shared by all its
workers and released at stop (the graph is stored once, never copied per worker)."""

import asyncio

import numpy as np
import pytest
import torch

import hybridgnn
import hybridgnn.graph.host
import hybridgnn.graph.uva
from hybridgnn.config import PipelineConfig, ServeConfig
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.serving.core.hetero import HeteroEngine
from tests.support.hetero import built, sage

pytestmark = pytest.mark.filterwarnings("ignore:There exist node types")
WORKERS = 3


def _served(root, num_nodes: int, avg_degree: int):
    """A recsys graph and a SAGE model saved for it: (dataset, model) directories."""
    graph = HeteroGraphStore.open(generate_hetero(root / "g", kind="recsys", num_nodes=num_nodes,
                                                  avg_degree=avg_degree, seed=3))
    return root / "g", hybridgnn.save_model(built(sage(graph), graph), root / "m", metadata=graph.metadata())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return _served(tmp_path_factory.mktemp("hdg"), 120, 4)


def _engine(served, device: str, placement: str = "uva") -> HeteroEngine:
    from hybridgnn.config import DeviceMemoryConfig

    dataset, model = served
    cfg = ServeConfig(dataset_dir=dataset, model_dir=model,
                      gpu_pipeline=PipelineConfig(name="gpu", device=device, workers=WORKERS),
                      gpu_memory=DeviceMemoryConfig(graph_placement=placement))
    return HeteroEngine(cfg)


def _storages(executor) -> dict:
    return {e: (ip.untyped_storage().data_ptr(), ix.untyped_storage().data_ptr())
            for e, (ip, ix) in executor.sampler.csr.items()}


def test_gpu_workers_share_one_typed_csr_built_once(served, monkeypatch):
    # every host array turned into a tensor becomes a copy of its own here, as a copy to
    # device memory would: workers that each built theirs would hold different storage
    def copying(array):
        return torch.from_numpy(np.array(array))

    monkeypatch.setattr(hybridgnn.graph.host, "host_tensor", copying)
    monkeypatch.setattr(hybridgnn.graph.uva, "host_tensor", copying)
    engine = _engine(served, "cpu")
    executors = [engine._make_executor("gpu", i) for i in range(WORKERS)]
    first = _storages(executors[0])
    assert first and all(_storages(ex) == first for ex in executors[1:])
    graph = engine.graph
    for e, (ip, ix) in executors[0].sampler.csr.items():  # the tensors are the graph's CSR
        assert np.array_equal(ip.numpy(), graph.edges[e].indptr)
        assert np.array_equal(ix.numpy(), graph.edges[e].indices)
    # each worker still owns its scratch (id maps) and samples correctly
    assert executors[0].sampler._local is not executors[1].sampler._local
    seeds = {t: np.arange(3) for t in graph.node_types}
    sub = executors[1].sampler.sample(seeds)
    assert all(len(sub.node_ids[t]) >= 3 for t in graph.node_types)
    asyncio.run(engine.stop())


def test_the_shared_typed_csr_is_released_at_stop(served, monkeypatch):
    closed = []
    original = hybridgnn.graph.uva.DeviceGraph.close
    monkeypatch.setattr(hybridgnn.graph.uva.DeviceGraph, "close", lambda self: (closed.append(self), original(self)))
    engine = _engine(served, "cpu")
    engine._make_executor("gpu", 0)
    assert not closed
    asyncio.run(engine.stop())
    assert len(closed) == len(engine.graph.edge_types)
    asyncio.run(engine.stop())  # once
    assert len(closed) == len(engine.graph.edge_types)


@pytest.fixture(scope="module")
def served_large(tmp_path_factory):
    """A graph whose CSR outweighs a worker's id maps many times over."""
    return _served(tmp_path_factory.mktemp("hdg_large"), 20000, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["uva", "gpu"])
def test_cuda_workers_share_one_typed_csr(served_large, placement):
    engine = _engine(served_large, "cuda", placement)
    try:
        graph = engine.graph
        csr_bytes = sum(d.indptr.nbytes + d.indices.nbytes for d in graph.edges.values())
        maps_bytes = sum(8 * graph.num_nodes(t) for t in graph.node_types)
        assert csr_bytes > 8 * maps_bytes
        one = engine._make_executor("gpu", 0)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        others = [engine._make_executor("gpu", i) for i in range(1, WORKERS)]
        torch.cuda.synchronize()
        # a further worker adds its id maps, never another copy of the CSR
        assert torch.cuda.memory_allocated() - held < (WORKERS - 1) * (maps_bytes + (1 << 16))
        for ex in others:
            assert _storages(ex) == _storages(one)
            assert all(ip.is_cuda and ix.is_cuda for ip, ix in ex.sampler.csr.values())
        sub = others[-1].sampler.sample({t: np.arange(3) for t in graph.node_types})
        assert all(len(sub.node_ids[t]) >= 3 for t in graph.node_types)
    finally:
        asyncio.run(engine.stop())
    assert engine._device_graph is None


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["uva", "gpu"])
def test_an_edge_type_without_edges_is_read_on_cuda(tmp_path, placement):
    from hybridgnn.graph.hetero import write_hetero_dataset
    from hybridgnn.graph.uva import TypedDeviceGraph
    from hybridgnn.sampling.typed import TypedTorchSampler

    nodes = {"a": {"features": np.zeros((3, 2), np.float32)}, "b": {"features": np.zeros((2, 2), np.float32)}}
    edges = {("a", "r", "b"): (np.zeros(3, np.int64), np.zeros(0, np.int64)),
             ("b", "s", "a"): (np.array([0, 1, 1, 2]), np.array([0, 1]))}
    graph = HeteroGraphStore.open(write_hetero_dataset(tmp_path / "g", nodes=nodes, edges=edges))
    device_graph = TypedDeviceGraph(graph, "cuda", placement)
    try:
        sampler = TypedTorchSampler(device_graph.csr, {t: graph.num_nodes(t) for t in graph.node_types}, [2, 2])
        sub = sampler.sample({"a": np.arange(3), "b": np.arange(2)})
        assert sub.edge_index[("a", "r", "b")].shape == (2, 0)
        assert sub.edge_index[("b", "s", "a")].shape[1] == 2
    finally:
        device_graph.close()


def test_a_cuda_pipeline_without_cuda_is_refused_in_one_line(served, monkeypatch):
    """It failed while moving the model, in torch's words."""
    import hybridgnn.serving.core.hetero as hetero
    from hybridgnn.errors import ConfigError

    monkeypatch.setattr(hetero, "HAS_CUDA", False)
    with pytest.raises(ConfigError, match="the gpu pipeline is set to cuda but no CUDA device is visible"):
        _engine(served, "cuda")
