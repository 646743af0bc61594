"""New nodes of a heterogeneous graph from precomputed embeddings: mode full equals
adding the nodes and edges to the graph and running PyG's forward over it; pe and srpe
are the homogeneous planning over typed layers (srpe with γ = 1 equals full for two
layers on undirected edges, γ = 0 equals pe)."""

import numpy as np
import pytest
import torch

import hybridgnn
from hybridgnn.embeddings.hetero import hetero_precompute
from hybridgnn.embeddings.hetero_newnodes import HeteroNewNodes
from hybridgnn.graph.hetero import HeteroGraphStore, reverse_edge_type
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.models.hetero_checkpoint import open_hetero_model
from tests.support.hetero import HeteroSAGE, OwnGNN, built, sage, whole

pytestmark = pytest.mark.filterwarnings("ignore:There exist node types")


def _models(graph):
    yield sage(graph)
    yield HeteroSAGE(graph.metadata(), graph.node_types[:1], out_channels=4)
    from torch_geometric.nn import to_hetero

    yield to_hetero(OwnGNN("gat", "elu-module"), graph.metadata(), aggr="mean")


@pytest.fixture(scope="module", params=["recsys", "academic"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"nn-{request.param}")
    graph = HeteroGraphStore.open(generate_hetero(root / "g", kind=request.param, num_nodes=120, avg_degree=4,
                                                  seed=6))
    served = []
    for i, model in enumerate(_models(graph)):
        model = built(model, graph, seed=i)
        path = hybridgnn.save_model(model, root / f"m{i}", metadata=graph.metadata())
        hetero_model, _ = open_hetero_model(path, graph)
        store = hetero_precompute(hetero_model, graph, path, progress=False)
        served.append((model, HeteroNewNodes(graph, hetero_model, store)))
    return graph, served


def _request(graph, rng, q: int):
    """q new nodes of the first type, each with edges of every edge type that touches the
    type (and the reverse type), to random existing nodes; query node 1 also links to
    query node 0 where an edge type joins the type to itself."""
    t = graph.node_types[0]
    n = graph.num_nodes(t)
    features = rng.standard_normal((q, graph.nodes[t].feature_dim)).astype(np.float32)
    edges: dict = {}
    for e in graph.edge_types:
        s, _, d = e
        if s != t or reverse_edge_type(graph.edge_types, e) is None and d != t:
            continue
        for j in range(q):
            if j == q - 1:
                continue  # the last query node is isolated
            others = rng.choice(graph.num_nodes(d), size=3, replace=False)
            pairs = [[n + j, o] for o in others]
            if d == t and j == 1:
                pairs.append([n + 1, n + 0])
            edges.setdefault(e, []).extend(pairs)
    typed = {}
    for e, pairs in edges.items():
        ei = np.array(pairs, dtype=np.int64).T
        typed[e] = np.concatenate([typed[e], ei], axis=1) if e in typed else ei
        rev = reverse_edge_type(graph.edge_types, e)
        if rev is not None:
            typed[rev] = np.concatenate([typed[rev], ei[::-1]], axis=1) if rev in typed else ei[::-1].copy()
        elif e[0] == e[2]:  # a relation of the type to itself without a reverse type: both directions
            typed[e] = np.concatenate([typed[e], ei[::-1]], axis=1)
    return t, features, typed


def _with_new_nodes(graph, t, features, typed):
    """PyG's whole-graph tensors with the query nodes and edges added."""
    x, ei = whole(graph)
    x = {**x, t: torch.cat([x[t], torch.from_numpy(features)])}
    ei = {e: torch.cat([v, torch.from_numpy(typed[e])], dim=1) if e in typed else v for e, v in ei.items()}
    return x, ei


def test_full_equals_pyg_over_the_graph_with_the_new_nodes(setup):
    graph, served = setup
    rng = np.random.default_rng(0)
    t, features, typed = _request(graph, rng, q=4)
    x, ei = _with_new_nodes(graph, t, features, typed)
    n = graph.num_nodes(t)
    for model, evaluator in served:
        with torch.no_grad():
            want = model(x, ei)[t][n:]
        got = evaluator.infer(t, features, typed, mode="full")
        np.testing.assert_allclose(got.logits, want.numpy(), atol=1e-5, rtol=1e-5)
        assert got.embeddings.shape[0] == 4 and got.recomputed > 0


def test_srpe_spans_pe_to_full(setup):
    graph, served = setup
    t, features, typed = _request(graph, np.random.default_rng(1), q=3)
    for _, evaluator in served:
        full = evaluator.infer(t, features, typed, mode="full")
        pe = evaluator.infer(t, features, typed, mode="pe")
        none = evaluator.infer(t, features, typed, mode="srpe", gamma=0.0)
        every = evaluator.infer(t, features, typed, mode="srpe", gamma=1.0)
        np.testing.assert_allclose(none.logits, pe.logits, atol=1e-6)
        assert pe.recomputed == 0 and every.recomputed >= 1
        # two layers, edges both ways: recomputing every direct neighbour is exact
        np.testing.assert_allclose(every.logits, full.logits, atol=1e-5, rtol=1e-5)
        # the isolated query node reads nothing but its own features in every mode
        np.testing.assert_allclose(pe.logits[-1], full.logits[-1], atol=1e-5, rtol=1e-5)
        some = evaluator.infer(t, features, typed, mode="srpe", gamma=0.5)
        assert 0 < some.recomputed <= every.recomputed


def test_a_request_without_edges_answers_isolated_nodes(setup):
    graph, served = setup
    model, evaluator = served[0]
    t = graph.node_types[0]
    features = np.random.default_rng(2).standard_normal((2, graph.nodes[t].feature_dim)).astype(np.float32)
    got = evaluator.infer(t, features, {}, mode="srpe")
    x, ei = _with_new_nodes(graph, t, features, {})
    with torch.no_grad():
        want = model(x, ei)[t][graph.num_nodes(t):]
    np.testing.assert_allclose(got.logits, want.numpy(), atol=1e-5, rtol=1e-5)
