"""Graph updates applied across real gloo ranks agree with one process: the same batches
refused, and afterwards the same precomputed rows (kept fresh by the ranks) and the same
full-neighbourhood answers as one process's incrementally maintained embeddings and a
whole-graph forward over the updated graph."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch_geometric.nn.models import GraphSAGE

from hybridgnn.embeddings.incremental import IncrementalEmbeddings
from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute
from hybridgnn.errors import UpdateError
from hybridgnn.graph.dynamic import DynamicGraph, UpdateBatch
from hybridgnn.graph.generate import generate_csbm
from hybridgnn.graph.store import GraphStore
from hybridgnn.models.checkpoint import save_model
from hybridgnn.models.gnn import GNN, ModelSpec
from tests.support.partitioned import serve_partitioned
from tests.support.reference import full_graph_forward

N, F = 400, 6


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("part-updates") / "csbm"
    generate_csbm(path, num_nodes=N, num_classes=3, feature_dim=F, avg_degree=5, feature_signal=0.3, seed=4)
    return path


def _absent_edges(dyn: DynamicGraph, rng, count: int, hi: int) -> np.ndarray:
    while True:
        cand = np.unique(rng.integers(0, hi, size=(3 * count, 2)), axis=0)
        cand = cand[dyn.alive[cand].all(axis=1) & ~dyn.has_edges(cand[:, 0], cand[:, 1])]
        if len(cand) >= count:
            return cand[rng.permutation(len(cand))[:count]]


def _present_edges(dyn: DynamicGraph, rng, count: int) -> np.ndarray:
    indptr, indices = dyn.to_csr()
    dst = np.repeat(np.arange(dyn.num_nodes), np.diff(indptr))
    at = rng.choice(len(dst), size=count, replace=False)
    return np.stack([indices[at].astype(np.int64), dst[at]], axis=1)


def batches_and_reference(graph: GraphStore, model, layers, output):
    """Update batches (each made against the graph as one process has it then), what
    one process answers to each (a report or UpdateError), and its final state."""
    rng = np.random.default_rng(3)
    dyn = DynamicGraph(graph)
    inc = IncrementalEmbeddings(dyn, model, [np.asarray(a) for a in layers],
                                output=None if output is None else np.asarray(output))
    outcomes, batches = [], []

    def run(batch: UpdateBatch) -> None:
        batches.append(batch)
        try:
            inc.apply(batch)
            outcomes.append("applied")
        except UpdateError as exc:
            outcomes.append(str(exc))

    run(UpdateBatch(add_edges=_absent_edges(dyn, rng, 12, N)))
    run(UpdateBatch(remove_edges=_present_edges(dyn, rng, 10)))
    new = rng.standard_normal((3, F)).astype(np.float32)
    run(UpdateBatch(add_node_features=new, add_edges=np.array([[N, 5], [7, N], [N + 1, N], [N + 2, N + 2],
                                                               [N + 1, 11]])))
    run(UpdateBatch(update_ids=np.array([0, 17, N]), update_features=rng.standard_normal((3, F)).astype(np.float32)))
    run(UpdateBatch(remove_nodes=np.array([33, N + 1])))
    run(UpdateBatch(remove_edges=np.array([[33, 34]])))  # refused: node 33 is gone
    run(UpdateBatch(add_edges=np.array([[2, 3], [2, 3]])))  # refused: listed twice
    run(UpdateBatch(add_edges=_absent_edges(dyn, rng, 6, N + 3), remove_edges=_present_edges(dyn, rng, 4),
                    update_ids=np.array([N + 2, 40]), update_features=rng.standard_normal((2, F)).astype(np.float32)))
    return batches, outcomes, dyn, inc


@pytest.mark.parametrize("kind,world", [("sage", 2), ("sage-max-jk", 3), ("gcn", 3), ("gat", 2)])
def test_updates_across_ranks_agree_with_one_process(tmp_path, graph_dir, kind, world):
    torch.manual_seed(7)
    graph = GraphStore.open(graph_dir)
    if kind == "sage-max-jk":
        model = GraphSAGE(F, 10, 2, 3, aggr="max", jk="cat").eval()
    else:
        model = GNN(ModelSpec(kind, F, 10, 3, num_layers=2, heads=2)).eval()
    model_dir = tmp_path / "model"
    save_model(model, model_dir)
    store = precompute(graph, model, model_dir, PrecomputeConfig(batch_size=128), progress=False)
    batches, outcomes, dyn, inc = batches_and_reference(graph, model, store.layers, store.output)
    alive = np.flatnonzero(dyn.alive[: dyn.num_nodes])
    asked = alive[np.random.default_rng(1).permutation(len(alive))[:40]]
    requests = [{"update": b} for b in batches] + [{"lookup": alive}, {"ids": asked}]
    answers = serve_partitioned(tmp_path, graph_dir, model_dir, world, requests, method="ranges")
    got = answers[: len(batches)]
    for want, res in zip(outcomes, got, strict=True):
        if want == "applied":
            assert isinstance(res, dict), res
        else:
            assert isinstance(res, UpdateError) and str(res) == want
    assert got[-1]["num_nodes"] == dyn.num_nodes
    lookup, full = answers[len(batches):]
    np.testing.assert_allclose(lookup.logits, inc.lookup(alive), atol=1e-5, rtol=1e-4)
    indptr, indices = dyn.to_csr()
    now = SimpleNamespace(num_nodes=dyn.num_nodes, indices=indices, degrees=lambda: np.diff(indptr),
                          features=dyn.features(np.arange(dyn.num_nodes)))
    np.testing.assert_allclose(full.logits, full_graph_forward(now, model)[asked], atol=1e-5, rtol=1e-4)
