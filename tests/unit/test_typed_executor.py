"""A heterogeneous batch executed: one typed sample for all its queries, the trimmed
forward, node outputs, pair scores and top-k, on both typed samplers."""

import json

import numpy as np
import pytest
import torch

import hybridgnn
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.models.hetero_checkpoint import load_hetero_model
from hybridgnn.models.link import load_decoder
from hybridgnn.pipelines.hetero import TypedExecutor
from hybridgnn.sampling.typed import TypedCPUSampler, TypedTorchSampler
from hybridgnn.types import TypedQuery
from tests.support.hetero import MLPDecoder, built, sage, whole

pytestmark = pytest.mark.filterwarnings("ignore:There exist node types")
FULL = [1000, 1000]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("te")
    graph = HeteroGraphStore.open(generate_hetero(root / "g", kind="recsys", num_nodes=200, avg_degree=5, seed=2))
    model = built(sage(graph), graph)
    x, ei = whole(graph)
    with torch.no_grad():
        want = model(x, ei)
    torch.manual_seed(1)
    served = {}
    for name, decoder in (("dot", "dot"), ("mlp", MLPDecoder(8))):
        path = hybridgnn.save_model(model, root / name, metadata=graph.metadata(), link_decoder=decoder)
        config = json.loads((path / "config.json").read_text())
        served[name] = (load_hetero_model(path, config), load_decoder(path, config["link_decoder"],
                                                                      config["out_dims"])[0], decoder)
    return graph, want, served


@pytest.mark.parametrize("sampler", ["cpu", "torch"])
@pytest.mark.parametrize("decoder", ["dot", "mlp"])
def test_one_batch_answers_every_kind_as_the_whole_graph_does(setup, sampler, decoder):
    graph, want, served = setup
    model, dec, module = served[decoder]
    make = TypedCPUSampler if sampler == "cpu" else TypedTorchSampler.from_graph
    ex = TypedExecutor(make(graph, FULL), {t: n.features for t, n in graph.nodes.items()}, model, dec)
    users, items = np.array([3, 0, 3, 41]), np.array([7, 7, 1, 0])
    cands = np.array([0, 5, 9, 11, 2])
    queries = [TypedQuery("node", "user", users), TypedQuery("pair", "user", users, "item", items),
               TypedQuery("topk", "user", users[:2], "item", cands, 3), TypedQuery("node", "item", items)]
    node_u, pair, top, node_i = ex.run(queries, "cpu")
    torch.testing.assert_close(torch.from_numpy(node_u.logits), want["user"][users], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(node_i.logits), want["item"][items], atol=1e-5, rtol=1e-5)
    assert node_u.predictions.tolist() == want["user"][users].argmax(1).tolist()
    score = (lambda a, b: (a * b).sum(-1)) if decoder == "dot" else module.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(pair.scores), score(want["user"][users], want["item"][items]),
                                   atol=1e-5, rtol=1e-5)
        every = torch.stack([score(want["user"][[u] * len(cands)], want["item"][cands]) for u in users[:2]])
    best = torch.topk(every, 3, dim=1)
    torch.testing.assert_close(torch.from_numpy(top.topk_scores), best.values, atol=1e-5, rtol=1e-5)
    assert top.topk_index.tolist() == best.indices.tolist()
    assert node_u.timings is pair.timings  # one batch: one sample, one forward


@pytest.mark.parametrize("sampler", ["cpu", "torch"])
def test_a_sample_without_nodes_of_a_type_still_runs_that_types_convolutions(tmp_path, sampler):
    """A user who rates nothing: the sample holds no item, yet rev_rates' SAGEConv still
    adds its root term (lin_r(x_user) + bias) to the user's row, as over the whole graph."""
    from hybridgnn.graph.hetero_import import write_hetero_edges

    rng = np.random.default_rng(0)
    rates = np.stack([rng.integers(0, 20, 60), rng.integers(0, 20, 60)])  # users 20..29 rate nothing
    follows = np.stack([rng.integers(0, 20, 40), rng.integers(0, 20, 40)])
    nodes = {"user": {"features": rng.standard_normal((30, 6)).astype(np.float32)},
             "item": {"features": rng.standard_normal((20, 5)).astype(np.float32)}}
    graph = HeteroGraphStore.open(write_hetero_edges(
        tmp_path / "g", nodes, {("user", "rates", "item"): rates, ("user", "follows", "user"): follows},
        undirected=True, name="g"))
    model = built(sage(graph), graph)
    x, ei = whole(graph)
    with torch.no_grad():
        want = model(x, ei)
    path = hybridgnn.save_model(model, tmp_path / "m", metadata=graph.metadata(), link_decoder="dot")
    served = load_hetero_model(path, json.loads((path / "config.json").read_text()))
    make = TypedCPUSampler if sampler == "cpu" else TypedTorchSampler.from_graph
    ex = TypedExecutor(make(graph, FULL), {t: n.features for t, n in graph.nodes.items()}, served, None)
    lonely = np.array([25, 27])
    got, = ex.run([TypedQuery("node", "user", lonely)], "cpu")
    torch.testing.assert_close(torch.from_numpy(got.logits), want["user"][lonely], atol=1e-5, rtol=1e-5)
