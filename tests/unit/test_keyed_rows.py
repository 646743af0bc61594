"""KeyedRows (a partition rank's adjacency, patched by graph updates) reads as a plain
dict of sorted rows after any sequence of rewrites, folded or not; and a graph-update
batch survives its trip through arrays (the rank link's form)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgnn.distributed.keyed_rows import KeyedRows, rewrite_rows
from hybridgnn.graph.dynamic import UpdateBatch

N = 40
pairs = st.lists(st.tuples(st.integers(0, N - 1), st.integers(0, N - 1)), max_size=30)


def _from(rows: dict[int, set]) -> KeyedRows:
    keys = np.array(sorted(k for k, v in rows.items() if v), dtype=np.int64)
    lens = np.array([len(rows[k]) for k in keys], dtype=np.int64)
    values = np.concatenate([sorted(rows[k]) for k in keys]).astype(np.int64) if len(keys) else np.empty(0, np.int64)
    return KeyedRows(keys, np.concatenate([[0], np.cumsum(lens)]), values)


def _reads_as(kr: KeyedRows, rows: dict[int, set]) -> None:
    ids = np.arange(N + 5, dtype=np.int64)[::-1]  # any order, unknown keys included
    lens, values = kr.rows(ids)
    at = 0
    for node, k in zip(ids, lens, strict=True):
        assert list(values[at:at + k]) == sorted(rows.get(int(node), set())), node
        at += k


@settings(max_examples=150, deadline=None)
@given(start=pairs, steps=st.lists(st.tuples(pairs, pairs), max_size=6), fold=st.booleans())
def test_rewrites_read_like_a_dict_of_sorted_rows(start, steps, fold):
    rows: dict[int, set] = {}
    for k, v in start:
        rows.setdefault(k, set()).add(v)
    kr = _from(rows)
    for add, remove in steps:
        present = {(k, v) for k, vs in rows.items() for v in vs}
        rm = sorted({p for p in remove if p in present})
        ad = sorted({p for p in add if p not in present})
        for k, v in rm:
            rows[k].discard(v)
        for k, v in ad:
            rows.setdefault(k, set()).add(v)
        a, r = np.array(ad, np.int64).reshape(-1, 2), np.array(rm, np.int64).reshape(-1, 2)
        rewrite_rows(kr, a[:, 0], a[:, 1], r[:, 0], r[:, 1], N)
        if fold:
            kr.compact()
        _reads_as(kr, rows)


def test_an_update_batch_round_trips_through_arrays():
    b = UpdateBatch(add_edges=np.array([[1, 2]]), add_node_features=np.ones((2, 3), np.float32),
                    update_ids=np.array([4]), update_features=np.zeros((1, 3), np.float32))
    back = UpdateBatch.from_arrays(b.arrays(3))
    np.testing.assert_array_equal(back.add_edges, b.add_edges)
    np.testing.assert_array_equal(back.add_node_features, b.add_node_features)
    assert back.remove_edges.shape == (0, 2) and back.num_updates == b.num_updates
    empty = UpdateBatch.from_arrays(UpdateBatch(remove_nodes=np.array([3])).arrays(3))
    assert empty.add_node_features is None and empty.update_features is None
    with pytest.raises(ValueError, match="six arrays"):
        UpdateBatch.from_arrays(b.arrays(3)[:5])
    with pytest.raises(ValueError, match="six arrays"):
        UpdateBatch.from_arrays([a.astype(np.float32) for a in b.arrays(3)])
