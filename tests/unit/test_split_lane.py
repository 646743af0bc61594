"""Quiver's CPU lane (pipelines/split.py) on CPU tensors: CPU workers sample, a device
stage of its own gathers and runs the model. Same answers as the CPU-model lane, a
worker that goes on sampling while its batches are on the device, staging slots that
bound what is in flight and are reused, every batch answered once (errors included),
and the flags that choose the lane."""

import threading
import time

import numpy as np
import pytest
import torch

from hybridgnn.config import PipelineConfig, ServeConfig
from hybridgnn.errors import ConfigError
from hybridgnn.features.store import CachedFeatureStore, HostFeatureStore
from hybridgnn.graph.degrees import DeviceNodeDegrees, NodeDegrees
from hybridgnn.graph.store import GraphStore
from hybridgnn.graph.uva import DeviceGraph
from hybridgnn.models.checkpoint import load_checkpoint
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.pool import Pipeline
from hybridgnn.pipelines.split import SplitExecutor
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.types import Batch, RoutePlan

EVERYTHING = (1 << 30, 1 << 30)


def _batch(seeds):
    seeds = np.asarray(seeds, dtype=np.int64)
    return Batch(requests=[], seeds=seeds, offsets=np.array([0, len(seeds)]), psgs=0.0, closed_s=time.perf_counter())


@pytest.mark.parametrize("kind,seeds", [("sage", [3, 17, 17, 400, 2999]), ("gcn", [3, 17, 17, 400, 2999]),
                                        ("sage", [2999, 3, 17, 3, 400]), ("sage", [])])
def test_the_split_lane_answers_as_the_cpu_model_lane(tiny_dataset, kind, seeds):
    """In the request's order (unsorted, repeated seeds), empty batches too."""
    graph = GraphStore.open(tiny_dataset)
    torch.manual_seed(0)
    model = GNN(ModelSpec(kind, graph.feature_dim, 8, 3)).eval()
    seeds = np.array(seeds, dtype=np.int64)
    cpu = BatchExecutor(CPUSampler(graph, (5, 3), seed=7), HostFeatureStore(graph.features), model,
                        degrees=NodeDegrees(graph)).run(seeds)
    dg = DeviceGraph(graph, "cpu")
    degrees = DeviceNodeDegrees(dg.indptr, NodeDegrees(graph).lookup(np.arange(graph.num_nodes))[1],
                                torch.device("cpu"))
    split = SplitExecutor(CPUSampler(graph, (5, 3), seed=7), CachedFeatureStore(graph.features, "cpu", 64 * 1024),
                          model, "cpu", degrees=degrees)
    try:
        got = split.run(seeds)
    finally:
        split.close()
    np.testing.assert_allclose(got.logits, cpu.logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.embeddings, cpu.embeddings, rtol=1e-5, atol=1e-6)
    assert np.array_equal(got.predictions, cpu.predictions) and got.sampled_edges == cpu.sampled_edges
    assert sum(got.gathered_rows.values()) == sum(cpu.gathered_rows.values())
    t = got.timings
    assert t.sample_s > 0 and t.gather_s > 0 and t.compute_s > 0


class _HeldModel(torch.nn.Module):
    """A model whose forward waits until the test lets it go: the device stays busy."""

    gcn_normalised = False

    def __init__(self, width: int, fail_on: int = -1):
        super().__init__()
        self.go = threading.Event()
        self.entered = threading.Semaphore(0)
        self.calls = 0
        self.fail_on = fail_on
        self.width = width

    def forward(self, x, edge_index, nodes_per_hop, edges_per_hop, degrees, with_embeddings=False):
        self.calls += 1
        self.entered.release()
        assert self.go.wait(30), "the test never released the device stage"
        if self.calls == self.fail_on:
            raise RuntimeError("device stage failed")
        return x[:, :2] * 1.0, x


def _split(graph, model, slots=2):
    return SplitExecutor(CPUSampler(graph, EVERYTHING), CachedFeatureStore(graph.features, "cpu", 0), model, "cpu",
                         slots=slots)


def test_a_worker_samples_its_next_batch_while_the_device_works_and_slots_bound_it(skewed_graph):
    model = _HeldModel(skewed_graph.feature_dim)
    ex = _split(skewed_graph, model, slots=2)
    try:
        first = ex.run_async(np.array([0, 1]))
        assert model.entered.acquire(timeout=30)  # batch 1 is on the device, held there
        second = ex.run_async(np.array([2]))  # sampled and handed off while batch 1 is still on the device
        assert ex.handed_off == 2 and not first.done() and not second.done()
        third_handed = threading.Event()
        third = []

        def hand_off_third():
            third.append(ex.run_async(np.array([3])))
            third_handed.set()

        th = threading.Thread(target=hand_off_third, daemon=True)
        th.start()
        assert not third_handed.wait(0.3)  # both slots are in flight: the third waits for one
        model.go.set()
        assert third_handed.wait(30)
        results = [f.result(30) for f in (first, second, third[0])]
        assert [r.logits.shape[0] for r in results] == [2, 1, 1]
    finally:
        model.go.set()
        ex.close()


def test_staging_slots_are_reused_and_grow_by_doubling(skewed_graph):
    ex = _split(skewed_graph, GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval(), slots=1)
    try:
        slot = ex._free[0]
        ex.run(np.array([0, 1, 2]))
        pointers = (slot.nodes.data_ptr(), slot.edges.data_ptr())
        ex.run(np.array([3, 4]))
        assert (slot.nodes.data_ptr(), slot.edges.data_ptr()) == pointers  # no allocation per batch
        edges = slot.edges.shape[0] // 2  # flat: a batch's [2, m] edges are its first 2m entries
        staged = np.arange(2 * (edges + 1), dtype=np.int64).reshape(2, edges + 1)
        slot.stage(np.arange(5), staged, np.arange(2))
        assert slot.edges.shape[0] == 4 * edges
        held = slot.edges[:staged.size]
        assert held.is_contiguous() and np.array_equal(held.view(2, edges + 1).numpy(), staged)
    finally:
        ex.close()


def test_a_pipeline_of_split_workers_answers_every_batch_once_errors_included(skewed_graph):
    model = _HeldModel(skewed_graph.feature_dim, fail_on=3)
    model.go.set()
    done, lock, finished = [], threading.Lock(), threading.Event()

    def on_done(batch, plan, result, error):
        with lock:
            done.append((int(batch.seeds[0]), result, error))
            if len(done) == 12:
                finished.set()

    pool = Pipeline(PipelineConfig(workers=2), lambda i: _split(skewed_graph, model), on_done)
    pool.start()
    plan = RoutePlan("cpu", 0.0, "only")
    for i in range(11):
        pool.submit(_batch([i % 50]), plan)
    pool.submit(_batch([10**9]), plan)  # an id past the graph: sampling fails on the worker's thread
    assert finished.wait(60)
    pool.stop()
    assert sorted(s for s, _, _ in done) == sorted([i % 50 for i in range(11)] + [10**9])
    failed = [e for _, _, e in done if e is not None]
    assert len(failed) == 2 and any("device stage failed" in str(e) for e in failed)
    assert pool.depth == 0


def test_the_cpu_lane_flag(tiny_dataset, tiny_model):
    from hybridgnn.cli.serve import cpu_lane_split

    gpu = PipelineConfig(name="gpu", device="cuda")
    emulated = PipelineConfig(name="gpu", device="cpu")
    assert cpu_lane_split("auto", gpu, "cpu", False) is True
    assert cpu_lane_split("auto", emulated, "cpu", False) is False  # no GPU: the CPU runs the model
    assert cpu_lane_split("auto", None, "cpu", False) is False
    assert cpu_lane_split("auto", gpu, "cpu", True) is False  # graph updates run on the CPU pipeline
    assert cpu_lane_split("split", emulated, "cpu", False) is True
    assert cpu_lane_split("model", gpu, "cpu", False) is False
    assert cpu_lane_split("auto", gpu, "cpu", False, processes_asked=True) is False  # --worker-processes on
    with pytest.raises(ConfigError, match="--device cuda"):
        cpu_lane_split("split", None, "cpu", False)
    with pytest.raises(ValueError, match="split CPU lane"):
        ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, cpu_pipeline=PipelineConfig(split=True))


def test_resources_build_split_workers_on_the_gpu_pipelines_store_and_model(tiny_dataset, tiny_model):
    from hybridgnn.config import SamplingConfig
    from hybridgnn.runtime.resources import Resources

    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig(EVERYTHING),
                      cpu_pipeline=PipelineConfig(split=True, workers=1),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=1))
    res = Resources.open(cfg)
    try:
        ex = res.make_executor("cpu", 0)
        assert isinstance(ex, SplitExecutor) and ex.features is res.gpu_features
        seeds = np.array([1, 2, 3])
        got = ex.run(seeds)
        ex.close()
        gpu = res.make_executor("gpu", 0).run(seeds)
        np.testing.assert_allclose(got.logits, gpu.logits, rtol=1e-5, atol=1e-6)
        model, _ = load_checkpoint(tiny_model)
        assert got.logits.shape == (3, model.out_dim)
    finally:
        res.close()


def test_every_worker_of_a_resources_shares_one_device_stage(tiny_dataset, tiny_model, monkeypatch):
    """16 workers each launching their own device work waited on the GIL (H200): the lane's
    workers hand their samples to one stage, and closing one worker leaves it serving."""
    from hybridgnn.config import SamplingConfig
    from hybridgnn.runtime.resources import Resources

    monkeypatch.setenv("HYBRIDGNN_SPLIT_DEVICE_THREADS", "1")
    cfg = ServeConfig(dataset_dir=tiny_dataset, model_dir=tiny_model, sampling=SamplingConfig((4, 3)),
                      cpu_pipeline=PipelineConfig(split=True, workers=3),
                      gpu_pipeline=PipelineConfig(name="gpu", device="cpu", workers=1))
    res = Resources.open(cfg)
    try:
        workers = [res.make_executor("cpu", i) for i in range(3)]
        assert len({id(w.stage) for w in workers}) == 1
        names = set()
        stage = workers[0].stage
        seen = stage._on_device

        def on_device(*args, **kw):
            names.add(threading.current_thread().name)
            return seen(*args, **kw)

        stage._on_device = on_device
        futures = [w.run_async(np.array([i, i + 7])) for i, w in enumerate(workers) for _ in range(2)]
        results = [f.result(30) for f in futures]
        assert all(r.logits.shape[0] == 2 for r in results)
        assert len(names) == 1 and next(iter(names)).startswith("split-device-0")
        workers[0].close()  # its batches are done; the stage serves on
        assert workers[1].run(np.array([5])).logits.shape[0] == 1
        for w in workers[1:]:
            w.close()
    finally:
        res.close()


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_the_device_stage_thread_count_is_checked(monkeypatch, raw):
    from hybridgnn.pipelines.split import split_device_threads

    monkeypatch.setenv("HYBRIDGNN_SPLIT_DEVICE_THREADS", raw)
    with pytest.raises(ValueError, match="HYBRIDGNN_SPLIT_DEVICE_THREADS"):
        split_device_threads()


def test_a_stage_of_two_threads_spreads_the_work(skewed_graph):
    from hybridgnn.pipelines.split import SplitDeviceStage

    model = _HeldModel(skewed_graph.feature_dim)
    stage = SplitDeviceStage(CachedFeatureStore(skewed_graph.features, "cpu", 0), model, "cpu", EVERYTHING,
                             threads=2)
    workers = [SplitExecutor(CPUSampler(skewed_graph, EVERYTHING), stage.features, model, "cpu", stage=stage)
               for _ in range(2)]
    try:
        futures = [w.run_async(np.array([i])) for i, w in enumerate(workers)]
        assert model.entered.acquire(timeout=30) and model.entered.acquire(timeout=30)  # both on the device at once
        model.go.set()
        assert [f.result(30).logits.shape[0] for f in futures] == [1, 1]
        with pytest.raises(AttributeError, match="shared"):
            workers[0].forward = None
    finally:
        model.go.set()
        for w in workers:
            w.close()
        stage.close()


def test_a_batch_cancelled_before_the_device_takes_it_gives_its_slot_back(skewed_graph):
    model = _HeldModel(skewed_graph.feature_dim)
    ex = _split(skewed_graph, model, slots=2)
    try:
        first = ex.run_async(np.array([0]))
        assert model.entered.acquire(timeout=30)  # the device stage is busy with the first
        second = ex.run_async(np.array([1]))  # waits in the stage's queue
        assert second.cancel() and ex.on_device == 1 and len(ex._free) == 1
        model.go.set()
        assert first.result(30).logits.shape[0] == 1
    finally:
        model.go.set()
        ex.close()  # returns: nothing is left on the device
    assert ex.on_device == 0 and len(ex._free) == 2
