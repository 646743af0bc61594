"""Adjacency rows keyed by sorted global ids, with whole rows replaced by graph updates.

A partition rank keeps only the rows of some nodes (its own nodes' out-edges, or the
in-edges its own nodes send to any target), so its rows are keyed by global id instead
of indexed 0..n-1. The base is a compact CSR over sorted keys; an update writes a
node's complete new row to an append-only pool and records it in a sorted patch index,
which is looked up first. Past a pool as large as the base, the patches are folded into
a new base (compact). Reads are vectorised: one binary search per id and table.
"""

from __future__ import annotations

import numpy as np


def _find(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, found) of each id in sorted `keys`."""
    if len(keys) == 0:
        return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
    pos = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
    return pos, keys[pos] == ids


def _spans(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ranges start..start+len (vectorised)."""
    total = int(lens.sum())
    return np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(total, dtype=np.int64)


class KeyedRows:
    """Rows of a CSR whose row keys are sorted global ids; a key without a row reads as
    an empty row. Values are int64 global ids, each row sorted."""

    def __init__(self, keys: np.ndarray, indptr: np.ndarray, values: np.ndarray):
        self.keys = np.asarray(keys, dtype=np.int64)
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.int64)
        self._clear_patches()

    def _clear_patches(self) -> None:
        self.patched = np.empty(0, dtype=np.int64)  # sorted keys whose row lives in the pool
        self.patch_start = np.empty(0, dtype=np.int64)
        self.patch_len = np.empty(0, dtype=np.int64)
        self.pool = np.empty(0, dtype=np.int64)  # capacity doubles: appends copy O(pool) in all
        self.pool_used = 0

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, concatenated rows) of `ids`, in their order."""
        ids = np.asarray(ids, dtype=np.int64)
        lens = np.zeros(len(ids), dtype=np.int64)
        starts = np.zeros(len(ids), dtype=np.int64)
        from_pool = np.zeros(len(ids), dtype=bool)
        ppos, pfound = _find(self.patched, ids)
        if pfound.any():
            lens[pfound] = self.patch_len[ppos[pfound]]
            starts[pfound] = self.patch_start[ppos[pfound]]
            from_pool = pfound
        bpos, bfound = _find(self.keys, ids)
        bfound &= ~from_pool
        if bfound.any():
            at = bpos[bfound]
            starts[bfound] = self.indptr[at]
            lens[bfound] = self.indptr[at + 1] - self.indptr[at]
        out = np.empty(int(lens.sum()), dtype=np.int64)
        pool_rows = np.repeat(from_pool, lens)  # output positions, in order, that come from the pool
        out[~pool_rows] = self.values[_spans(starts[~from_pool], lens[~from_pool])]
        out[pool_rows] = self.pool[_spans(starts[from_pool], lens[from_pool])]
        return lens, out

    def set_rows(self, ids: np.ndarray, lens: np.ndarray, values: np.ndarray) -> None:
        """Replace the rows of `ids` (unique) with consecutive slices of `values`."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return
        lens = np.asarray(lens, dtype=np.int64)
        values = np.asarray(values, dtype=np.int64)
        starts = self.pool_used + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        need = self.pool_used + len(values)
        if need > len(self.pool):
            grown = np.empty(max(need, 2 * len(self.pool), 1024), dtype=np.int64)
            grown[: self.pool_used] = self.pool[: self.pool_used]
            self.pool = grown
        self.pool[self.pool_used:need] = values
        self.pool_used = need
        pos, found = _find(self.patched, ids)
        self.patch_start[pos[found]] = starts[found]
        self.patch_len[pos[found]] = lens[found]
        if (~found).any():
            keys = np.concatenate([self.patched, ids[~found]])
            order = np.argsort(keys, kind="stable")
            self.patched = keys[order]
            self.patch_start = np.concatenate([self.patch_start, starts[~found]])[order]
            self.patch_len = np.concatenate([self.patch_len, lens[~found]])[order]
        if self.pool_used > max(1 << 16, len(self.values)):
            self.compact()

    def compact(self) -> None:
        """Fold the patches into a new base (same rows; keys with empty rows dropped)."""
        keys = np.union1d(self.keys, self.patched)
        lens, values = self.rows(keys)
        keep = lens > 0
        self.keys = keys[keep]
        self.indptr = np.concatenate([[0], np.cumsum(lens[keep])]).astype(np.int64)
        self.values = values
        self._clear_patches()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.indptr, self.values, self.patched, self.patch_start,
                                      self.patch_len, self.pool))


def rewrite_rows(rows_of: KeyedRows, add_key: np.ndarray, add_value: np.ndarray, rm_key: np.ndarray,
                 rm_value: np.ndarray, num_nodes: int) -> None:
    """Add the (key, value) pairs `add_*` and drop `rm_*` (present) from their rows; rows
    stay sorted."""
    keys = np.unique(np.concatenate([add_key, rm_key]))
    if len(keys) == 0:
        return
    lens, vals = rows_of.rows(keys)
    pair = np.repeat(np.arange(len(keys), dtype=np.int64), lens) * num_nodes + vals
    if len(rm_key):
        pair = pair[~np.isin(pair, np.searchsorted(keys, rm_key) * num_nodes + rm_value)]
    if len(add_key):
        pair = np.concatenate([pair, np.searchsorted(keys, add_key) * num_nodes + add_value])
    pair.sort()
    rows_of.set_rows(keys, np.bincount(pair // num_nodes, minlength=len(keys)), pair % num_nodes)

