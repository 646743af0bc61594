"""Precomputed embeddings of a heterogeneous graph: the store `hybridgnn precompute`
writes (every layer of every type, the heads' outputs), and requests answered from it
(node outputs, pair scores, top-k over candidates or a whole type) equal the whole-graph
forward."""

import json

import numpy as np
import pytest
import torch

import hybridgnn
from hybridgnn.embeddings.hetero import HeteroEmbeddingStore, hetero_precompute
from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.models.checkpoint import CheckpointError
from hybridgnn.models.hetero_checkpoint import open_hetero_model
from hybridgnn.models.link import load_decoder
from hybridgnn.pipelines.hetero import PrecomputedExecutor
from hybridgnn.types import TypedQuery
from tests.support.hetero import HeteroSAGE, MLPDecoder, built, sage, whole

pytestmark = pytest.mark.filterwarnings("ignore:There exist node types")


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    root = tmp_path_factory.mktemp("hp")
    return HeteroGraphStore.open(generate_hetero(root / "g", kind="academic", num_nodes=150, avg_degree=4, seed=5))


def _layers(model, x, ei):
    """Each layer's rows of the PyG model (HeteroConv: its convs one by one), after the
    activation between layers (what the next layer reads)."""
    rows = []
    with torch.no_grad():
        for i, conv in enumerate(model.convs):
            x = conv(x, ei)
            if i < len(model.convs) - 1:
                x = {t: v.relu() for t, v in x.items()}
            rows.append(x)
    return rows


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_store_holds_every_layer_and_output_of_every_type(graph, tmp_path, dtype):
    model = built(HeteroSAGE(graph.metadata(), ["paper", "author"], out_channels=4), graph)
    x, ei = whole(graph)
    with torch.no_grad():
        want = model(x, ei)
    path = hybridgnn.save_model(model, tmp_path / "m", metadata=graph.metadata())
    served, _ = open_hetero_model(path, graph)
    store = hetero_precompute(served, graph, path, batch_size=13, dtype=dtype, progress=False)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert store.state["complete"] and store.num_layers == 2
    for i, layer in enumerate(_layers(model, x, ei), start=1):
        for t, rows in layer.items():
            np.testing.assert_allclose(np.asarray(store.layers[t][i], np.float32), rows.numpy(), atol=tol, rtol=tol)
    assert set(store.output) == set(want)
    for t, rows in want.items():
        np.testing.assert_allclose(np.asarray(store.output[t], np.float32), rows.numpy(), atol=tol, rtol=tol)
    again = HeteroEmbeddingStore.open(path, graph.fingerprint)
    assert again is not None and again.state == store.state
    assert HeteroEmbeddingStore.open(path, "another-dataset") is None


def test_a_store_without_its_state_or_for_other_weights_is_not_served(graph, tmp_path):
    path = hybridgnn.save_model(built(sage(graph), graph), tmp_path / "m", metadata=graph.metadata())
    store = hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)
    hybridgnn.save_model(built(sage(graph), graph, seed=9), path, metadata=graph.metadata())  # retrained, saved over
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is None  # stale rows are never served
    store = hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is not None
    (store.root / "state.json").unlink()  # as after a run killed before its end
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is None
    (store.root / "state.json").write_text("{not json")
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is None


@pytest.mark.parametrize("damage", [
    lambda root: (root / "types" / "0" / "layer_1.npy").write_bytes(b""),  # EOFError traceback
    lambda root: (root / "types" / "0" / "layer_1.npy").unlink(),  # FileNotFoundError traceback
    lambda root: np.save(root / "types" / "0" / "layer_2.npy",  # IndexError past its rows
                         np.load(root / "types" / "0" / "layer_2.npy")[:3]),
    lambda root: np.save(root / "types" / "0" / "layer_2.npy", np.full((3, 2), "x")),
    lambda root: (root / "state.json").write_text(json.dumps(
        {**json.loads((root / "state.json").read_text()), "layers": None})),  # TypeError traceback
])
def test_a_damaged_store_is_not_served(graph, tmp_path, damage, caplog):
    path = hybridgnn.save_model(built(sage(graph), graph), tmp_path / "m", metadata=graph.metadata())
    store = hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)
    damage(store.root)
    rows = {t: graph.num_nodes(t) for t in graph.node_types}
    assert HeteroEmbeddingStore.open(path, graph.fingerprint, rows) is None
    assert "are damaged" in caplog.text


def test_a_model_that_does_not_fit_the_graph_is_refused_in_one_line(graph, tmp_path):
    other = HeteroGraphStore.open(generate_hetero(tmp_path / "r", kind="recsys", num_nodes=60, avg_degree=3, seed=1))
    path = hybridgnn.save_model(built(sage(other), other), tmp_path / "m", metadata=other.metadata())
    with pytest.raises(CheckpointError, match="lacks") as info:
        open_hetero_model(path, graph)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("decoder", ["dot", "mlp"])
def test_precomputed_answers_equal_the_whole_graph(tmp_path, decoder):
    graph = HeteroGraphStore.open(generate_hetero(tmp_path / "g", kind="recsys", num_nodes=200, avg_degree=5, seed=2))
    model = built(sage(graph), graph)
    x, ei = whole(graph)
    with torch.no_grad():
        want = model(x, ei)
    module = "dot" if decoder == "dot" else MLPDecoder(8)
    path = hybridgnn.save_model(model, tmp_path / "m", metadata=graph.metadata(), link_decoder=module)
    served, config = open_hetero_model(path, graph)
    dec = load_decoder(path, config["link_decoder"], config["out_dims"])[0]
    ex = PrecomputedExecutor(hetero_precompute(served, graph, path, progress=False), dec)
    users, items = np.array([3, 0, 3, 41]), np.array([7, 7, 1, 0])
    node = ex.run(TypedQuery("node", "user", users))
    torch.testing.assert_close(torch.from_numpy(node.logits), want["user"][users], atol=1e-5, rtol=1e-5)
    assert node.pipeline == "precomputed" and node.predictions.tolist() == want["user"][users].argmax(1).tolist()
    score = (lambda a, b: (a * b).sum(-1)) if decoder == "dot" else module.eval()
    pair = ex.run(TypedQuery("pair", "user", users, "item", items))
    n_items = graph.num_nodes("item")
    every_item = np.arange(n_items)
    whole_topk = ex.run(TypedQuery("topk", "user", users[:2], "item", every_item, 5, whole_type=True))
    cands = np.array([0, 5, 9, 11, 2])
    cand_topk = ex.run(TypedQuery("topk", "user", users[:2], "item", cands, 3))
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(pair.scores), score(want["user"][users], want["item"][items]),
                                   atol=1e-5, rtol=1e-5)
        for top, ids, k in ((whole_topk, every_item, 5), (cand_topk, cands, 3)):
            every = torch.stack([score(want["user"][[u] * len(ids)], want["item"][ids]) for u in users[:2]])
            best = torch.topk(every, k, dim=1)
            torch.testing.assert_close(torch.from_numpy(top.topk_scores), best.values, atol=1e-5, rtol=1e-5)
            assert top.topk_index.tolist() == best.indices.tolist()


def test_the_precompute_command_writes_the_store_for_a_heterogeneous_dataset(graph, tmp_path, capsys):
    from hybridgnn.cli.main import main

    path = hybridgnn.save_model(built(sage(graph), graph), tmp_path / "m", metadata=graph.metadata())
    assert main(["precompute", "--dataset", str(graph.root), "--model", str(path), "--batch-size", "50"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["node_types"]) == set(graph.node_types)
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is not None
    assert main(["precompute", "--dataset", str(graph.root), "--model", str(path), "--nprocs", "2"]) != 0
    assert "in one process" in capsys.readouterr().err


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_top_k_in_chunks_equals_one_top_k(chunk):
    from hybridgnn.models.link import dot
    from hybridgnn.pipelines.hetero import top_k

    g = torch.Generator().manual_seed(0)
    z_src, z_dst = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g).half()
    want = torch.topk(z_src @ z_dst.float().T, 5, dim=1)
    vals, idx = top_k(dot, z_src, z_dst, 5, chunk_rows=chunk)
    assert idx.tolist() == want.indices.tolist()
    torch.testing.assert_close(vals, want.values)


def test_batches_of_target_rows_are_cut_by_their_in_edges(graph, tmp_path):
    from hybridgnn.embeddings.hetero import hetero_layerwise, row_batches

    assert list(row_batches(np.array([1, 1, 5, 1, 1, 1]), 4, 3)) == [(0, 2), (2, 3), (3, 6)]
    assert list(row_batches(np.zeros(5, np.int64), 2, 1)) == [(0, 2), (2, 4), (4, 5)]
    path = hybridgnn.save_model(built(sage(graph), graph), tmp_path / "m", metadata=graph.metadata())
    model = open_hetero_model(path, graph)[0]
    small, whole_rows = hetero_layerwise(model, graph, max_edges=7), hetero_layerwise(model, graph)
    for t in whole_rows:
        np.testing.assert_allclose(small[t], whole_rows[t], atol=1e-5, rtol=1e-5)


def test_a_model_saved_during_a_heterogeneous_precompute_is_not_stamped_on_its_rows(graph, tmp_path, monkeypatch):
    """The store's weights fingerprint was read from the directory at the end: a model saved
    there while the rows were computed had the old model's rows marked as its own."""
    import hybridgnn.embeddings.hetero as hetero

    path = hybridgnn.save_model(built(sage(graph), graph), tmp_path / "m", metadata=graph.metadata())
    model = open_hetero_model(path, graph)[0]
    real = hetero.layer_outputs

    def retrained_meanwhile(*args, **kwargs):
        hybridgnn.save_model(built(sage(graph), graph, seed=9), path, metadata=graph.metadata())
        yield from real(*args, **kwargs)

    from hybridgnn.errors import ConfigError

    monkeypatch.setattr(hetero, "layer_outputs", retrained_meanwhile)
    with pytest.raises(ConfigError, match="changed while this precompute ran: run it again"):
        hetero_precompute(model, graph, path, progress=False)
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is None  # the old model's rows: not the new one's
    monkeypatch.setattr(hetero, "layer_outputs", real)
    hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)
    assert HeteroEmbeddingStore.open(path, graph.fingerprint) is not None


def test_a_dataset_written_again_with_other_features_is_not_served_its_old_rows(graph, tmp_path):
    # The store's folder is the dataset fingerprint (edges and feature widths): a dataset
    # written again in place with the same edges and other features was served the rows
    # computed from the old ones.
    from hybridgnn.graph.hetero import write_hetero_dataset

    def write(seed):
        rng = np.random.default_rng(seed)
        nodes = {t: {"features": rng.standard_normal(n.features.shape).astype(np.float32)}
                 for t, n in graph.nodes.items()}
        edges = {e: (np.asarray(d.indptr), np.asarray(d.indices)) for e, d in graph.edges.items()}
        return HeteroGraphStore.open(write_hetero_dataset(tmp_path / "g", nodes=nodes, edges=edges))

    first = write(0)
    path = hybridgnn.save_model(built(sage(first), first), tmp_path / "m", metadata=first.metadata())
    hetero_precompute(open_hetero_model(path, first)[0], first, path, progress=False)
    again = write(1)
    assert again.fingerprint == first.fingerprint
    assert HeteroEmbeddingStore.for_graph(path, again) is None
    hetero_precompute(open_hetero_model(path, again)[0], again, path, progress=False)
    assert HeteroEmbeddingStore.for_graph(path, again) is not None


def test_a_store_rewritten_while_it_is_opened_is_not_served(graph, tmp_path, monkeypatch):
    # A reader read a complete state.json and then mapped the arrays; a rerun in between
    # (the store removed, then its arrays written anew, state.json last) had the reader
    # serve the new run's arrays, whole or not, under the old state.
    import shutil

    import hybridgnn.embeddings.hetero as hetero_module

    path = hybridgnn.save_model(built(sage(graph), graph), tmp_path / "m", metadata=graph.metadata())
    store = hetero_precompute(open_hetero_model(path, graph)[0], graph, path, progress=False)
    arrays = {p.relative_to(store.root): np.load(p) for p in store.root.rglob("*.npy")}
    real = hetero_module._stored_arrays

    def rewritten_meanwhile(root, state, num_nodes):
        shutil.rmtree(root)
        for rel, a in arrays.items():  # the rerun's arrays so far: as many rows, other values
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            np.save(root / rel, np.zeros_like(a))
        return real(root, state, num_nodes)

    monkeypatch.setattr(hetero_module, "_stored_arrays", rewritten_meanwhile)
    assert HeteroEmbeddingStore.for_graph(path, graph) is None
