import numpy as np
import pytest
import torch

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.generate import generate_csbm, generate_powerlaw
from hybridgnn.graph.importers import import_graph
from hybridgnn.graph.store import DatasetError, GraphStore, write_dataset


def test_coo_to_csr_dedups_sorts_and_counts():
    rows = np.array([0, 0, 0, 2, 2, 1, 1], dtype=np.int64)
    cols = np.array([2, 1, 2, 0, 2, 1, 0], dtype=np.int64)
    indptr, indices = coo_to_csr([rows], [cols], 3, dedup=True, drop_self_loops=True)
    assert indptr.tolist() == [0, 2, 3, 4]
    assert indices.tolist() == [1, 2, 0, 0]
    assert indices.dtype == np.int32
    indptr, indices = coo_to_csr([rows[:3], rows[3:]], [cols[:3], cols[3:]], 3, dedup=False)
    assert indptr[-1] == 7


def test_coo_to_csr_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        coo_to_csr([np.array([0, 5])], [np.array([1, 1])], 3)


def test_roundtrip_and_mmap(tmp_path):
    indptr = np.array([0, 1, 3, 3])
    indices = np.array([1, 0, 2], dtype=np.int32)
    feats = np.arange(6, dtype=np.float32).reshape(3, 2)
    write_dataset(tmp_path / "d", indptr=indptr, indices=indices, features=feats, labels=np.array([0, 1, 1]),
                  masks={"train_mask": np.array([True, False, True])})
    g = GraphStore.open(tmp_path / "d", validate="full")
    assert isinstance(g.features, np.memmap)
    assert (g.num_nodes, g.num_edges, g.feature_dim, g.num_classes) == (3, 3, 2, 2)
    assert g.degrees().tolist() == [1, 2, 0]
    assert g.describe()["isolated_nodes"] == 1
    assert len(g.fingerprint) == 16


def _write_bad(tmp_path, **override):
    arrays = dict(indptr=np.array([0, 1, 2]), indices=np.array([1, 0], dtype=np.int32),
                  features=np.zeros((2, 3), np.float32))
    root = tmp_path / "bad"
    write_dataset(root, **arrays)
    for name, value in override.items():
        np.save(root / f"{name}.npy", value)
    return root


@pytest.mark.parametrize("override, match", [
    ({"features": np.zeros((3, 3), np.float32)}, "features must be"),
    ({"features": np.zeros((2, 3), np.float64)}, "float32"),
    ({"indptr": np.array([0, 1, 5])}, "end at len"),
    ({"labels": np.zeros(5, np.int64)}, "labels must be"),
    ({"train_mask": np.zeros(2, np.int64)}, "train_mask must be bool"),
])
def test_validation_errors_are_clear(tmp_path, override, match):
    root = _write_bad(tmp_path, **override)
    with pytest.raises(DatasetError, match=match):
        GraphStore.open(root)


@pytest.mark.parametrize("validate", ["quick", "full"])
@pytest.mark.parametrize("override, match", [
    ({"indices": np.array([1, 7], dtype=np.int32)}, r"indices must lie in \[0, 2\), found \[1, 7\]"),
    ({"indices": np.array([-3, 0], dtype=np.int32)}, r"indices must lie in \[0, 2\), found \[-3, 0\]"),
    ({"indptr": np.array([0, 5, 2])}, "indptr must be non-decreasing; it falls at row 1"),
])
def test_every_open_catches_indices_the_samplers_would_read_outside_their_arrays(tmp_path, override, match,
                                                                                  validate):
    """The compiled samplers do not bounds-check: quick validation (what serve, train and
    precompute open with) let these through, and the first sample crashed the process."""
    root = _write_bad(tmp_path, **override)
    with pytest.raises(DatasetError, match=match):
        GraphStore.open(root, validate=validate)


@pytest.mark.parametrize("override, match", [
    ({"indptr": np.array([0, 1, 2], dtype=np.uint64)}, "indptr must be a signed integer array"),
    ({"indptr": np.array([0, 1, 2], dtype=">i8")}, "byte order"),
    ({"indptr": np.int64(0)}, r"indptr must be 1-D of length num_nodes\+1, got shape \(\)"),
    ({"labels": np.zeros(2, np.float32)}, "labels must be integer"),
])
def test_index_arrays_the_samplers_cannot_read_are_refused_at_open(tmp_path, override, match):
    root = _write_bad(tmp_path, **override)
    with pytest.raises(DatasetError, match=match):
        GraphStore.open(root)


@pytest.mark.parametrize("value", [None, [2], "two", 2.5, -2, float("nan")])
def test_a_meta_count_that_is_not_a_whole_number_is_one_dataset_error(tmp_path, value):
    import json

    root = _write_bad(tmp_path)
    meta = json.loads((root / "meta.json").read_text())
    (root / "meta.json").write_text(json.dumps({**meta, "num_nodes": value}))
    with pytest.raises(DatasetError, match="meta.json's num_nodes must be a whole number"):
        GraphStore.open(root)


@pytest.mark.parametrize("content", [b"", b"\x93NUMPY", b"garbage"])
def test_an_empty_or_damaged_array_file_is_one_dataset_error(tmp_path, content):
    root = _write_bad(tmp_path)
    (root / "indptr.npy").write_bytes(content)
    with pytest.raises(DatasetError, match="indptr.npy is not a readable .npy array"):
        GraphStore.open(root)


@pytest.mark.parametrize("ids, match", [
    (np.array([5, 5]), "distinct and in increasing order"),
    (np.array(["b", "a"]), "distinct and in increasing order"),
    (np.zeros((2, 1), np.int64), "must be 1-D"),
    (b"", "cannot read it"),
    (b"garbage", "it has no .npy header"),
])
def test_an_id_map_that_lookups_would_misread_is_refused(tmp_path, ids, match):
    root = _write_bad(tmp_path)
    if isinstance(ids, bytes):
        (root / "node_ids.npy").write_bytes(ids)
    else:
        np.save(root / "node_ids.npy", ids)
    with pytest.raises(DatasetError, match=match):
        GraphStore.open(root)


def test_missing_dataset(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        GraphStore.open(tmp_path / "nope")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "meta.json").write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        GraphStore.open(tmp_path / "x")


def test_powerlaw_is_skewed_symmetric_and_deduplicated(tmp_path):
    generate_powerlaw(tmp_path / "pl", num_nodes=5000, avg_degree=20, feature_dim=8, seed=3)
    g = GraphStore.open(tmp_path / "pl", validate="full")
    deg = g.degrees()
    assert 15 < deg.mean() <= 20
    assert deg.max() > 10 * deg.mean()  # heavy tail
    indices = np.asarray(g.indices)
    rows = np.repeat(np.arange(g.num_nodes), deg)
    assert not np.any(rows == indices)  # no self-loops
    pairs = set(zip(rows.tolist(), indices.tolist(), strict=True))
    assert len(pairs) == g.num_edges  # no duplicates
    assert all((c, r) in pairs for r, c in list(pairs)[:2000])  # symmetric
    assert g.features.shape == (5000, 8) and g.features.dtype == np.float32


def test_csbm_is_labelled_and_homophilous(tmp_path):
    generate_csbm(tmp_path / "c", num_nodes=4000, num_classes=4, feature_dim=8, homophily=0.8, seed=2)
    g = GraphStore.open(tmp_path / "c", validate="full")
    labels = np.asarray(g.labels)
    rows = np.repeat(np.arange(g.num_nodes), g.degrees())
    same = (labels[rows] == labels[np.asarray(g.indices)]).mean()
    assert same > 0.7  # far above the 0.25 of a random graph
    masks = g.masks
    total = masks["train_mask"].astype(int) + masks["val_mask"] + masks["test_mask"]
    assert np.all(total == 1)
    # Features carry the class: class means differ more than noise allows by chance.
    means = np.stack([np.asarray(g.features)[labels == c].mean(0) for c in range(4)])
    assert np.linalg.norm(means[0] - means[1]) > 0.2


def test_import_pyg_data(tmp_path):
    from torch_geometric.data import Data

    data = Data(x=torch.randn(4, 3), edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]), y=torch.tensor([0, 1, 0, 1]))
    torch.save(data, tmp_path / "g.pt")
    import_graph(tmp_path / "g.pt", tmp_path / "out")
    g = GraphStore.open(tmp_path / "out", validate="full")
    # PyG edge (s, t): t aggregates from s, so row t lists s.
    assert np.asarray(g.indices)[g.indptr[1]:g.indptr[2]].tolist() == [0]
    assert np.asarray(g.labels).tolist() == [0, 1, 0, 1]
    assert np.allclose(g.features, data.x.numpy())


def test_import_refuses_code_in_pickles(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"edge_index": Evil()}))
    with pytest.raises(DatasetError, match="weights_only"):
        import_graph(tmp_path / "evil.pt", tmp_path / "out")


def test_import_of_a_file_torch_did_not_write_says_so(tmp_path):
    """torch.load said "101" (a KeyError) of a text file, "Unsupported operand" of others."""
    for name, content in (("text.pt", b"hello world\n"), ("noise.pt", bytes(range(7, 107))), ("empty.pt", b"")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DatasetError, match="not a file torch.save wrote"):
            import_graph(tmp_path / name, tmp_path / "out")


def test_importing_ids_too_many_to_hold_is_one_dataset_error(tmp_path):
    """Dense ids up to 10**12 (or a Data's num_nodes of 10**12) asked for terabytes: a
    MemoryError traceback."""
    (tmp_path / "e.txt").write_text("0 1000000000000\n1 2\n")
    with pytest.raises(DatasetError, match="1,000,000,000,001 nodes do not fit in memory.*--ids map"):
        import_graph(tmp_path / "e.txt", tmp_path / "a", ids="dense")
    torch.save({"edge_index": torch.tensor([[0, 1], [1, 2]]), "num_nodes": 10**12}, tmp_path / "g.pt")
    with pytest.raises(DatasetError, match="nodes do not fit in memory"):
        import_graph(tmp_path / "g.pt", tmp_path / "b")


@pytest.mark.parametrize("fields, match", [
    ({"num_nodes": -5}, "num_nodes must be a whole number >= 0, got -5"),
    ({"num_nodes": "many"}, "num_nodes must be a whole number >= 0"),  # "invalid literal for int()"
    ({"x": "abc"}, "x must be a numeric array"),  # AttributeError traceback
    ({"x": torch.zeros(3, 2, dtype=torch.complex64)}, "x must be a numeric array"),  # imaginary parts dropped
    ({"x": torch.zeros(3, 2), "train_mask": torch.ones(7, dtype=torch.bool)}, "train_mask must have num_nodes=3"),
    ({"edge_index": torch.tensor([[0.0, 1.0], [1.0, 2.0]])},  # the file was not named
     r"g\.pt: edge_index must be an integer array \[2, E\], got float32 \[2, 2\]"),
    ({"edge_index": torch.tensor([[0, 1], [1, 5]]), "num_nodes": 3}, r"g\.pt: edge_index ids must lie in \[0, 3\)"),
])
def test_a_data_file_with_fields_of_the_wrong_kind_is_one_dataset_error_and_writes_nothing(tmp_path, fields, match):
    torch.save({"edge_index": torch.tensor([[0, 1], [1, 2]]), **fields}, tmp_path / "g.pt")
    with pytest.raises(DatasetError, match=match):
        import_graph(tmp_path / "g.pt", tmp_path / "out")
    assert not (tmp_path / "out" / "meta.json").exists()  # the mask was refused only once written


@pytest.mark.parametrize("y", [torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.25, 1.5, 2.0]),
                               torch.tensor([0, 1, 2**40]), torch.tensor([0, -5, 1])])
def test_a_y_that_is_not_class_numbers_is_skipped_not_cast(tmp_path, y, caplog):
    # cast to int64, NaN became -2**63 (and num_classes wrong) and 0.25 became class 0; a
    # label of 2**40 made num_classes 2**40 + 1, an output layer train could not allocate
    torch.save({"edge_index": torch.tensor([[0, 1], [1, 2]]), "x": torch.zeros(3, 2), "y": y}, tmp_path / "g.pt")
    import_graph(tmp_path / "g.pt", tmp_path / "out")
    g = GraphStore.open(tmp_path / "out")
    assert g.labels is None and g.meta["ignored_fields"] == ["y"] and "not class numbers" in caplog.text


def test_import_npz_and_edge_list(tmp_path):
    np.savez(tmp_path / "g.npz", src=np.array([0, 1]), dst=np.array([1, 2]))
    import_graph(tmp_path / "g.npz", tmp_path / "a", undirected=True, feature_dim=5)
    g = GraphStore.open(tmp_path / "a", validate="full")
    assert g.num_nodes == 3 and g.num_edges == 4 and g.feature_dim == 5
    (tmp_path / "e.txt").write_text("# src dst\n0 1\n1 2\n2 0\n")
    import_graph(tmp_path / "e.txt", tmp_path / "b")
    assert GraphStore.open(tmp_path / "b").num_edges == 3
    (tmp_path / "weighted.txt").write_text("0 1 0.5\n1 2 1e-3\n")  # a weight column: not served, not read
    import_graph(tmp_path / "weighted.txt", tmp_path / "w")
    weighted = GraphStore.open(tmp_path / "w")
    assert weighted.id_map is None and weighted.num_nodes == 3 and weighted.num_edges == 2
    (tmp_path / "bad.txt").write_text("0 1 2\n3\n")
    with pytest.raises(DatasetError, match="two columns") as info:
        import_graph(tmp_path / "bad.txt", tmp_path / "c")
    assert "usecols" not in str(info.value)  # numpy's advice names its own keyword, not a flag
    (tmp_path / "e.csv").write_text("0,1\n1,2\n")
    with pytest.raises(DatasetError, match="two columns 'src dst' separated by whitespace, found 1"):
        import_graph(tmp_path / "e.csv", tmp_path / "c")
    (tmp_path / "empty.txt").write_text("# only a comment\n")
    with pytest.raises(DatasetError, match="holds no edges"):
        import_graph(tmp_path / "empty.txt", tmp_path / "c")
    np.savez(tmp_path / "other.npz", foo=np.arange(3))
    with pytest.raises(DatasetError, match=r"has no edge_index \(or src and dst arrays\) \(it holds \['foo'\]\)"):
        import_graph(tmp_path / "other.npz", tmp_path / "c")
    np.savez(tmp_path / "neg.npz", edge_index=np.array([[0, -1], [1, 0]]))
    with pytest.raises(DatasetError, match="must lie in"):
        import_graph(tmp_path / "neg.npz", tmp_path / "d", ids="dense")
    with pytest.raises(DatasetError, match="ids must be one of"):
        import_graph(tmp_path / "neg.npz", tmp_path / "d", ids="sparse")


@pytest.mark.parametrize("lines, kind, external", [
    ("1 2\n2 3\n3 2000000\n", "int64", [1, 2, 3, 2000000]),  # sparse: not a 2,000,001-node graph
    ("# people\nalice bob\nbob carol\ndave alice\n", "string", ["alice", "bob", "carol", "dave"]),
    ("-5 7\n7 9\n", "int64", [-5, 7, 9]),
])
def test_sparse_and_named_ids_are_mapped_to_dense_ones(tmp_path, caplog, lines, kind, external):
    (tmp_path / "e.txt").write_text(lines)
    with caplog.at_level("WARNING"):
        import_graph(tmp_path / "e.txt", tmp_path / "g")
    g = GraphStore.open(tmp_path / "g", validate="full")
    assert g.num_nodes == len(external) and g.id_map.kind == kind and g.meta["id_map"] == kind
    assert g.id_map.to_external(np.arange(g.num_nodes)).tolist() == external
    internal, known = g.id_map.to_internal(np.array(external[::-1] + ([9999] if kind == "int64" else ["zed"])))
    assert internal[:-1].tolist() == list(range(len(external)))[::-1] and known.tolist() == [True] * len(external) + [False]
    # the first edge survives the mapping: row (its target) lists its source
    src, dst = lines.split("\n")[1 if lines.startswith("#") else 0].split()
    t = int(g.id_map.to_internal(np.array([dst if kind == "string" else int(dst)]))[0][0])
    s_ = int(g.id_map.to_internal(np.array([src if kind == "string" else int(src)]))[0][0])
    assert s_ in np.asarray(g.indices)[g.indptr[t]:g.indptr[t + 1]]
    assert sum("stored as dense ids" in r.getMessage() for r in caplog.records) == 1


def test_dense_ids_and_ids_with_features_are_kept(tmp_path, caplog):
    (tmp_path / "e.txt").write_text("0 1\n1 2\n3 0\n")
    import_graph(tmp_path / "e.txt", tmp_path / "g")
    assert GraphStore.open(tmp_path / "g").id_map is None
    # random features are said, not only recorded (a model trained on them learns structure alone)
    assert "holds no node features: each node gets 64 random ones" in caplog.text
    with pytest.raises(DatasetError, match="not integers"):
        (tmp_path / "n.txt").write_text("a b\n")
        import_graph(tmp_path / "n.txt", tmp_path / "h", ids="dense")
    # the example is an id that is not an integer (it was the first id, here '0')
    (tmp_path / "mixed.txt").write_text("0 1\n-2 +3\n1 carol\n")
    with pytest.raises(DatasetError, match=r"not integers \(e\.g\. 'carol'\)"):
        import_graph(tmp_path / "mixed.txt", tmp_path / "x", ids="dense")
    import_graph(tmp_path / "e.txt", tmp_path / "m", ids="map")
    assert GraphStore.open(tmp_path / "m").id_map.kind == "int64"


def test_multi_label_y_is_skipped_with_one_line(tmp_path, caplog):
    import torch
    from torch_geometric.data import Data

    torch.save(Data(edge_index=torch.tensor([[0, 1], [1, 2]]), x=torch.zeros(3, 2), y=torch.zeros(3, 4)),
               tmp_path / "d.pt")
    with caplog.at_level("WARNING"):
        import_graph(tmp_path / "d.pt", tmp_path / "g")
    g = GraphStore.open(tmp_path / "g")
    assert g.labels is None and g.meta["ignored_fields"] == ["y"]
    assert any("multi-label" in r.getMessage() for r in caplog.records)
    assert not any("do not read them" in r.getMessage() for r in caplog.records)  # one line, not two


def test_fields_the_models_do_not_read_are_named_not_dropped_silently(tmp_path, caplog):
    from torch_geometric.data import Data

    data = Data(x=torch.randn(3, 2), edge_index=torch.tensor([[0, 1], [1, 2]]), edge_attr=torch.randn(2, 4))
    torch.save(data, tmp_path / "g.pt")
    with caplog.at_level("WARNING"):
        out = import_graph(tmp_path / "g.pt", tmp_path / "out")
    assert "edge_attr" in caplog.text
    assert GraphStore.open(out).meta.get("ignored_fields", ["edge_attr"]) == ["edge_attr"]


@pytest.mark.parametrize("corrupt", [lambda b: b[:len(b) // 2], lambda b: b"PK\x03\x04garbage", lambda b: b""])
def test_an_unreadable_npz_is_refused_in_one_line(tmp_path, corrupt):
    np.savez(tmp_path / "g.npz", edge_index=np.array([[0, 1], [1, 2]]))
    (tmp_path / "bad.npz").write_bytes(corrupt((tmp_path / "g.npz").read_bytes()))
    with pytest.raises(DatasetError, match=r"bad\.npz: not a readable \.npz file"):
        import_graph(tmp_path / "bad.npz", tmp_path / "out")


@pytest.mark.parametrize("undirected", [False, True])
def test_repeated_edges_are_stored_once_counted_and_said(tmp_path, caplog, undirected):
    np.savez(tmp_path / "g.npz", edge_index=np.array([[0, 1, 1, 2, 0], [1, 2, 2, 0, 1]]))  # (1,2), (0,1) twice
    import_graph(tmp_path / "g.npz", tmp_path / "out", undirected=undirected, feature_dim=3)
    g = GraphStore.open(tmp_path / "out")
    assert g.meta["repeated_edges_merged"] == 2 and "2 of 5 edges repeat an earlier one" in caplog.text
    assert g.num_edges == (6 if undirected else 3)
    np.savez(tmp_path / "h.npz", edge_index=np.array([[0, 1], [1, 0]]))
    import_graph(tmp_path / "h.npz", tmp_path / "plain", undirected=True, feature_dim=3)  # both ways is no repeat
    assert "repeated_edges_merged" not in GraphStore.open(tmp_path / "plain").meta


def test_a_damaged_array_file_is_named_without_advice_to_unpickle_it(tmp_path):
    """A file that is not .npy at all (overwritten, damaged): numpy called it pickled data
    and advised loading it unsafely; the error says it has no .npy header."""
    np.savez(tmp_path / "g.npz", src=np.array([0, 1]), dst=np.array([1, 2]))
    import_graph(tmp_path / "g.npz", tmp_path / "d")
    (tmp_path / "d" / "indptr.npy").write_text("junk\n")
    with pytest.raises(DatasetError, match="indptr.npy is not a readable .npy array: it has no .npy header") as info:
        GraphStore.open(tmp_path / "d")
    assert "unsafely" not in str(info.value) and "pickle" not in str(info.value)


def test_the_fingerprint_covers_every_edge_not_a_sample(tmp_path):
    # one neighbour changed among 300,000 edges, at a place a 65,536-entry sample skips:
    # the old fingerprint stayed, and with it the old graph's tables and embeddings
    rng = np.random.default_rng(0)
    n, m = 1000, 300_000
    indptr = np.linspace(0, m, n + 1).astype(np.int64)
    indices = rng.integers(0, n, m).astype(np.int32)
    feats = np.zeros((n, 2), np.float32)
    a = GraphStore.open(write_dataset(tmp_path / "a", indptr=indptr, indices=indices, features=feats))
    changed = indices.copy()
    changed[1] = (changed[1] + 1) % n
    b = GraphStore.open(write_dataset(tmp_path / "b", indptr=indptr, indices=changed, features=feats))
    moved = indptr.copy()
    moved[1] += 1  # the same edges, one moved to the next row
    c = GraphStore.open(write_dataset(tmp_path / "c", indptr=moved, indices=indices, features=feats))
    same = GraphStore.open(write_dataset(tmp_path / "same", indptr=indptr, indices=indices, features=feats + 1))
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3 and same.fingerprint == a.fingerprint


@pytest.mark.parametrize("text, said", [
    ("# src dst\n0 1\n1 2\n\n2 3\n3 4 5\n", "the number of columns changed from 2 to 3 at line 6"),
    ("alice bob\n# a comment\nbob carol dave\n", "the number of columns changed from 2 to 3 at line 3"),
    ("0 1 0.5\n# weights\n1 2 0.5\nz\n", "line 4 has 1 column"),
])
def test_an_edge_list_whose_columns_change_names_the_file_s_line(tmp_path, text, said):
    """numpy's "at row 4" counted rows of data, not the file's lines (comments and blank
    lines left out): the user looked at the wrong line."""
    (tmp_path / "e.txt").write_text(text)
    with pytest.raises(DatasetError, match=f"e.txt: an edge list needs two columns 'src dst' per line: {said}$"):
        import_graph(tmp_path / "e.txt", tmp_path / "out")


def _npy_header_only(shape, descr="<i8") -> bytes:
    """A .npy whose header claims `shape` and that holds no data after it."""
    import struct
    header = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (descr, shape)
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()


@pytest.mark.parametrize("shape", [(2, 2**40), (2, 2**33), (2, 3)])
def test_an_npz_whose_header_claims_more_than_it_holds_is_refused_before_anything_is_allocated(tmp_path, shape):
    """numpy allocates what a member's header claims before reading it: a 200-byte .npz
    claiming 16 TiB was a MemoryError traceback, and one claiming less than the machine's
    memory took it before the read failed."""
    import zipfile
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w") as archive:
        archive.writestr("edge_index.npy", _npy_header_only(shape))
    with pytest.raises(DatasetError, match=r"bomb\.npz \(edge_index\.npy\): its header claims an array of shape "
                                           rf"\(2, {shape[1]}\) of int64 .* but the file holds 0 bytes"):
        import_graph(tmp_path / "bomb.npz", tmp_path / "out")


def test_unsigned_ids_past_int64_are_refused_not_wrapped_to_negative_ones(tmp_path):
    # 2**64 - 1 was cast to -1: stored in the id map, and answered, as node -1
    np.savez(tmp_path / "g.npz", edge_index=np.array([[0, 2**64 - 1], [1, 5]], dtype=np.uint64))
    with pytest.raises(DatasetError, match="node id 18446744073709551615 does not fit in int64"):
        import_graph(tmp_path / "g.npz", tmp_path / "out")
    np.savez(tmp_path / "ok.npz", edge_index=np.array([[0, 2**62], [1, 5]], dtype=np.uint64))
    g = GraphStore.open(import_graph(tmp_path / "ok.npz", tmp_path / "ok"))
    assert g.id_map.external.tolist() == [0, 1, 5, 2**62]


@pytest.mark.parametrize("x", [np.array([[0.0], [np.nan], [1.0]]), np.array([[0.0], [1.0], [1e300]]),
                               np.array([[0.0], [1.0], [-np.inf]], np.float32)])
def test_features_that_are_not_finite_as_float32_are_refused_naming_the_row(tmp_path, x):
    """Imported silently (1e300 became inf with a RuntimeWarning): every answer reading
    the row was NaN."""
    np.savez(tmp_path / "g.npz", edge_index=np.array([[0, 1], [1, 2]]), x=x)
    bad = 2 if x[1, 0] == 1.0 else 1
    with pytest.raises(DatasetError, match=rf"g\.npz: x: row {bad} is not finite as float32 .*1 of 3 rows"):
        import_graph(tmp_path / "g.npz", tmp_path / "out")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_npy_edge_index_imports_as_its_edge_list_does(tmp_path):
    """A .npy of PyG's edge_index [2, E] is an edge list (it was read as text: an error
    about UTF-8); any other shape is refused in one line saying what is expected."""
    (tmp_path / "e.txt").write_text("0 1\n1 2\n3 0\n")
    np.save(tmp_path / "e.npy", np.array([[0, 1, 3], [1, 2, 0]], dtype=np.int64))
    a = GraphStore.open(import_graph(tmp_path / "e.txt", tmp_path / "a", feature_dim=4))
    b = GraphStore.open(import_graph(tmp_path / "e.npy", tmp_path / "b", feature_dim=4))
    assert a.fingerprint == b.fingerprint
    np.save(tmp_path / "t.npy", np.array([[0, 1], [1, 2], [3, 0]], dtype=np.int64))
    with pytest.raises(DatasetError, match=r"t\.npy: a \.npy edge list must be an edge_index of shape \[2, E\], "
                                           r"got shape \[3, 2\]"):
        import_graph(tmp_path / "t.npy", tmp_path / "c")


def test_a_npy_or_npz_edge_index_that_cannot_be_imported_is_refused_saying_why(tmp_path):
    """A [3, E] or 1-D .npy was told "(an [E, 2] array: save its transpose)", which it is
    not; a float edge_index was refused without naming its file; and an empty [2, 0]
    .npy or .npz became a dataset of 0 nodes (an empty text list is refused), which only
    train, workload build or serve refused later."""
    for name, array in (("three.npy", np.zeros((3, 5), np.int64)), ("flat.npy", np.arange(6))):
        np.save(tmp_path / name, array)
        with pytest.raises(DatasetError, match=r"must be an edge_index of shape \[2, E\], got shape \[[0-9, ]+\]$"):
            import_graph(tmp_path / name, tmp_path / "c")
    np.save(tmp_path / "f.npy", np.array([[0.0, 1.0], [1.0, 2.0]]))
    with pytest.raises(DatasetError, match=r"f\.npy: edge_index must be an integer array \[2, E\], got float64 \[2, 2\]"):
        import_graph(tmp_path / "f.npy", tmp_path / "c")
    np.save(tmp_path / "empty.npy", np.zeros((2, 0), np.int64))
    np.savez(tmp_path / "empty.npz", edge_index=np.zeros((2, 0), np.int64))
    for name in ("empty.npy", "empty.npz"):
        with pytest.raises(DatasetError, match=rf"{name.replace('.', '[.]')} holds no edges \(and no nodes\)"):
            import_graph(tmp_path / name, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    # nodes without edges are a graph: x gives the rows
    np.savez(tmp_path / "rows.npz", edge_index=np.zeros((2, 0), np.int64), x=np.ones((3, 2), np.float32))
    assert GraphStore.open(import_graph(tmp_path / "rows.npz", tmp_path / "r")).num_nodes == 3
