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


def _state(dyn: DynamicGraph) -> list:
    """What a reader or the next batch can see of the graph, as bytes."""
    n = dyn.num_nodes
    indptr, indices = dyn.to_csr()
    rev_indptr, rev_indices = dyn.rev.to_csr()
    return [n, dyn.version, dyn.updates_applied, indptr.tobytes(), indices.tobytes(), rev_indptr.tobytes(),
            rev_indices.tobytes(), dyn.features(np.arange(n)).tobytes(), dyn.alive[:n].tobytes(),
            dyn.self_loop[:n].tobytes(), dyn.in_degree(np.arange(n)).tobytes()]


def _rollback_graph(path, spare: bool) -> DynamicGraph:
    """A graph with patched rows, a patched feature row and a self-loop on node 9; with
    `spare`, a node was added too, so its arrays have room and the next batch writes in place."""
    dyn = DynamicGraph(make_graph(path, skewed_edges(), 60))
    assert not dyn.has_edges(np.array([9, 10]), np.array([9, 10])).any()
    with dyn.lock.write():
        dyn.apply(UpdateBatch(add_edges=np.array([[9, 9], [1, 2], [2, 1]]), update_ids=np.array([4]),
                              update_features=np.full((1, 4), 3, np.float32),
                              add_node_features=np.ones((1, 4), np.float32) if spare else None))
    return dyn


@pytest.mark.parametrize("spare", [True, False])
def test_a_failure_at_any_step_rolls_the_graph_back_whether_or_not_its_arrays_grew(spare, tmp_path):
    """Rolling back restores the rows a batch wrote in place (alive, self-loop, feature
    slots and pool, patched-row slots), not only the arrays that growth replaced: a node the
    batch removed is alive again, the batch's self-loops are undone, and the next batch
    applies as on a graph the failed one never touched."""
    from hybridgnn.graph import journal as journal_mod
    from hybridgnn.graph.journal import Journal

    class Injected(RuntimeError):
        pass

    def failing(dyn):
        n = dyn.num_nodes
        src = int(dyn.in_neighbours(np.array([12]))[1][0])
        return UpdateBatch(add_node_features=np.full((2, 4), 5, np.float32),
                           add_edges=np.array([[n, 3], [10, 10], [n + 1, n], [n, n]]),
                           remove_edges=np.array([[9, 9], [src, 12]]), remove_nodes=np.array([30]),
                           update_ids=np.array([4, 6, n + 1]), update_features=np.full((3, 4), 8, np.float32))

    def follow_up(dyn):  # a new node without a self-loop, reading node 30; node 9 keeps its loop
        n = dyn.num_nodes
        return UpdateBatch(add_node_features=np.full((1, 4), 2, np.float32), add_edges=np.array([[30, n]]))

    steps: list[str] = []
    dyn = _rollback_graph(tmp_path / "steps", spare)
    journal_mod.FAULT = steps.append
    try:
        with dyn.lock.write():
            dyn.apply(failing(dyn))
    finally:
        journal_mod.FAULT = None
    ref = _rollback_graph(tmp_path / "ref", spare)
    with ref.lock.write():
        ref.apply(follow_up(ref))
    want_after = _state(ref)
    assert len(steps) >= 5, steps
    for k, step in enumerate(steps):
        dyn = _rollback_graph(tmp_path / f"k{k}", spare)
        before = _state(dyn)
        calls = iter(range(len(steps) + 1))

        def fail(at, k=k, calls=calls):
            if next(calls) == k:
                raise Injected(at)

        j = Journal()
        journal_mod.FAULT = fail
        try:
            with pytest.raises(Injected), dyn.lock.write():
                try:
                    dyn.apply(failing(dyn), j)
                except Injected:
                    j.rollback()
                    raise
        finally:
            journal_mod.FAULT = None
        assert _state(dyn) == before, f"state changed by a failure at {step!r}"
        with dyn.lock.write():
            dyn.apply(follow_up(dyn))
        assert _state(dyn) == want_after, f"the batch after a failure at {step!r} saw its leftovers"
        assert dyn.self_loop[dyn.num_nodes - 1] == False and dyn.self_loop[9] and not dyn.self_loop[10]  # noqa: E712


@pytest.mark.parametrize("bad, match", [
    # remove_nodes names existing nodes only: not one this batch adds
    (UpdateBatch(add_node_features=np.ones((1, 4), np.float32), remove_nodes=np.array([60])), "unknown node 60"),
    (UpdateBatch(remove_nodes=np.array([5, 5])), "remove_nodes names a node twice"),
    (UpdateBatch(remove_nodes=np.array([5]), update_ids=np.array([5]), update_features=np.ones((1, 4), np.float32)),
     "update_features names a node this batch removes"),
    (UpdateBatch(remove_nodes=np.array([5]), remove_edges=np.array([[5, 5]])), "remove_edges names a node this batch removes"),
    (UpdateBatch(update_ids=np.array([3, 4]), update_features=np.ones((1, 4), np.float32)), r"must be \[2, 4\], got \[1, 4\]"),
    (UpdateBatch(add_node_features=np.ones((2, 5), np.float32)), r"new node features must be \[count, 4\]"),
])
def test_batches_that_cannot_apply_are_refused_before_anything_changes(bad, match, tmp_path):
    dyn = DynamicGraph(make_graph(tmp_path / "g", skewed_edges(), 60))
    before = _state(dyn)
    with pytest.raises(UpdateError, match=match), dyn.lock.write():
        dyn.apply(bad)
    assert _state(dyn) == before


def test_a_new_node_updated_in_its_own_batch_takes_the_update_and_counts_every_update(tmp_path):
    """update_features may name the first node the batch adds (id num_nodes) as well as
    later ones; updates_applied grows by every addition, removal and feature update."""
    dyn = DynamicGraph(make_graph(tmp_path / "g", skewed_edges(), 60))
    with dyn.lock.write():
        up = dyn.apply(UpdateBatch(add_node_features=np.ones((2, 4), np.float32), add_edges=np.array([[60, 3], [1, 61]]),
                                   update_ids=np.array([60, 8]), update_features=np.array([[7] * 4, [9] * 4], np.float32)))
    assert up.new_nodes.tolist() == [60, 61]
    assert dyn.features(np.array([60, 61, 8])).tolist() == [[7] * 4, [1] * 4, [9] * 4]
    assert up.feature_nodes.tolist() == [8, 60, 61]
    assert dyn.updates_applied == 2 + 2 + 2
    with dyn.lock.write():
        dyn.apply(UpdateBatch(remove_nodes=np.array([5])))
    assert dyn.updates_applied == 7


def test_compaction_that_a_batch_overtook_is_dropped(tmp_path):
    """A batch that lands between building the compacted CSR and swapping it in wins: the
    stale build is discarded (compact() says False) and the batch's edge stays."""
    dyn = DynamicGraph(make_graph(tmp_path / "g", skewed_edges(), 60))
    build = dyn.rev.to_csr

    def build_then_a_batch_lands():
        out = build()
        dyn.rev.to_csr = build
        dyn.lock.release_read()  # step out of compact()'s read hold for the batch, then back in
        with dyn.lock.write():
            dyn.apply(UpdateBatch(add_edges=np.array([[1, 2]])))
        assert dyn.lock.try_read()
        return out

    dyn.rev.to_csr = build_then_a_batch_lands
    assert dyn.compact() is False
    assert dyn.compactions == 0 and dyn.has_edges(np.array([1]), np.array([2])).all()
    assert dyn.compact() is True and dyn.compactions == 1 and dyn.has_edges(np.array([1]), np.array([2])).all()


def test_restore_takes_the_snapshots_removed_nodes_and_refuses_one_smaller_than_the_base(tmp_path):
    from hybridgnn.errors import RemovedNode

    g = make_graph(tmp_path / "g", skewed_edges(), 60)
    dyn = DynamicGraph(g)
    indptr, indices = dyn.to_csr()
    feats = np.asarray(g.features).copy()
    alive = np.ones(60, dtype=bool)
    alive[5] = False
    with pytest.raises(ValueError, match="does not extend this 60-node graph"):
        dyn.restore(indptr[:60], indices[:indptr[59]], feats[:59], alive[:59], 3)
    dyn.restore(indptr, indices, feats, alive, 3)
    assert dyn.version == 3
    dyn.check_alive(np.array([4, 6]))
    with pytest.raises(RemovedNode):
        dyn.check_alive(np.array([4, 5]))


def test_on_a_dataset_with_names_errors_name_nodes_as_the_client_does(tmp_path):
    """They named internal row ids the client never saw ("node 1 was removed", "edge
    [3, 2] is not in the graph") for nodes it had named 'bob' and ('dave', 'carol')."""
    from hybridgnn.errors import RemovedNode
    from hybridgnn.graph.idmap import IdMap
    from hybridgnn.graph.store import GraphStore

    base = make_graph(tmp_path / "g", [(0, 1), (1, 2), (2, 3), (3, 4)], 5)
    IdMap(np.array(["alice", "bob", "carol", "dave", "erin"])).save(base.root)
    g = DynamicGraph(GraphStore.open(base.root))
    g.apply(UpdateBatch(remove_nodes=np.array([1])))
    with pytest.raises(RemovedNode, match="node 'bob' was removed from the graph"):
        g.check_alive(np.array([0, 1]))
    with pytest.raises(UpdateError, match="add_edges names node 'bob', which an update removed from the graph"):
        g.check(lambda n: UpdateBatch(add_edges=np.array([[1, 2]])))
    with pytest.raises(UpdateError, match=r"remove_edges: edge \['carol', 'dave'\] is not in the graph"):
        g.check(lambda n: UpdateBatch(remove_edges=np.array([[2, 3]])))
    with pytest.raises(UpdateError, match=r"add_edges: edge \['erin', 'dave'\] is already in the graph"):
        g.check(lambda n: UpdateBatch(add_edges=np.array([[4, 3]])))
