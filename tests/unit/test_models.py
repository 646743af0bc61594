import json

import numpy as np
import pytest
import torch

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.store import GraphStore, write_dataset
from hybridgnn.models.checkpoint import (
    CheckpointError,
    _file_fingerprint,
    load_checkpoint,
    save_checkpoint,
    weights_fingerprint,
    weights_match,
)
from hybridgnn.models.gnn import GNN, ModelSpec
from hybridgnn.models.train import TrainConfig, accuracy, train
from hybridgnn.sampling.cpu import CPUSampler


@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
def test_trimmed_forward_equals_full_forward_on_seeds(skewed_graph, kind):
    torch.manual_seed(0)
    model = GNN(ModelSpec(kind, skewed_graph.feature_dim, 8, 3, num_layers=2, heads=2)).eval()
    sub = CPUSampler(skewed_graph, (4, 3), seed=3).sample(np.array([0, 1, 7, 30]))
    x = torch.from_numpy(np.asarray(skewed_graph.features)[sub.node_ids])
    ei = torch.from_numpy(sub.edge_index)
    seeds = torch.from_numpy(sub.seed_index)
    with torch.inference_mode():
        trimmed = model(x, ei, sub.num_sampled_nodes, sub.num_sampled_edges)
        full = model(x, ei)
    assert trimmed.shape[0] == sub.num_sampled_nodes[0]
    torch.testing.assert_close(trimmed[seeds], full[seeds], rtol=1e-4, atol=1e-5)


def test_forward_needs_enough_hops(skewed_graph):
    model = GNN(ModelSpec("sage", skewed_graph.feature_dim, 8, 3, num_layers=3)).eval()
    sub = CPUSampler(skewed_graph, (4, 3)).sample(np.array([0]))
    with pytest.raises(ValueError, match="2 hops but the model has 3 layers"):
        model(torch.zeros(sub.num_nodes, skewed_graph.feature_dim), torch.from_numpy(sub.edge_index),
              sub.num_sampled_nodes, sub.num_sampled_edges)


def test_spec_validation():
    with pytest.raises(ValueError, match="kind"):
        ModelSpec("mlp", 4, 8, 2)
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec("gat", 4, 6, 2, heads=4)


def test_checkpoint_roundtrip_and_errors(tmp_path):
    model = GNN(ModelSpec("gat", 5, 8, 3, heads=2)).eval()
    save_checkpoint(model, tmp_path / "m", extra={"fanouts": [3, 2]})
    loaded, cfg = load_checkpoint(tmp_path / "m")
    assert cfg["fanouts"] == [3, 2] and loaded.spec == model.spec
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "m" / "config.json").write_text('{"spec": {"kind": "sage"}}')
    with pytest.raises(CheckpointError, match="older hybridgnn"):
        load_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"class": "hybridgnn.GNN"}')
    with pytest.raises(CheckpointError, match="lacks 'args'"):
        load_checkpoint(tmp_path / "m")


def test_weights_only_refuses_pickled_code(tmp_path):
    import pickle

    model = GNN(ModelSpec("sage", 5, 8, 3))
    save_checkpoint(model, tmp_path / "m")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "m" / "model.pt").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"cannot load .*model.pt \(tensors only"):
        load_checkpoint(tmp_path / "m")


def test_weights_fingerprint_names_the_values_not_the_file(tmp_path):
    """The same weights in different files (torch.save may write a random serialization
    id; another tool, another format) have one fingerprint, so a profile made with a
    model generated on one machine matches the same model generated on another."""
    from hybridgnn.updates.snapshot import model_fingerprint

    torch.manual_seed(0)
    model = GNN(ModelSpec("sage", 5, 8, 3))
    save_checkpoint(model, tmp_path / "a")
    save_checkpoint(model, tmp_path / "b")
    torch.save(model.state_dict(), tmp_path / "b" / "model.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "a" / "model.pt").read_bytes() != (tmp_path / "b" / "model.pt").read_bytes()
    assert weights_fingerprint(tmp_path / "a") == weights_fingerprint(tmp_path / "b")
    assert model_fingerprint(tmp_path / "a") == model_fingerprint(tmp_path / "b")
    # what profiles and stores made before this scheme recorded (the file's hash) still match
    assert weights_match(_file_fingerprint(tmp_path / "a"), tmp_path / "a")
    assert not weights_match(_file_fingerprint(tmp_path / "a"), tmp_path / "b")
    assert not weights_match(None, tmp_path / "a")
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6  # one value changed
    save_checkpoint(model, tmp_path / "c")
    assert weights_fingerprint(tmp_path / "c") != weights_fingerprint(tmp_path / "a")
    (tmp_path / "c" / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot load"):
        weights_fingerprint(tmp_path / "c")


def test_training_learns(tiny_dataset):
    graph = GraphStore.open(tiny_dataset)
    model, metrics = train(graph, TrainConfig(kind="gcn", hidden_dim=16, fanouts=(5, 3), epochs=3, batch_size=128), progress=False)
    chance = 1 / graph.num_classes
    assert metrics["test_acc"] > chance + 0.3
    assert accuracy(model, graph, CPUSampler(graph, (5, 3)), "val_mask") > chance + 0.3


def test_training_needs_labels(skewed_graph):
    with pytest.raises(ValueError, match="labelled"):
        train(skewed_graph, TrainConfig(epochs=1), progress=False)


def test_training_refuses_labels_it_cannot_learn_in_one_line(tmp_path):
    # Each was a traceback: an IndexError inside the loss (a label -1 or past num_classes
    # among the training nodes), a ZeroDivisionError (an empty train_mask), or an output
    # layer of num_classes columns allocated as meta.json said.
    from tests.support.graphs import skewed_edges

    edges = np.asarray(skewed_edges(), dtype=np.int64)
    indptr, indices = coo_to_csr([edges[:, 0]], [edges[:, 1]], 60, dedup=True, drop_self_loops=False)
    feats = np.zeros((60, 4), np.float32)
    every = np.ones(60, bool)

    def dataset(name, labels, train_mask=every, **meta):
        root = write_dataset(tmp_path / name, indptr=indptr, indices=indices, features=feats, labels=labels,
                             masks={"train_mask": train_mask})
        if meta:
            saved = json.loads((root / "meta.json").read_text())
            (root / "meta.json").write_text(json.dumps({**saved, **meta}))
        return GraphStore.open(root)

    labels = np.arange(60) % 3
    with pytest.raises(ValueError, match=r"labels lie in \[-1, 2\].*unlabelled nodes \(-1\) must not be in train_mask"):
        train(dataset("unlabelled", np.where(np.arange(60) == 5, -1, labels)), TrainConfig(epochs=1), progress=False)
    with pytest.raises(ValueError, match=r"lie in \[0, 2\], not in \[0, 2\)"):
        train(dataset("past", labels, num_classes=2), TrainConfig(epochs=1), progress=False)
    with pytest.raises(ValueError, match="num_classes=1,000,000,000,000 for 60 nodes: more classes than nodes"):
        train(dataset("huge", labels, num_classes=10**12), TrainConfig(epochs=1), progress=False)
    with pytest.raises(ValueError, match="no node in train_mask"):
        train(dataset("empty", labels, train_mask=np.zeros(60, bool)), TrainConfig(epochs=1), progress=False)
    unmasked = write_dataset(tmp_path / "unmasked", indptr=indptr, indices=indices, features=feats, labels=labels)
    with pytest.raises(ValueError, match="has labels but no train_mask: import a PyG Data with a train_mask"):
        train(GraphStore.open(unmasked), TrainConfig(epochs=1), progress=False)
    model, _ = train(dataset("fine", labels), TrainConfig(hidden_dim=8, fanouts=(3, 2), epochs=1), progress=False)
    assert model.spec.out_dim == 3


def test_weights_replaced_with_the_same_size_and_time_have_their_own_fingerprint(tmp_path):
    # The fingerprint was cached by (path, size, mtime): weights of the same architecture
    # renamed over the old ones with the old mtime (images and rsync -t keep mtimes) kept
    # the old fingerprint, so embeddings precomputed with the old weights were served.
    import os

    torch.manual_seed(0)
    save_checkpoint(GNN(ModelSpec("sage", 5, 8, 3)), tmp_path / "m")
    save_checkpoint(GNN(ModelSpec("sage", 5, 8, 3)), tmp_path / "other")
    path, other = tmp_path / "m" / "model.pt", tmp_path / "other" / "model.pt"
    before = weights_fingerprint(tmp_path / "m")
    st = path.stat()
    assert other.stat().st_size == st.st_size
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert weights_fingerprint(tmp_path / "m") != before


def test_training_out_of_memory_is_one_line(tiny_dataset, monkeypatch):
    # torch's allocator raises RuntimeError: --hidden-dim 10**8 ended in a traceback.
    from hybridgnn.models import gnn

    def oom(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 714000000000 bytes. Error code 12")

    monkeypatch.setattr(gnn, "stack_forward", oom)
    with pytest.raises(ValueError, match="training ran out of memory .* lower --hidden-dim"):
        train(GraphStore.open(tiny_dataset), TrainConfig(hidden_dim=8, epochs=1), progress=False)


# What mutation testing showed unpinned: each test below failed with one small change to
# models/checkpoint.py's fingerprint that the tests above let pass.

def test_weights_written_in_place_with_the_old_size_and_time_have_their_own_fingerprint(tmp_path):
    # the same file (inode) rewritten, its mtime set back: only the change time differs
    import os
    import time

    torch.manual_seed(0)
    save_checkpoint(GNN(ModelSpec("sage", 5, 8, 3)), tmp_path / "m")
    save_checkpoint(GNN(ModelSpec("sage", 5, 8, 3)), tmp_path / "other")
    path, other = tmp_path / "m" / "model.pt", tmp_path / "other" / "model.pt"
    before, st = weights_fingerprint(tmp_path / "m"), path.stat()
    assert other.stat().st_size == st.st_size
    time.sleep(0.02)  # past the filesystem's timestamp granularity
    with open(path, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino and path.stat().st_mtime_ns == st.st_mtime_ns
    assert weights_fingerprint(tmp_path / "m") != before


def _fingerprint_of(tmp_path, state, name):
    (tmp_path / name).mkdir()
    torch.save(state, tmp_path / name / "model.pt")
    return weights_fingerprint(tmp_path / name)


def test_the_fingerprint_names_each_tensors_name_dtype_shape_and_plain_values_not_the_order(tmp_path):
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(6)
    base = _fingerprint_of(tmp_path, {"w": a, "v": b, "n": 3}, "base")
    assert _fingerprint_of(tmp_path, {"v": b, "n": 3, "w": a}, "reordered") == base
    others = {"swapped": {"w": b, "v": a, "n": 3},  # the same tensors under each other's names
              "dtype": {"w": a.view(torch.int32), "v": b, "n": 3},  # the same bytes read as another dtype
              "shape": {"w": a.reshape(2, 3), "v": b, "n": 3},
              "plain": {"w": a, "v": b, "n": 4},
              "renamed": {"x": a, "v": b, "n": 3}}  # hashed in the same order under another name
    for name, state in others.items():
        assert _fingerprint_of(tmp_path, state, name) != base, name
    with pytest.raises(CheckpointError, match="holds a list, not a state_dict"):
        _fingerprint_of(tmp_path, [a], "list")
