import json
import re

import numpy as np
import pytest
import torch

from hybridgnn.embeddings.precompute import PrecomputeConfig, block_inputs, precompute
from hybridgnn.embeddings.store import EmbeddingStore, embeddings_dir
from hybridgnn.models.gnn import GNN, ModelSpec
from tests.support.reference import full_graph_forward


@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
@pytest.mark.parametrize("order,blocks", [("natural", "host"), ("rcm", "host"), ("natural", "device"),
                                          ("rcm", "device")])
def test_layerwise_precompute_equals_full_neighbourhood_inference(skewed_graph, tmp_path, kind, order, blocks):
    """Both block builders (numpy on the host; torch ops where the model runs, here CPU
    tensors standing in for a GPU) give the full-graph result."""
    torch.manual_seed(0)
    model = GNN(ModelSpec(kind, skewed_graph.feature_dim, 8, 3, num_layers=3, heads=2)).eval()
    store = precompute(skewed_graph, model, tmp_path / "m", PrecomputeConfig(batch_size=7, order=order, blocks=blocks),
                       progress=False)
    expected = full_graph_forward(skewed_graph, model)
    got = store.final
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    assert rel <= 1e-4, rel
    assert [layer.shape[1] for layer in store.layers] == [8, 8, 3]
    assert store.computed_unix_s > 0


def test_block_inputs_lists_targets_first_and_every_in_edge(skewed_graph):
    scratch = np.full(skewed_graph.num_nodes, -1, dtype=np.int64)
    targets = np.array([5, 0, 59])
    sources, ei = block_inputs(skewed_graph, targets, scratch)
    assert sources[:3].tolist() == [5, 0, 59] and len(set(sources.tolist())) == len(sources)
    assert np.all(scratch == -1)
    for t_local, t in enumerate(targets):
        got = sorted(sources[ei[0][ei[1] == t_local]].tolist())
        expect = sorted(np.asarray(skewed_graph.indices)[skewed_graph.indptr[t]:skewed_graph.indptr[t + 1]].tolist())
        assert got == expect


def test_device_blocks_equal_host_blocks(skewed_graph):
    from hybridgnn.embeddings.precompute import DeviceBlocks, gcn_degrees
    from hybridgnn.models.gnn import gcn_edge_weights

    scratch = np.full(skewed_graph.num_nodes, -1, dtype=np.int64)
    blocks = DeviceBlocks(skewed_graph, torch.device("cpu"), gcn=True)
    norm_degree, has_loop = gcn_degrees(skewed_graph)
    rng = np.random.default_rng(0)
    for size in (1, 5, 40, skewed_graph.num_nodes):
        targets = rng.permutation(skewed_graph.num_nodes)[:size]
        sources, ei = block_inputs(skewed_graph, targets, scratch)
        got_sources, got_ei = blocks.block(torch.from_numpy(targets))
        assert np.array_equal(got_sources.numpy(), sources) and np.array_equal(got_ei.numpy(), ei)
        assert torch.all(blocks.scratch == -1)
        ei_w, w = gcn_edge_weights(ei, sources, size, norm_degree, has_loop)
        got_ei_w, got_w = blocks.gcn_block(got_ei, got_sources, size)
        assert np.array_equal(got_ei_w.numpy(), ei_w) and np.allclose(got_w.numpy(), w, rtol=1e-7)


def test_a_block_that_runs_out_of_memory_leaves_the_scratch_map_clean(skewed_graph, monkeypatch):
    """BatchSizer retries an out-of-memory batch on a smaller one: a map left numbered by
    the failed one gave the retry's edges other nodes' rows (host and device blocks)."""
    from hybridgnn.embeddings.precompute import DeviceBlocks

    targets = np.array([5, 0, 59])
    scratch = np.full(skewed_graph.num_nodes, -1, dtype=np.int64)
    expect = block_inputs(skewed_graph, targets[:1], scratch)
    real_unique = np.unique
    with monkeypatch.context() as m:
        m.setattr(np, "unique", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("out of memory")))
        with pytest.raises(MemoryError):
            block_inputs(skewed_graph, targets, scratch)
    assert np.unique is real_unique and np.all(scratch == -1)
    got = block_inputs(skewed_graph, targets[:1], scratch)
    assert all(np.array_equal(a, b) for a, b in zip(got, expect, strict=True))

    blocks = DeviceBlocks(skewed_graph, torch.device("cpu"), gcn=False)
    with monkeypatch.context() as m:
        m.setattr(torch, "unique", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            blocks.block(torch.from_numpy(targets))
    assert torch.all(blocks.scratch == -1)
    got = blocks.block(torch.from_numpy(targets[:1]))
    assert np.array_equal(got[0].numpy(), expect[0]) and np.array_equal(got[1].numpy(), expect[1])


def test_resume_after_interruption(skewed_graph, tmp_path, monkeypatch):
    torch.manual_seed(1)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3, num_layers=2)).eval()
    cfg = PrecomputeConfig(batch_size=8, max_batch_size=8)
    calls = {"n": 0}
    real = GNN.layer

    def dies_on_fifth(self, *a, **kw):
        calls["n"] += a[3] > 1  # count batches, not the one-node shape probe
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(GNN, "layer", dies_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        precompute(skewed_graph, model, tmp_path / "m", cfg, progress=False)
    state = json.loads((embeddings_dir(tmp_path / "m", skewed_graph.fingerprint) / "state.json").read_text())
    assert state["done"] == 32 and not state["complete"]
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is None
    monkeypatch.setattr(GNN, "layer", real)
    calls["n"] = 0
    store = precompute(skewed_graph, model, tmp_path / "m", cfg, progress=False)
    np.testing.assert_allclose(store.final, full_graph_forward(skewed_graph, model), rtol=1e-4, atol=1e-5)


def test_a_rerun_with_other_settings_that_dies_in_its_first_batch_leaves_no_complete_store(skewed_graph, tmp_path,
                                                                                          monkeypatch):
    # state.json said complete (float32) until the first batch of the float16 rerun was
    # done, while layer_1.npy had already been recreated empty: a rerun dying in between
    # left a store of zeros that was served.
    from hybridgnn.models.checkpoint import save_model

    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    save_model(model, tmp_path / "m")
    precompute(skewed_graph, model, tmp_path / "m", progress=False)

    real = GNN.layer

    def dies(self, *a, **kw):
        if a[3] > 1:  # a batch, not the one-node shape probe
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(GNN, "layer", dies)
    with pytest.raises(KeyboardInterrupt):
        precompute(skewed_graph, model, tmp_path / "m", PrecomputeConfig(dtype="float16"), progress=False)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is None


def test_a_model_saved_again_into_its_directory_gets_fresh_embeddings(skewed_graph, tmp_path):
    # The stored rows were keyed by the dataset alone: a model retrained and saved into the
    # same directory was served its predecessor's embeddings, and precompute kept them.
    from hybridgnn.models.checkpoint import save_model

    torch.manual_seed(0)
    first = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    save_model(first, tmp_path / "m")
    precompute(skewed_graph, first, tmp_path / "m", progress=False)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is not None
    torch.manual_seed(1)
    second = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    save_model(second, tmp_path / "m")
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is None  # stale: not served
    store = precompute(skewed_graph, second, tmp_path / "m", progress=False)
    np.testing.assert_allclose(store.final, full_graph_forward(skewed_graph, second), rtol=1e-4, atol=1e-5)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is not None


def test_a_store_in_use_keeps_its_rows_while_the_directory_is_precomputed_again(skewed_graph, tmp_path):
    # A repository restarting a version whose weights changed precomputes into the directory
    # the serving version maps: written in place, its files were truncated under the map, and
    # a lookup meanwhile killed the server (SIGBUS).
    from hybridgnn.models.checkpoint import save_model

    torch.manual_seed(0)
    first = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    save_model(first, tmp_path / "m")
    serving = precompute(skewed_graph, first, tmp_path / "m", progress=False)
    before = [np.array(a) for a in serving.layers]
    torch.manual_seed(1)
    second = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    save_model(second, tmp_path / "m")
    fresh = precompute(skewed_graph, second, tmp_path / "m", progress=False)
    assert not np.allclose(np.asarray(fresh.final), before[-1])
    for mapped, rows in zip(serving.layers, before, strict=True):  # the old map: the old files' pages
        np.testing.assert_array_equal(np.asarray(mapped), rows)


def test_float16_and_oom_halving(skewed_graph, tmp_path, monkeypatch):
    model = GNN(ModelSpec("gcn", skewed_graph.feature_dim, 8, 3)).eval()
    real = GNN.layer
    seen = []

    def oom_when_big(self, i, x, ei, t, **kw):
        seen.append(t)
        if t > 16:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, i, x, ei, t, **kw)

    monkeypatch.setattr(GNN, "layer", oom_when_big)
    store = precompute(skewed_graph, model, tmp_path / "m", PrecomputeConfig(batch_size=64, dtype="float16"),
                       progress=False)
    assert store.final.dtype == np.float16 and max(t for t in seen[-3:]) <= 16
    monkeypatch.setattr(GNN, "layer", real)
    np.testing.assert_allclose(store.final.astype(np.float32), full_graph_forward(skewed_graph, model),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("blocks", ["host", "device"])
def test_a_float16_store_is_read_in_batches_not_widened_whole(tmp_path, blocks):
    # Layer l+1 read layer l of a float16 store as one float32 copy in memory (twice the
    # stored layer, however large the graph), where a float32 store is read mapped.
    import tracemalloc

    from tests.support.graphs import four_in_edges_graph_and_sage

    n, hidden = 20000, 128
    graph, model = four_in_edges_graph_and_sage(tmp_path / "g", n, hidden)
    cfg = PrecomputeConfig(batch_size=512, max_batch_size=512, dtype="float16", blocks=blocks)
    tracemalloc.start()  # numpy's allocations (the widened copy was one)
    try:
        store = precompute(graph, model, tmp_path / "m", cfg, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n * hidden * 4 / 4, peak
    np.testing.assert_allclose(store.final.astype(np.float32), full_graph_forward(graph, model), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["GraphSAGE", "GCN", "GAT", "GIN"])
def test_any_pyg_basic_gnn_stack_precomputes_exactly(skewed_graph, tmp_path, name):
    import torch_geometric.nn.models as pyg_models

    torch.manual_seed(0)
    kwargs = {"heads": 2} if name == "GAT" else {}
    model = getattr(pyg_models, name)(skewed_graph.feature_dim, 8, num_layers=3, out_channels=3, norm="layer_norm",
                                      **kwargs).eval()
    store = precompute(skewed_graph, model, tmp_path / "m", progress=False)
    expected = full_graph_forward(skewed_graph, model)
    assert np.abs(store.final - expected).max() / np.abs(expected).max() <= 1e-4


def test_models_that_cannot_be_decomposed_are_refused(skewed_graph, tmp_path):
    import torch_geometric.nn.models as pyg_models

    model = pyg_models.GraphSAGE(4, 8, num_layers=2, out_channels=3)
    model.jk_mode = "attention"  # a mode PyG might add: refused, never guessed
    with pytest.raises(ValueError, match="jumping knowledge jk='attention' is not supported"):
        precompute(skewed_graph, model, tmp_path / "a")
    with pytest.raises(ValueError, match="cannot decompose|not a stack"):
        precompute(skewed_graph, torch.nn.Linear(4, 3), tmp_path / "b")


def _layer(root, i):
    return root / f"layer_{i}.npy"


def _truncate_every_layer(root, n):
    for path in sorted(root.glob("layer_*.npy")):
        np.save(path, np.load(path)[: n - 1])


@pytest.mark.parametrize("damage", [
    lambda root, n: _layer(root, 1).write_bytes(b""),  # EOFError traceback at startup
    lambda root, n: _layer(root, 2).write_bytes(_layer(root, 2).read_bytes()[:200]),  # "mmap length ..." exit 2
    lambda root, n: _layer(root, 2).unlink(),  # FileNotFoundError traceback
    lambda root, n: np.save(_layer(root, 2), np.load(_layer(root, 2))[:10]),  # IndexError per request
    lambda root, n: np.save(_layer(root, 2), np.load(_layer(root, 2))[:, 0]),  # 1-D rows served
    lambda root, n: np.save(_layer(root, 2), np.zeros((n, 9), np.float32)),  # another width served
    lambda root, n: np.save(_layer(root, 2), np.full((n, 3), "x")),
    lambda root, n: _edit_state(root, num_layers="2"),  # TypeError traceback
    lambda root, n: _edit_state(root, num_layers=0),  # IndexError traceback
    lambda root, n: _edit_state(root, output=True),  # FileNotFoundError: no output.npy
    lambda root, n: _edit_state(root, computed_unix_s="yesterday"),  # ValueError answering metadata
    _truncate_every_layer,  # rows agree with each other, not with the dataset: IndexError for the last node
    lambda root, n: _edit_state(root, computed_unix_s=True),  # a bool is not a time
    lambda root, n: _edit_state(root, num_layers=0, dims=None),  # no layers: IndexError reading the output
    lambda root, n: _edit_state(root, dims=[8]),  # widths of fewer layers than it has: IndexError
])
def test_a_damaged_store_is_not_served_and_precompute_makes_it_again(skewed_graph, tmp_path, damage, caplog):
    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    precompute(skewed_graph, model, tmp_path / "m", progress=False)
    n = skewed_graph.num_nodes
    damage(embeddings_dir(tmp_path / "m", skewed_graph.fingerprint), n)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, n) is None
    assert "are damaged" in caplog.text
    store = precompute(skewed_graph, model, tmp_path / "m", progress=False)  # it returned None, or the damage
    np.testing.assert_allclose(store.final, full_graph_forward(skewed_graph, model), rtol=1e-4, atol=1e-5)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, n) is not None


def _edit_state(root, **changes):
    state = json.loads((root / "state.json").read_text())
    (root / "state.json").write_text(json.dumps({**state, **changes}))


def test_ranks_on_one_machine_share_its_memory_budget(monkeypatch):
    # Each of N ranks aimed for a quarter of the machine's free memory: N/4 of it together.
    import os

    from hybridgnn.embeddings.precompute import PrecomputeConfig, _memory_budget

    pages = {"SC_AVPHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}  # 4 GiB free
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    cfg = PrecomputeConfig()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _memory_budget(cfg) == 1 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _memory_budget(cfg) == 1 << 28
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "nonsense")
    assert _memory_budget(cfg) == 1 << 30


def test_one_process_writes_a_store_at_a_time_and_the_one_that_waited_finds_it_done(skewed_graph, tmp_path):
    """Two writers of one store (replicas sharing a model repository, `hybridgnn precompute`
    beside a server) unlinked and rewrote each other's layer files, and one could mark
    complete a store holding the other's rows. The second waits for the first's lock."""
    import threading

    from hybridgnn.capabilities import exclusive
    from hybridgnn.embeddings.store import store_lock
    from hybridgnn.models.checkpoint import save_model

    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 2)).eval()
    save_model(model, tmp_path / "m")
    root = embeddings_dir(tmp_path / "m", skewed_graph.fingerprint)
    result = []
    with exclusive(store_lock(root), "held by the test"):  # another process writing the store
        waiter = threading.Thread(target=lambda: result.append(precompute(skewed_graph, model, tmp_path / "m",
                                                                          progress=False)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not (root / "state.json").exists()  # it waits, writing nothing
    waiter.join(60)
    assert not waiter.is_alive()
    np.testing.assert_allclose(result[0].final, full_graph_forward(skewed_graph, model), rtol=1e-4, atol=1e-5)


def test_a_model_saved_while_a_precompute_waits_is_not_stamped_on_the_old_rows(skewed_graph, tmp_path):
    """A run loads its model, then waits for the store's lock (another writer): the weights'
    fingerprint it stamped was read from the directory after the wait, so a model saved
    there meanwhile had the old model's rows marked complete as its own, served and never
    computed again."""
    import threading

    from hybridgnn.capabilities import exclusive
    from hybridgnn.embeddings.store import store_lock
    from hybridgnn.errors import ConfigError
    from hybridgnn.models.checkpoint import load_checkpoint, save_model

    torch.manual_seed(0)
    save_model(GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 2)).eval(), tmp_path / "m")
    old, _ = load_checkpoint(tmp_path / "m")
    root = embeddings_dir(tmp_path / "m", skewed_graph.fingerprint)
    result = []

    def run():
        try:
            result.append(precompute(skewed_graph, old, tmp_path / "m", progress=False))
        except ConfigError as exc:
            result.append(exc)

    with exclusive(store_lock(root), "held by the test"):  # another process writing the store
        waiter = threading.Thread(target=run)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()
        torch.manual_seed(1)
        new = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 2)).eval()
        save_model(new, tmp_path / "m")  # retrained and saved into the directory meanwhile
    waiter.join(60)
    assert isinstance(result[0], ConfigError) and "changed while this precompute waited" in str(result[0])
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, skewed_graph.num_nodes) is None
    store = precompute(skewed_graph, load_checkpoint(tmp_path / "m")[0], tmp_path / "m", progress=False)
    np.testing.assert_allclose(store.final, full_graph_forward(skewed_graph, new), rtol=1e-4, atol=1e-5)


def test_a_model_saved_while_a_precompute_runs_is_said_in_one_line(skewed_graph, tmp_path, monkeypatch):
    """Its rows are stamped with the weights it started with (never served for the new
    ones); the run then returned no store, and the CLI's report raised AttributeError."""
    import importlib

    from hybridgnn.errors import ConfigError
    from hybridgnn.models.checkpoint import load_checkpoint, save_model

    module = importlib.import_module("hybridgnn.embeddings.precompute")
    torch.manual_seed(0)
    save_model(GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 2)).eval(), tmp_path / "m")
    real = module.unlink_mapped
    saved = []

    def retrained_meanwhile(path):
        if not saved:
            torch.manual_seed(1)
            saved.append(save_model(GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 2)).eval(), tmp_path / "m"))
        real(path)

    monkeypatch.setattr(module, "unlink_mapped", retrained_meanwhile)
    with pytest.raises(ConfigError, match="changed while this precompute ran"):
        precompute(skewed_graph, load_checkpoint(tmp_path / "m")[0], tmp_path / "m", progress=False)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, skewed_graph.num_nodes) is None


def test_the_run_that_waited_keeps_the_store_the_other_made_with_other_settings(skewed_graph, tmp_path, caplog):
    """A server precomputing missing embeddings (float32) waited for an operator's `precompute
    --dtype float16` and then, its settings differing, computed the store again over it."""
    import threading

    from hybridgnn.capabilities import exclusive
    from hybridgnn.embeddings.precompute import _precompute_locked
    from hybridgnn.embeddings.store import store_lock
    from hybridgnn.models.checkpoint import save_model

    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 2)).eval()
    save_model(model, tmp_path / "m")
    root = embeddings_dir(tmp_path / "m", skewed_graph.fingerprint)
    result = []
    with exclusive(store_lock(root), "held by the test"):  # the operator's run
        waiter = threading.Thread(target=lambda: result.append(precompute(skewed_graph, model, tmp_path / "m",
                                                                          progress=False)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()
        _precompute_locked(skewed_graph, model, tmp_path / "m", root, PrecomputeConfig(dtype="float16"),
                           torch.device("cpu"), False)
        made = [(root / f"layer_{i}.npy").stat().st_ino for i in (1, 2)]
    waiter.join(60)
    assert result[0].state["dtype"] == "float16" and result[0].layers[-1].dtype == np.float16
    assert [(root / f"layer_{i}.npy").stat().st_ino for i in (1, 2)] == made  # not computed again
    assert "another process precomputed" in caplog.text
    # a run that did not wait still computes it with its own settings
    assert precompute(skewed_graph, model, tmp_path / "m", progress=False).state["dtype"] == "float32"


def test_a_dataset_rewritten_with_other_features_gets_fresh_embeddings(tmp_path, monkeypatch):
    # The store is keyed by the dataset's fingerprint, which covers its topology and
    # feature width only: a dataset imported again in place with other features was
    # served the old features' rows, precompute called them complete, and a run stopped
    # half-way resumed over the new features with the old ones' rows.
    from tests.support.graphs import make_graph, skewed_edges

    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", 4, 8, 3)).eval()
    first = make_graph(tmp_path / "d", skewed_edges(), 60, seed=0)
    for m in ("m", "served"):
        precompute(first, model, tmp_path / m, progress=False)
    again = make_graph(tmp_path / "d", skewed_edges(), 60, seed=1)  # same place and edges, other features
    assert again.fingerprint == first.fingerprint
    store = precompute(again, model, tmp_path / "m", progress=False)
    np.testing.assert_allclose(store.final, full_graph_forward(again, model), rtol=1e-4, atol=1e-5)
    assert EmbeddingStore.for_graph(tmp_path / "m", again) is not None
    assert EmbeddingStore.for_graph(tmp_path / "served", again) is None  # what a server opens

    real, batches = GNN.layer, []

    def dies_in_layer_two(self, *a, **kw):
        batches.append(a[3] > 1)  # a batch, not the one-node shape probe
        if sum(batches) == 10:  # 8 batches of 8 make layer 1
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    third = make_graph(tmp_path / "d", skewed_edges(), 60, seed=2)
    monkeypatch.setattr(GNN, "layer", dies_in_layer_two)
    with pytest.raises(KeyboardInterrupt):
        precompute(third, model, tmp_path / "m", PrecomputeConfig(batch_size=8, max_batch_size=8), progress=False)
    monkeypatch.setattr(GNN, "layer", real)
    fourth = make_graph(tmp_path / "d", skewed_edges(), 60, seed=3)
    store = precompute(fourth, model, tmp_path / "m", progress=False)
    np.testing.assert_allclose(store.final, full_graph_forward(fourth, model), rtol=1e-4, atol=1e-5)


def test_a_store_rewritten_while_it_is_opened_is_not_served(skewed_graph, tmp_path, monkeypatch):
    # A reader read a complete state.json and then mapped the layer files; a rerun with
    # other settings in between (its incomplete state written first, then each layer file
    # made anew: zeros until computed) had the reader serve the new files' zeros.
    import hybridgnn.embeddings.store as store_module
    from hybridgnn.embeddings.store import write_state

    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    precompute(skewed_graph, model, tmp_path / "m", progress=False)
    real = store_module._stored_arrays

    def rewritten_meanwhile(root, state, num_nodes):
        write_state(root, {**state, "complete": False, "dtype": "float16", "layer": 0, "done": 0})
        for i, width in enumerate(state["dims"], start=1):
            (root / f"layer_{i}.npy").unlink()
            np.lib.format.open_memmap(root / f"layer_{i}.npy", mode="w+", dtype=np.float16,
                                      shape=(skewed_graph.num_nodes, width))
        return real(root, state, num_nodes)

    monkeypatch.setattr(store_module, "_stored_arrays", rewritten_meanwhile)
    assert EmbeddingStore.for_graph(tmp_path / "m", skewed_graph) is None


@pytest.mark.parametrize("damage", ["current layer missing", "current layer truncated", "previous layer missing",
                                    "previous layer truncated"])
def test_a_resumed_run_whose_files_were_lost_starts_over(skewed_graph, tmp_path, monkeypatch, damage):
    # A run stopped mid-layer resumed into whatever file was there: a missing layer file was
    # made anew (zeros) and a truncated one extended with zeros (memmap r+), so the rows
    # done before the stop were zeros in a store then marked complete and served; a
    # missing earlier layer failed every rerun (FileNotFoundError) until state.json went.
    torch.manual_seed(1)
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3, num_layers=2)).eval()
    cfg = PrecomputeConfig(batch_size=8, max_batch_size=8)
    real, batches = GNN.layer, []

    def dies_in_layer_two(self, *a, **kw):
        batches.append(a[3] > 1)  # a batch, not the one-node shape probe
        if sum(batches) == 11:  # 8 batches make layer 1
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(GNN, "layer", dies_in_layer_two)
    with pytest.raises(KeyboardInterrupt):
        precompute(skewed_graph, model, tmp_path / "m", cfg, progress=False)
    monkeypatch.setattr(GNN, "layer", real)
    root = embeddings_dir(tmp_path / "m", skewed_graph.fingerprint)
    assert json.loads((root / "state.json").read_text())["done"] == 16
    path = root / ("layer_2.npy" if damage.startswith("current") else "layer_1.npy")
    if damage.endswith("missing"):
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:160])  # the header and the first rows
    store = precompute(skewed_graph, model, tmp_path / "m", cfg, progress=False)
    np.testing.assert_allclose(store.final, full_graph_forward(skewed_graph, model), rtol=1e-4, atol=1e-5)


# What mutation testing showed unpinned: each damage below was served (or crashed the
# open) with one small change to embeddings/store.py that the tests above let pass.

def test_a_store_its_state_calls_unfinished_is_not_served(skewed_graph, tmp_path):
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    precompute(skewed_graph, model, tmp_path / "m", progress=False)
    _edit_state(embeddings_dir(tmp_path / "m", skewed_graph.fingerprint), complete=False)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is None


def test_a_jumping_knowledge_store_with_output_rows_missing_is_not_served(skewed_graph, tmp_path, caplog):
    from torch_geometric.nn.models import GraphSAGE

    torch.manual_seed(0)
    model = GraphSAGE(skewed_graph.feature_dim, 8, num_layers=2, out_channels=3, jk="cat").eval()
    store = precompute(skewed_graph, model, tmp_path / "m", progress=False)
    assert store.output is not None
    root, n = embeddings_dir(tmp_path / "m", skewed_graph.fingerprint), skewed_graph.num_nodes
    np.save(root / "output.npy", np.load(root / "output.npy")[: n - 1])
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, n) is None
    assert "are damaged" in caplog.text


def test_the_features_fingerprint_tells_apart_features_that_differ_only_in_where_rows_end():
    from types import SimpleNamespace

    from hybridgnn.embeddings.store import features_fingerprint

    def hetero(*arrays):
        return SimpleNamespace(nodes={f"t{i}": SimpleNamespace(features=a) for i, a in enumerate(arrays)})

    values = np.arange(8, dtype=np.float32)
    split = {features_fingerprint(hetero(values[:6].reshape(3, 2), values[6:].reshape(1, 2))),
             features_fingerprint(hetero(values[:4].reshape(2, 2), values[4:].reshape(2, 2))),
             features_fingerprint(SimpleNamespace(features=values.reshape(4, 2))),
             features_fingerprint(SimpleNamespace(features=values.reshape(2, 4)))}
    assert len(split) == 4
    small = np.zeros((10, 1), np.float32)  # every row of a small graph is hashed, the second type's too
    changed = small.copy()
    changed[1, 0] = 1
    assert features_fingerprint(SimpleNamespace(features=small)) != features_fingerprint(
        SimpleNamespace(features=changed))
    assert features_fingerprint(hetero(small, values.reshape(4, 2))) != features_fingerprint(
        hetero(small, values.reshape(4, 2)[::-1].copy()))


@pytest.mark.parametrize("text", ["{not json", "\xff\xfe"])
def test_a_store_whose_state_is_not_json_is_not_served(skewed_graph, tmp_path, text):
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3)).eval()
    precompute(skewed_graph, model, tmp_path / "m", progress=False)
    (embeddings_dir(tmp_path / "m", skewed_graph.fingerprint) / "state.json").write_text(text, "latin-1")
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint) is None


def test_a_model_mixing_gcn_with_other_convolutions_is_refused_by_decompose():
    # GCN layers are weighted by whole-graph degrees on samples; a mix was read as no GCN
    import torch_geometric.nn.models as pyg_models
    from torch_geometric.nn import GCNConv

    from hybridgnn.models.decompose import decompose

    model = pyg_models.GraphSAGE(4, 8, num_layers=2, out_channels=3)
    model.convs[0] = GCNConv(4, 8)
    with pytest.raises(ValueError, match="mixing GCNConv with other convolutions is not supported"):
        decompose(model)
    assert decompose(pyg_models.GCN(4, 8, num_layers=2, out_channels=3)).gcn_normalised


def test_a_module_with_convolutions_but_not_a_basic_gnns_parts_is_refused_by_decompose():
    from torch_geometric.nn import SAGEConv

    from hybridgnn.models.decompose import decompose

    model = torch.nn.Module()
    model.convs = torch.nn.ModuleList([SAGEConv(4, 8), SAGEConv(8, 3)])  # no norms, no act: its forward is its own
    with pytest.raises(ValueError, match="is not a stack of message-passing layers hybridgnn can decompose"):
        decompose(model)


@pytest.mark.parametrize("jk", ["cat", "max", "last"])
def test_a_jumping_knowledge_models_embedding_is_what_its_head_reads(jk):
    import torch_geometric.nn.models as pyg_models

    from hybridgnn.models.decompose import decompose

    torch.manual_seed(0)
    model = pyg_models.GraphSAGE(4, 8, num_layers=2, out_channels=3, jk=jk).eval()
    stack = decompose(model)
    layers = [torch.randn(5, 8), torch.randn(5, 8)]
    want = {"cat": torch.cat(layers, dim=-1), "max": torch.maximum(*layers), "last": layers[-1]}[jk]
    assert torch.equal(stack.embedding(layers, torch.randn(5, 4)), want)
    assert torch.allclose(stack.readout(layers), model.lin(want))


def _store_of_another_model(root, n):
    """A store whose state.json records no weights (as before it did): its last layer 5
    wide, the model's 3."""
    state = json.loads((root / "state.json").read_text())
    del state["model_fingerprint"]
    np.save(root / "layer_3.npy", np.zeros((n, 5), np.float32))
    (root / "state.json").write_text(json.dumps({**state, "dims": [*state["dims"][:2], 5]}))


def _store_one_layer_short(root, n):
    state = json.loads((root / "state.json").read_text())
    del state["model_fingerprint"]
    (root / "layer_3.npy").unlink()
    (root / "state.json").write_text(json.dumps({**state, "num_layers": 2, "dims": state["dims"][:2]}))


@pytest.mark.parametrize("change, said", [(_store_of_another_model, r"its layers are \[8, 8, 5\] wide, the model's "
                                                                     r"\[8, 8, 3\]"),
                                          (_store_one_layer_short, "it holds 2 layers, the model has 3")])
def test_a_store_that_is_not_the_models_is_not_served(skewed_graph, tmp_path, caplog, change, said):
    """Served whatever its widths when state.json named no weights: precomputed answers
    of 5 logits from a 3-class model (and an IndexError for new nodes)."""
    from hybridgnn.models.decompose import decompose

    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3, num_layers=3)).eval()
    precompute(skewed_graph, model, tmp_path / "m", progress=False)
    n = skewed_graph.num_nodes
    change(embeddings_dir(tmp_path / "m", skewed_graph.fingerprint), n)
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, n) is not None  # nothing to compare with
    assert EmbeddingStore.open(tmp_path / "m", skewed_graph.fingerprint, n, model=decompose(model)) is None
    assert re.search(f"not this model's \\({said}\\)", caplog.text)
