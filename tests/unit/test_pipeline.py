import threading
import time

import numpy as np
import pytest
import torch

from hybridgnn.config import PipelineConfig
from hybridgnn.features.store import HostFeatureStore
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.pool import Pipeline
from hybridgnn.sampling.cpu import CPUSampler
from hybridgnn.types import Batch, RoutePlan


def make_batch(seeds):
    seeds = np.asarray(seeds, dtype=np.int64)
    return Batch(requests=[], seeds=seeds, offsets=np.array([0, len(seeds)]), psgs=0.0, closed_s=time.perf_counter())


def test_executor_matches_direct_model_call(skewed_graph):
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    feats = HostFeatureStore(skewed_graph.features)
    ex = BatchExecutor(CPUSampler(skewed_graph, (4, 3), seed=5), feats, model)
    seeds = np.array([3, 0, 3])
    res = ex.run(seeds)
    sub = CPUSampler(skewed_graph, (4, 3), seed=5).sample(seeds)
    with torch.inference_mode():
        ref = model(feats.gather(sub.node_ids), torch.from_numpy(sub.edge_index), sub.num_sampled_nodes,
                    sub.num_sampled_edges)[torch.from_numpy(sub.seed_index)]
    np.testing.assert_allclose(res.logits, ref.numpy(), rtol=1e-5)
    assert res.predictions.tolist() == ref.argmax(1).tolist()
    assert res.logits[0].tolist() == res.logits[2].tolist()
    assert res.timings.sample_s > 0 and res.timings.compute_s > 0 and res.sampled_edges > 0


def test_feature_gather_returns_exact_rows(skewed_graph):
    feats = HostFeatureStore(skewed_graph.features)
    ids = np.array([5, 0, 5, 59])
    assert np.array_equal(feats.gather(ids).numpy(), np.asarray(skewed_graph.features)[ids])


def test_pool_completes_every_batch_and_reports_errors(skewed_graph):
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    feats = HostFeatureStore(skewed_graph.features)
    done, lock = [], threading.Lock()
    finished = threading.Event()

    def on_done(batch, plan, result, error):
        with lock:
            done.append((batch, result, error))
            if len(done) == 21:
                finished.set()

    pool = Pipeline(PipelineConfig(workers=3), lambda i: BatchExecutor(CPUSampler(skewed_graph, (4, 3), seed=i),
                                                                       feats, model), on_done)
    pool.start()
    plan = RoutePlan("cpu", 0.0, "only")
    for i in range(20):
        pool.submit(make_batch([i, i + 1]), plan)
    pool.submit(make_batch([10_000]), plan)  # out of range: the sampler raises
    assert finished.wait(10)
    pool.stop()
    errors = [e for _, _, e in done if e is not None]
    assert len(errors) == 1 and "lie in" in str(errors[0])
    assert all(r is not None and r.logits.shape == (2, 3) for _, r, e in done if e is None)
    assert pool.depth == 0
    with pytest.raises(RuntimeError, match="stopped"):
        pool.submit(make_batch([1]), plan)
