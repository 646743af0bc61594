"""Generated heterogeneous graphs with learnable structure (tests, examples, benchmarks).

recsys:   user -rates-> item (and item -rev_rates-> user). Users and items belong to
          communities; a user rates items of its own community more often, popular items
          more often (Zipf). Features are noisy community means, of different widths per
          type, so link scores and item classes are learnable.
academic: three types: author -writes-> paper, paper -cites-> paper, paper -has_topic->
          field, with reverses for the first and last. Paper labels are their field.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridgnn.graph.hetero_import import write_hetero_edges

HETERO_KINDS = ("recsys", "academic")


def _features(rng, groups: np.ndarray, num_groups: int, dim: int, signal: float) -> np.ndarray:
    means = rng.standard_normal((num_groups, dim)).astype(np.float32) * signal
    return (means[groups] + rng.standard_normal((groups.shape[0], dim), dtype=np.float32)).astype(np.float32)


def _pick(rng, count: int, groups_of_choosers: np.ndarray, members: list[np.ndarray], pool_size: int,
          weights: np.ndarray, affinity: float) -> np.ndarray:
    """For each chooser, `count` picks: its own group's members with probability affinity
    (popularity-weighted), otherwise anyone in the pool (popularity-weighted)."""
    n = groups_of_choosers.shape[0]
    total = n * count
    chooser = np.repeat(np.arange(n), count)
    out = np.empty(total, np.int64)
    own = rng.random(total) < affinity
    cdf_all = np.cumsum(weights) / weights.sum()
    out[~own] = np.minimum(np.searchsorted(cdf_all, rng.random(int((~own).sum()))), pool_size - 1)
    for g, mem in enumerate(members):  # one vectorised draw per group (a handful)
        sel = own & (groups_of_choosers[chooser] == g)
        if not mem.size:
            out[sel] = np.minimum(np.searchsorted(cdf_all, rng.random(int(sel.sum()))), pool_size - 1)
            continue
        cdf = np.cumsum(weights[mem]) / weights[mem].sum()
        out[sel] = mem[np.minimum(np.searchsorted(cdf, rng.random(int(sel.sum()))), mem.size - 1)]
    return np.stack([chooser, out])


def generate_hetero(out: str | Path, *, kind: str = "recsys", num_nodes: int = 2_000, avg_degree: float = 10.0,
                    num_groups: int = 5, seed: int = 0, name: str | None = None) -> Path:
    """Write a generated heterogeneous dataset; num_nodes is the size of the largest type."""
    if kind not in HETERO_KINDS:
        raise ValueError(f"kind must be one of {HETERO_KINDS}, got {kind!r}")
    # avg_degree past the nodes there are drew num_nodes·avg_degree edges all the same;
    # num_groups 0 failed inside numpy ("high <= 0")
    if num_groups < 1 or num_nodes < 2 * num_groups or not 0 < avg_degree <= num_nodes - 1:
        raise ValueError(f"need num_groups >= 1, num_nodes >= 2 * num_groups and 0 < avg_degree <= num_nodes - 1, "
                         f"got {num_groups}, {num_nodes} and {avg_degree}")
    rng = np.random.default_rng(seed)
    deg = max(1, round(avg_degree))
    if kind == "recsys":
        users, items = num_nodes, max(num_groups, num_nodes // 2)
        ug, ig = rng.integers(0, num_groups, users), rng.integers(0, num_groups, items)
        popularity = 1.0 / np.arange(1, items + 1) ** 0.8
        rates = _pick(rng, deg, ug, [np.flatnonzero(ig == g) for g in range(num_groups)], items, popularity, 0.8)
        nodes = {"user": {"features": _features(rng, ug, num_groups, 16, 1.0)},
                 "item": {"features": _features(rng, ig, num_groups, 24, 1.0), "labels": ig}}
        edges = {("user", "rates", "item"): rates}
    else:
        papers, authors, fields = num_nodes, max(num_groups, num_nodes // 2), num_groups
        pg, ag = rng.integers(0, num_groups, papers), rng.integers(0, num_groups, authors)
        members = [np.flatnonzero(pg == g) for g in range(num_groups)]
        citations = _pick(rng, deg, pg, members, papers, 1.0 / np.arange(1, papers + 1) ** 0.6, 0.7)
        writes = _pick(rng, max(1, deg // 2), ag, members, papers, np.ones(papers), 0.9)
        topics = np.stack([np.arange(papers), pg])
        nodes = {"paper": {"features": _features(rng, pg, num_groups, 32, 0.8), "labels": pg},
                 "author": {"features": _features(rng, ag, num_groups, 8, 0.8)},
                 "field": {"features": np.eye(fields, 4 + fields, dtype=np.float32)}}
        edges = {("author", "writes", "paper"): writes, ("paper", "cites", "paper"): citations[::-1].copy(),
                 ("paper", "has_topic", "field"): topics}
    return write_hetero_edges(out, nodes, edges, undirected=True, name=name or Path(out).name,
                  extra={"generator": {"kind": kind, "num_nodes": num_nodes, "avg_degree": avg_degree,
                                       "num_groups": num_groups, "seed": seed}})
