"""Synthetic datasets: a skewed-degree power-law graph (Chung–Lu) and a labelled
contextual stochastic block model (CSBM). Both stream edges in chunks so that
products-scale graphs (2.4M nodes, ~124M directed edges) fit in a few GiB."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from hybridgnn.graph.csr import coo_to_csr
from hybridgnn.graph.store import write_dataset

CHUNK_EDGES = 1 << 22


def powerlaw_weights(num_nodes: int, exponent: float, max_degree: float, mean_degree: float) -> np.ndarray:
    """Expected degrees of a Chung–Lu graph: rank^(-1/(exponent-1)), capped at max_degree and
    rescaled so that they average mean_degree."""
    if exponent <= 1.0:
        raise ValueError(f"exponent must be > 1, got {exponent}")
    beta = 1.0 / (exponent - 1.0)
    w = np.arange(1, num_nodes + 1, dtype=np.float64) ** (-beta)
    target = mean_degree * num_nodes
    for _ in range(20):  # the cap moves mass; a few rescales converge
        w *= target / w.sum()
        np.minimum(w, max_degree, out=w)
        if abs(w.sum() - target) < 1e-6 * target:
            break
    return w


def _endpoint_sampler(weights: np.ndarray, perm: np.ndarray):
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]

    def draw(rng: np.random.Generator, count: int) -> np.ndarray:
        ranks = np.searchsorted(cdf, rng.random(count), side="right")
        np.minimum(ranks, len(cdf) - 1, out=ranks)
        return perm[ranks]

    return draw


def _write_features_gaussian(root: Path, num_nodes: int, dim: int, rng, means=None, labels=None, desc="features"):
    feats = np.lib.format.open_memmap(root / "features.npy", mode="w+", dtype=np.float32, shape=(num_nodes, dim))
    step = max(1, (1 << 24) // max(dim, 1))
    for start in tqdm(range(0, num_nodes, step), desc=desc, unit="chunk", leave=False):
        stop = min(num_nodes, start + step)
        block = rng.standard_normal((stop - start, dim), dtype=np.float32)
        if means is not None:
            block += means[labels[start:stop]]
        feats[start:stop] = block
    feats.flush()
    del feats


def _check_degree(num_nodes: int, avg_degree: float, feature_dim: int) -> None:
    """A simple graph holds at most num_nodes - 1 edges per node: asked for more, the
    generators drew num_nodes·avg_degree pairs (held in memory) for a target they never
    reach (100 nodes at --avg-degree 1e12 ran for days). And a node needs a feature: a
    dataset of 0-wide features was written, which no model can take."""
    if not 0 < avg_degree <= num_nodes - 1:  # NaN too
        raise ValueError(f"avg_degree must be within (0, num_nodes - 1 = {num_nodes - 1}], got {avg_degree}")
    if feature_dim < 1:
        raise ValueError(f"feature_dim must be >= 1, got {feature_dim}")


def _draw_chunks(num_nodes, draw_pairs, num_pairs, rng, bar):
    rows, cols = [], []
    idx_dtype = np.int32 if num_nodes < 2**31 - 1 else np.int64
    remaining = num_pairs
    while remaining > 0:
        count = min(CHUNK_EDGES, remaining)
        s, t = draw_pairs(rng, count)
        s = s.astype(idx_dtype, copy=False)
        t = t.astype(idx_dtype, copy=False)
        rows += [s, t]
        cols += [t, s]
        remaining -= count
        bar.update(count)
    return rows, cols


def _edges_to_dataset(num_nodes, draw_pairs, num_pairs, rng, desc, max_rounds: int = 4):
    """Draw undirected pairs chunk by chunk, store both directions and build a deduplicated
    CSR; top up with fresh pairs until within 1% of 2·num_pairs directed edges (skewed
    graphs repeat many hub pairs, so the first round falls short)."""
    target = 2 * num_pairs
    indptr = indices = None
    to_draw = num_pairs
    for _ in range(max_rounds):
        with tqdm(total=to_draw, desc=f"{desc}: edges", unit="pair", unit_scale=True) as bar:
            rows, cols = _draw_chunks(num_nodes, draw_pairs, to_draw, rng, bar)
        if indptr is not None:  # merge what we have with the new pairs
            rows.append(np.repeat(np.arange(num_nodes, dtype=indices.dtype), np.diff(indptr)))
            cols.append(indices)
        before = 0 if indptr is None else indices.shape[0]
        with tqdm(total=sum(r.shape[0] for r in rows), desc=f"{desc}: CSR", unit="edge", unit_scale=True) as bar:
            indptr, indices = coo_to_csr(rows, cols, num_nodes, dedup=True, drop_self_loops=True,
                                         progress=bar.update)
        del rows, cols
        have = indices.shape[0]
        if have >= 0.99 * target:
            break
        kept = max((have - before) / (2 * to_draw), 0.05)  # share of new pairs that were new edges
        to_draw = int((target - have) / 2 / kept) + 1
    return indptr, indices


def generate_powerlaw(
    path: str | Path,
    *,
    num_nodes: int = 100_000,
    avg_degree: float = 20.0,
    exponent: float = 2.1,
    max_degree: int | None = None,
    feature_dim: int = 100,
    seed: int = 0,
    name: str | None = None,
) -> Path:
    """A skewed-degree undirected graph stored as directed edges both ways, about
    num_nodes·avg_degree of them after removing repeated pairs and self-loops."""
    if num_nodes < 2:
        raise ValueError(f"num_nodes must be >= 2, got {num_nodes}")
    _check_degree(num_nodes, avg_degree, feature_dim)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cap = max_degree if max_degree is not None else max(avg_degree * 4, min(num_nodes / 50, 50_000))
    weights = powerlaw_weights(num_nodes, exponent, cap, avg_degree / 2)
    perm = rng.permutation(num_nodes).astype(np.int64)
    draw = _endpoint_sampler(weights, perm)
    num_pairs = int(round(num_nodes * avg_degree / 2))
    indptr, indices = _edges_to_dataset(
        num_nodes, lambda r, c: (draw(r, c), draw(r, c)), num_pairs, rng, "powerlaw"
    )
    _write_features_gaussian(root, num_nodes, feature_dim, rng)
    return write_dataset(
        root,
        indptr=indptr,
        indices=indices,
        features=None,
        name=name or root.name,
        extra={"generator": {"kind": "powerlaw", "num_nodes": num_nodes, "avg_degree": avg_degree,
                             "exponent": exponent, "max_degree": cap, "feature_dim": feature_dim, "seed": seed}},
    )


def generate_csbm(
    path: str | Path,
    *,
    num_nodes: int = 20_000,
    num_classes: int = 8,
    feature_dim: int = 64,
    avg_degree: float = 12.0,
    homophily: float = 0.7,
    feature_signal: float = 0.12,
    exponent: float = 2.5,
    train_frac: float = 0.6,
    val_frac: float = 0.2,
    seed: int = 0,
    name: str | None = None,
) -> Path:
    """Contextual SBM: class-correlated Gaussian features (mean per class, unit noise) and
    homophilous edges (a fraction `homophily` join nodes of one class), skewed degrees."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"homophily must be within [0, 1], got {homophily}")
    if not (0 < train_frac and 0 <= val_frac and train_frac + val_frac < 1):
        raise ValueError(f"need 0 < train_frac, 0 <= val_frac and train_frac + val_frac < 1, got {train_frac}, {val_frac}")
    if num_nodes < num_classes:
        raise ValueError(f"num_nodes ({num_nodes}) must be >= num_classes ({num_classes})")
    _check_degree(num_nodes, avg_degree, feature_dim)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_nodes)
    by_class = np.argsort(labels, kind="stable")
    class_start = np.searchsorted(labels[by_class], np.arange(num_classes + 1))
    weights = powerlaw_weights(num_nodes, exponent, max(avg_degree * 4, num_nodes / 20), avg_degree / 2)
    draw = _endpoint_sampler(weights, rng.permutation(num_nodes).astype(np.int64))

    def pairs(r: np.random.Generator, count: int):
        src = draw(r, count)
        dst = r.integers(0, num_nodes, count)
        same = r.random(count) < homophily
        cls = labels[src[same]]
        size = class_start[cls + 1] - class_start[cls]
        dst[same] = by_class[class_start[cls] + (r.random(same.sum()) * size).astype(np.int64)]
        return src, dst

    num_pairs = int(round(num_nodes * avg_degree / 2))
    indptr, indices = _edges_to_dataset(num_nodes, pairs, num_pairs, rng, "csbm")
    means = (rng.standard_normal((num_classes, feature_dim)) * feature_signal).astype(np.float32)
    _write_features_gaussian(root, num_nodes, feature_dim, rng, means=means, labels=labels)
    split = rng.random(num_nodes)
    masks = {
        "train_mask": split < train_frac,
        "val_mask": (split >= train_frac) & (split < train_frac + val_frac),
        "test_mask": split >= train_frac + val_frac,
    }
    return write_dataset(
        root,
        indptr=indptr,
        indices=indices,
        features=None,
        labels=labels,
        masks=masks,
        name=name or root.name,
        extra={"generator": {"kind": "csbm", "num_nodes": num_nodes, "num_classes": num_classes,
                             "feature_dim": feature_dim, "avg_degree": avg_degree, "homophily": homophily,
                             "feature_signal": feature_signal, "seed": seed}},
    )
