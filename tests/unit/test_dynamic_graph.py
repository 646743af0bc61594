"""DynamicGraph against a plain set-of-edges reference over random batches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hybridgnn.graph.dynamic import DynamicGraph, RWLock, UpdateBatch, UpdateError
from tests.support.graphs import make_graph, skewed_edges


def _edges(dyn: DynamicGraph) -> set[tuple[int, int]]:
    indptr, indices = dyn.to_csr()
    dst = np.repeat(np.arange(dyn.num_nodes), np.diff(indptr))
    return set(zip(indices.tolist(), dst.tolist(), strict=True))


def _reverse(dyn: DynamicGraph) -> set[tuple[int, int]]:
    lens, outs = dyn.out_neighbours(np.arange(dyn.num_nodes))
    src = np.repeat(np.arange(dyn.num_nodes), lens)
    return set(zip(src.tolist(), outs.tolist(), strict=True))


def test_random_batches_match_a_reference(tmp_path):
    g = make_graph(tmp_path / "g", skewed_edges(), 60)
    dyn = DynamicGraph(g)
    edges, alive, n = _edges(dyn), set(range(60)), 60
    rng = np.random.default_rng(0)
    for step in range(120):
        live = sorted(alive)
        e = sorted(edges)
        rm = [e[i] for i in rng.choice(len(e), size=min(3, len(e)), replace=False)]
        add = set()
        while len(add) < 3:
            s, t = (int(x) for x in rng.choice(live, 2))
            if (s, t) not in edges:
                add.add((s, t))
        rm_nodes = []
        if step % 17 == 0:
            x = int(rng.choice(live))
            rm_nodes = [x]
            rm = [p for p in rm if x not in p]
            add = {p for p in add if x not in p}
        new = 1 if step % 11 == 0 else 0
        if new:
            add.add((int(rng.choice([v for v in live if v not in rm_nodes])), n))
        feats = np.full((new, g.feature_dim), step, np.float32)
        with dyn.lock.write():
            up = dyn.apply(UpdateBatch(add_edges=np.array(sorted(add)).reshape(-1, 2),
                                       remove_edges=np.array(rm, dtype=np.int64).reshape(-1, 2),
                                       remove_nodes=np.array(rm_nodes, dtype=np.int64),
                                       add_node_features=feats if new else None))
        for p in rm:
            edges.discard(p)
        for x in rm_nodes:
            edges = {p for p in edges if x not in p}
            alive.discard(x)
        edges |= add
        if new:
            assert up.new_nodes.tolist() == [n]
            assert (dyn.features(np.array([n])) == step).all()
            alive.add(n)
            n += 1
        if step % 40 == 0:
            assert dyn.compact()
        assert _edges(dyn) == edges and _reverse(dyn) == edges, step
    assert dyn.num_nodes == n and dyn.num_edges == len(edges)


def test_feature_updates_and_errors(tmp_path):
    g = make_graph(tmp_path / "g", skewed_edges(), 60, feature_dim=4)
    dyn = DynamicGraph(g)
    with dyn.lock.write():
        dyn.apply(UpdateBatch(update_ids=np.array([3, 9]), update_features=np.ones((2, 4), np.float32)))
    assert (dyn.features(np.array([3, 9])) == 1).all()
    assert np.array_equal(dyn.features(np.array([4])), np.asarray(g.features[[4]]))
    for bad, match in [(UpdateBatch(update_ids=np.array([3, 3]), update_features=np.ones((2, 4), np.float32)), "twice"),
                       (UpdateBatch(remove_nodes=np.array([61])), "unknown node 61"),
                       (UpdateBatch(add_edges=np.zeros((2, 3), np.int64)), r"\[count, 2\]")]:
        with pytest.raises(UpdateError, match=match), dyn.lock.write():
            dyn.apply(bad)
    with dyn.lock.write():
        dyn.apply(UpdateBatch(remove_nodes=np.array([5])))
    with pytest.raises(UpdateError, match="unknown node 5"), dyn.lock.write():
        dyn.apply(UpdateBatch(update_ids=np.array([5]), update_features=np.ones((1, 4), np.float32)))


def test_rwlock_writer_excludes_readers():
    lock, log = RWLock(), []
    with lock.read():
        t = threading.Thread(target=lambda: (lock.write().__enter__(), log.append("w")))
        t.start()
        t.join(0.2)  # the writer cannot enter while a reader holds the lock
        assert t.is_alive() and not log
    t.join(5)
    assert log == ["w"]
