"""The heterogeneous store and its importers: HeteroData files, edge lists per edge type."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import HeteroData

from hybridgnn.graph.hetero import HeteroGraphStore, open_any
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.graph.hetero_import import reverse_edge_types, write_hetero_edges
from hybridgnn.graph.importers import import_graph
from hybridgnn.graph.store import DatasetError, GraphStore


def small_hetero() -> HeteroData:
    data = HeteroData()
    data["user"].x = torch.randn(5, 3)
    data["item"].x = torch.randn(4, 2)
    data["item"].y = torch.tensor([0, 1, 1, 0])
    data["user", "rates", "item"].edge_index = torch.tensor([[0, 1, 2, 2, 2], [0, 0, 3, 3, 1]])
    data["user", "rates", "item"].edge_label_index = torch.tensor([[0], [1]])
    return data


def neighbours(store, etype, v):
    d = store.edges[etype]
    return np.asarray(d.indices[d.indptr[v]:d.indptr[v + 1]]).tolist()


def test_hetero_data_round_trip_keeps_types_rows_and_edges(tmp_path, caplog):
    data = small_hetero()
    torch.save(data, tmp_path / "g.pt")
    with caplog.at_level("WARNING"):
        import_graph(tmp_path / "g.pt", tmp_path / "d")
    g = open_any(tmp_path / "d", validate="full")
    assert isinstance(g, HeteroGraphStore)
    assert g.metadata() == (["user", "item"], [("user", "rates", "item")])
    np.testing.assert_array_equal(g.nodes["user"].features, data["user"].x.numpy())
    np.testing.assert_array_equal(g.nodes["item"].features, data["item"].x.numpy())
    assert g.nodes["item"].labels.tolist() == [0, 1, 1, 0] and g.nodes["user"].labels is None
    rates = ("user", "rates", "item")
    # row = target item, listing the users it aggregates from, deduplicated and sorted
    assert [neighbours(g, rates, v) for v in range(4)] == [[0, 1], [2], [], [2]]
    assert g.meta["ignored_fields"] == ["user__rates__item.edge_label_index"]
    assert any("edge_label_index" in r.getMessage() for r in caplog.records)
    described = g.describe()
    assert described["kind"] == "hetero" and described["edge_types"]["user__rates__item"]["num_edges"] == 4


def test_undirected_adds_reverse_types_as_pyg_to_undirected(tmp_path):
    torch.save(small_hetero(), tmp_path / "g.pt")
    import_graph(tmp_path / "g.pt", tmp_path / "d", undirected=True)
    g = HeteroGraphStore.open(tmp_path / "d")
    rev = ("item", "rev_rates", "user")
    assert g.edge_types == [("user", "rates", "item"), rev]
    assert [neighbours(g, rev, u) for u in range(5)] == [[0], [0], [1, 3], [], []]
    # a type that is already the reverse of another gains no rev_rev_ type
    twice = reverse_edge_types(reverse_edge_types({("a", "r", "b"): np.zeros((2, 1), np.int64)}))
    assert sorted(twice) == [("a", "r", "b"), ("b", "rev_r", "a")]


def test_type_names_pyg_allows_are_stored_as_they_are(tmp_path):
    nodes = {"user account": {"features": np.zeros((2, 1), np.float32)},
             "x__y": {"features": np.zeros((3, 2), np.float32)}}
    write_hetero_edges(tmp_path / "d", nodes, {("user account", "has a", "x__y"): np.array([[0, 1], [2, 2]])})
    g = HeteroGraphStore.open(tmp_path / "d", validate="full")
    assert g.edge_types == [("user account", "has a", "x__y")] and g.num_nodes("x__y") == 3


def test_edge_list_directory_maps_named_ids_per_type(tmp_path):
    src = tmp_path / "lists"
    src.mkdir()
    (src / "user__rates__item.txt").write_text("# user item\nalice i9\nbob i9\nalice i2\n")
    (src / "item__in__shelf.txt").write_text("i2 0\ni9 1\ni9 0\n")  # names and integers in one file
    np.save(src / "shelf.x.npy", np.ones((2, 5), np.float32))
    import_graph(src, tmp_path / "d")
    g = HeteroGraphStore.open(tmp_path / "d", validate="full")
    assert set(g.node_types) == {"user", "item", "shelf"}
    assert g.nodes["user"].id_map is not None and g.nodes["user"].id_map.external.tolist() == ["alice", "bob"]
    assert g.nodes["item"].id_map.external.tolist() == ["i2", "i9"]
    assert g.nodes["shelf"].id_map is None and g.nodes["shelf"].feature_dim == 5
    # item i9 (internal 1) aggregates from alice (0) and bob (1)
    assert neighbours(g, ("user", "rates", "item"), 1) == [0, 1]
    assert neighbours(g, ("item", "in", "shelf"), 0) == [0, 1] and neighbours(g, ("item", "in", "shelf"), 1) == [1]
    assert sorted(g.meta["random_features"]) == ["item", "user"]


@pytest.mark.parametrize("files, message", [
    ({"a__b.txt": "0 1\n"}, "<src>__<rel>__<dst>"),
    ({"notes.txt": "hello\n"}, "holds no edge files"),
    ({"a__r__b.txt": "0 1 2\nx\n"}, "two columns"),
])
def test_bad_edge_list_directories_are_named(tmp_path, files, message):
    src = tmp_path / "lists"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_text(text)
    with pytest.raises(DatasetError, match=message) as info:
        import_graph(src, tmp_path / "d")
    assert "\n" not in str(info.value)


def test_a_node_type_too_large_to_hold_or_with_non_numeric_rows_is_one_dataset_error(tmp_path):
    data = small_hetero()
    del data["user"].x
    data["user"].num_nodes = 10**12  # random features asked for terabytes: a MemoryError traceback
    torch.save(data, tmp_path / "g.pt")
    with pytest.raises(DatasetError, match="random features for 1,000,000,000,000 nodes"):
        import_graph(tmp_path / "g.pt", tmp_path / "d")
    data = small_hetero()
    data["user"].x = torch.zeros(data["user"].x.shape, dtype=torch.complex64)  # cast dropping the imaginary part
    torch.save(data, tmp_path / "g.pt")
    with pytest.raises(DatasetError, match="x of node type 'user' must be a numeric array"):
        import_graph(tmp_path / "g.pt", tmp_path / "d")


def test_edge_ids_outside_a_type_are_refused(tmp_path):
    data = small_hetero()
    data["user", "rates", "item"].edge_index = torch.tensor([[0], [7]])
    torch.save(data, tmp_path / "g.pt")
    with pytest.raises(DatasetError, match=r"user__rates__item.*item ids must lie in \[0, 4\)"):
        import_graph(tmp_path / "g.pt", tmp_path / "d")


def test_homogeneous_opener_refuses_a_hetero_dataset_in_one_line(tmp_path):
    generate_hetero(tmp_path / "h", num_nodes=40, avg_degree=3)
    with pytest.raises(DatasetError, match="heterogeneous") as info:
        GraphStore.open(tmp_path / "h")
    assert "\n" not in str(info.value)
    with pytest.raises(DatasetError, match="homogeneous"):
        HeteroGraphStore.open(tmp_path / "missing")  # no meta.json: named, not a traceback


def test_validation_names_the_broken_edge_type(tmp_path):
    generate_hetero(tmp_path / "h", num_nodes=40, avg_degree=3)
    meta = json.loads((tmp_path / "h" / "meta.json").read_text())
    j = [e["type"] for e in meta["edge_types"]].index(["user", "rates", "item"])
    indices = np.load(tmp_path / "h" / "edges" / str(j) / "indices.npy")
    indices[0] = 10_000
    np.save(tmp_path / "h" / "edges" / str(j) / "indices.npy", indices)
    # quick validation too (what serving opens with): the typed sampler reads rows without
    # bounds checks, so an index outside its source type would read past its arrays
    for validate in ("quick", "full"):
        with pytest.raises(DatasetError, match=r"user__rates__item.*\[0, 40\)"):
            HeteroGraphStore.open(tmp_path / "h", validate=validate)
    indices[0] = 0
    np.save(tmp_path / "h" / "edges" / str(j) / "indices.npy", indices)
    indptr = np.load(tmp_path / "h" / "edges" / str(j) / "indptr.npy")
    np.save(tmp_path / "h" / "edges" / str(j) / "indptr.npy", indptr.astype(np.uint64))
    with pytest.raises(DatasetError, match=r"user__rates__item.*indptr must be signed integer"):
        HeteroGraphStore.open(tmp_path / "h")


@pytest.mark.parametrize("kind, types", [("recsys", 2), ("academic", 3)])
def test_generated_graphs_have_every_type_and_reverse_edges(tmp_path, kind, types):
    g = HeteroGraphStore.open(generate_hetero(tmp_path / kind, kind=kind, num_nodes=200), validate="full")
    assert len(g.node_types) == types
    for s, rel, d in g.edge_types:
        assert (d, f"rev_{rel}", s) in g.edges or (d, rel[4:], s) in g.edges or s == d
    assert len({n.feature_dim for n in g.nodes.values()}) == types  # widths differ per type


@pytest.mark.parametrize("ids", ["auto", "map"])
def test_named_ids_with_a_feature_file_say_what_to_do(tmp_path, ids):
    """Names in an edge list and a <type>.x.npy beside it: the message once advised --ids
    map, which is refused the same way (rows are numbered by id)."""
    src = tmp_path / "lists"
    src.mkdir()
    (src / "user__rates__item.txt").write_text("alice 0\nbob 1\n")
    np.save(src / "user.x.npy", np.zeros((2, 3), np.float32))
    with pytest.raises(DatasetError, match=r"rows of user.x.npy cannot be matched to them") as info:
        import_graph(src, tmp_path / "d", ids=ids)
    assert "--ids map" not in str(info.value)
    with pytest.raises(DatasetError, match=r"--ids dense keeps integer ids"):
        (src / "user.x.npy").unlink()
        import_graph(src, tmp_path / "d", ids="dense")


def test_the_hetero_fingerprint_covers_row_splits_and_type_names(tmp_path):
    from hybridgnn.graph.hetero import write_hetero_dataset

    def fingerprint(name, indptr, types=("user", "item")):
        nodes = {types[0]: {"features": np.zeros((3, 2), np.float32)},
                 types[1]: {"features": np.zeros((3, 2), np.float32)}}
        edges = {(types[0], "rates", types[1]): (np.asarray(indptr), np.array([0, 1, 2], np.int64))}
        return HeteroGraphStore.open(write_hetero_dataset(tmp_path / name, nodes=nodes, edges=edges)).fingerprint

    base = fingerprint("a", [0, 1, 2, 3])
    assert fingerprint("again", [0, 1, 2, 3]) == base
    assert fingerprint("split", [0, 2, 2, 3]) != base  # the same sources, other targets
    assert fingerprint("named", [0, 1, 2, 3], ("person", "item")) != base


def _lists_with(tmp_path, **arrays) -> Path:
    src = tmp_path / "lists"
    src.mkdir()
    (src / "user__rates__item.txt").write_text("0 1\n1 2\n")
    for name, value in arrays.items():
        if isinstance(value, str):  # a header claiming 16 TiB, and no data
            header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 4), }"
            header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
            (src / f"{name}.npy").write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        else:
            np.save(src / f"{name}.npy", value)
    return src


@pytest.mark.parametrize("arrays, match", [
    # numpy allocated the 16 TiB the header claimed: a MemoryError traceback
    ({"user.x": "header only"}, r"user\.x\.npy: its header claims an array of shape \(1099511627776, 4\)"),
    ({"user.x": np.float32(3)}, r"user\.x\.npy: features must be 2-D \[N, F\], got shape \(\)"),  # IndexError
    ({"user.x": np.array([["a"], ["b"]])}, r"user\.x\.npy must be numbers"),  # unnamed "could not convert"
    ({"user.x": np.array([[0.0], [np.nan]], np.float32)}, r"user\.x\.npy: row 1 is not finite as float32"),
    ({"user.x": np.array([[0.0], [1e300]])}, r"user\.x\.npy: row 1 is not finite as float32"),
])
def test_a_node_types_feature_file_that_cannot_be_served_is_refused_naming_it(tmp_path, arrays, match):
    with pytest.raises(DatasetError, match=match):
        import_graph(_lists_with(tmp_path, **arrays), tmp_path / "d")


@pytest.mark.parametrize("y", [np.array([np.nan, 1.0]), np.array([0.5, 1.0]), np.array(["a", "b"])])
def test_a_node_types_labels_that_are_not_class_numbers_are_skipped_not_cast(tmp_path, y, caplog):
    # cast to int64, NaN became -2**63 and 0.5 became class 0; names were an unnamed ValueError
    import_graph(_lists_with(tmp_path, **{"user.y": y}), tmp_path / "d")
    g = HeteroGraphStore.open(tmp_path / "d")
    assert g.nodes["user"].labels is None and g.meta["ignored_fields"] == ["user.y"]
    assert "not class numbers" in caplog.text


def test_ids_past_int64_in_an_edge_list_directory_are_names_or_refused(tmp_path):
    src = _lists_with(tmp_path)
    (src / "user__rates__item.txt").write_text("0 1\n18446744073709551615 2\n")  # an OverflowError traceback
    g = HeteroGraphStore.open(import_graph(src, tmp_path / "d"))
    assert g.nodes["user"].id_map.external.tolist() == ["0", "18446744073709551615"]
    (src / "user__rates__item.txt").unlink()
    np.savez(src / "user__rates__item.npz", edge_index=np.array([[0, 2**64 - 1], [1, 2]], dtype=np.uint64))
    with pytest.raises(DatasetError, match="node id 18446744073709551615 does not fit in int64"):
        import_graph(src, tmp_path / "e")
