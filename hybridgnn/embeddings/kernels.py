"""Compiled loops of incremental maintenance (numba, one core each: an update batch is
applied by one thread while the others serve)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def spread_rows(lens: np.ndarray, outs: np.ndarray, delta: np.ndarray, agg: np.ndarray) -> None:
    """agg[v] += delta[u] for every out-edge (u, v) of row u: outs holds row 0's targets
    (lens[0] of them), then row 1's, ... No [edges, dim] intermediate, no sort."""
    e = 0
    dim = delta.shape[1]
    for u in range(lens.shape[0]):
        for _ in range(lens[u]):
            v = outs[e]
            for k in range(dim):
                agg[v, k] += delta[u, k]
            e += 1


@numba.njit(nogil=True, cache=True)
def mark_unique(ids: np.ndarray, mark: np.ndarray) -> np.ndarray:
    """The distinct values of ids in first-seen order; mark (all False, len > max id) is
    left all False again."""
    out = np.empty(ids.shape[0], dtype=np.int64)
    count = 0
    for v in ids:
        if not mark[v]:
            mark[v] = True
            out[count] = v
            count += 1
    for j in range(count):
        mark[out[j]] = False
    return out[:count]
