"""Typed PSGS and FAP (fanouts per edge type) against Monte-Carlo tree sampling, and the
homogeneous tables as their one-type case."""

import numpy as np
import pytest

from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.graph.hetero_import import write_hetero_edges
from hybridgnn.workload.tables import compute_fap, compute_psgs
from hybridgnn.workload.typed import (
    TypedWorkloadTables,
    compute_typed_fap,
    compute_typed_psgs,
    typed_fanout_key,
    typed_fanouts,
    typed_seed_distribution,
)
from tests.support.graphs import make_graph, skewed_edges

CITES, WRITES, REV_WRITES = ("paper", "cites", "paper"), ("author", "writes", "paper"), ("paper", "rev_writes", "author")


@pytest.fixture(scope="module")
def academic(tmp_path_factory):
    path = tmp_path_factory.mktemp("typed") / "academic"
    return HeteroGraphStore.open(generate_hetero(path, kind="academic", num_nodes=60, avg_degree=6, seed=3))


def fanouts_of(graph):
    """Different fanouts per edge type, one unsampled at hop 2."""
    base = {e: [3, 2] for e in graph.edge_types}
    base.update({CITES: [4, 3], WRITES: [2, 0]})
    return typed_fanouts(graph.edge_types, base)


def typed_monte_carlo(graph, seed_type, seeds, fanouts, rng):
    """Expand every sampled node again at the next hop (no dedup): tree size per seed and
    feature reads per node of every type, summed over all seeds."""
    size = np.ones(len(seeds))
    reads = {t: np.zeros(graph.num_nodes(t)) for t in graph.node_types}
    reads[seed_type] += np.bincount(seeds, minlength=graph.num_nodes(seed_type))
    empty = (np.empty(0, np.int64), np.empty(0, np.int64))
    frontier = {t: empty for t in graph.node_types}
    frontier[seed_type] = (seeds, np.arange(len(seeds)))
    for k in range(len(next(iter(fanouts.values())))):
        nxt = {t: [] for t in graph.node_types}
        for e, data in graph.edges.items():
            s, _, t = e
            ids, owner = frontier[t]
            indptr, indices = np.asarray(data.indptr), np.asarray(data.indices).astype(np.int64)
            deg = indptr[ids + 1] - indptr[ids]
            total = int(deg.sum())
            group = np.repeat(np.arange(len(ids)), deg)
            starts = np.repeat(np.cumsum(deg) - deg, deg)
            cand = indices[np.repeat(indptr[ids], deg) + np.arange(total) - starts]
            order = np.lexsort((rng.random(total), group))
            keep = order[(np.arange(total) - starts) < np.repeat(np.minimum(deg, fanouts[e][k]), deg)]
            nxt[s].append((cand[keep], owner[group[keep]]))
        frontier = {t: (np.concatenate([p[0] for p in parts] or [empty[0]]),
                        np.concatenate([p[1] for p in parts] or [empty[1]])) for t, parts in nxt.items()}
        for t, (ids, owner) in frontier.items():
            size += np.bincount(owner, minlength=len(seeds))
            reads[t] += np.bincount(ids, minlength=graph.num_nodes(t))
    return size, reads


@pytest.mark.parametrize("seed_type", ["paper", "author", "field"])
def test_typed_psgs_matches_monte_carlo(academic, seed_type):
    rng = np.random.default_rng(0)
    tf = fanouts_of(academic)
    n, trials = academic.num_nodes(seed_type), 800
    size, _ = typed_monte_carlo(academic, seed_type, np.repeat(np.arange(n), trials), tf, rng)
    mc = size.reshape(n, trials)
    psgs = compute_typed_psgs(academic, tf)[seed_type]
    # within 5 standard errors of each node's Monte-Carlo mean (and 1 where nothing is sampled)
    se = mc.std(1) / np.sqrt(trials)
    assert np.all(np.abs(psgs - mc.mean(1)) <= 5 * se + 1e-3), np.abs(psgs - mc.mean(1)).max()


@pytest.mark.parametrize("kind", ["uniform", "degree"])
def test_typed_fap_matches_monte_carlo_per_type(academic, kind):
    rng = np.random.default_rng(1)
    tf = fanouts_of(academic)
    p0 = typed_seed_distribution(academic, "paper", kind)
    requests = 60_000
    seeds = rng.choice(academic.num_nodes("paper"), size=requests, p=p0)
    _, reads = typed_monte_carlo(academic, "paper", seeds, tf, rng)
    fap = compute_typed_fap(academic, tf, "paper", p0)
    for t in academic.node_types:
        mc = reads[t] / requests
        # within 6 standard errors (a node is read at most a few times per request)
        assert np.all(np.abs(fap[t] - mc) <= 6 * np.sqrt(3 * fap[t] / requests) + 1e-4), t
        assert abs(fap[t].sum() - mc.sum()) / fap[t].sum() < 0.03
    # expected reads per request = expected PSGS of a seed drawn from p0
    total = sum(float(v.sum()) for v in fap.values())
    assert total == pytest.approx(float((p0 * compute_typed_psgs(academic, tf)["paper"]).sum()), rel=1e-5)


def test_one_type_one_edge_type_is_the_homogeneous_table(tmp_path):
    edges = np.array(skewed_edges())[:, ::-1].T  # (node, neighbour) rows as PyG (source, target)
    homo = make_graph(tmp_path / "homo", skewed_edges(), 60)
    write_hetero_edges(tmp_path / "het", {"v": {"features": np.zeros((60, 1), np.float32)}}, {("v", "to", "v"): edges})
    het = HeteroGraphStore.open(tmp_path / "het")
    tf = typed_fanouts(het.edge_types, [4, 3])
    np.testing.assert_allclose(compute_typed_psgs(het, tf)["v"], compute_psgs(homo, (4, 3)), rtol=1e-6)
    p0 = np.full(60, 1 / 60)
    np.testing.assert_allclose(compute_typed_fap(het, tf, "v", p0)["v"], compute_fap(homo, (4, 3), p0), rtol=1e-6)


def test_fanouts_per_layer_or_per_edge_type(academic):
    types = academic.edge_types
    assert set(typed_fanouts(types, [5, 3]).values()) == {(5, 3)}
    given = {"cites": [4, 3], "author__writes__paper": [2, 0], **{e: [1, 1] for e in types if e not in (CITES, WRITES)}}
    tf = typed_fanouts(types, given)
    assert list(tf) == types and tf[CITES] == (4, 3) and tf[WRITES] == (2, 0)
    assert typed_fanout_key(typed_fanouts(types, [5, 3])) == "5-3" and typed_fanout_key(tf).startswith("t")
    with pytest.raises(ValueError, match="missing"):
        typed_fanouts(types, {"cites": [4, 3]})
    with pytest.raises(ValueError, match="unknown edge type 'likes'"):
        typed_fanouts(types, {**given, "likes": [1, 1]})
    with pytest.raises(ValueError, match="one number of hops"):
        typed_fanouts(types, {**given, "cites": [4]})
    for bad in ([], [-1], ["3"], [True], "15,10", 7):
        with pytest.raises(ValueError, match="fanouts"):
            typed_fanouts(types, bad)


def test_tables_save_and_load_beside_the_dataset(academic):
    built = TypedWorkloadTables.load_or_build(academic, [3, 2])
    loaded = TypedWorkloadTables.load_or_build(academic, [3, 2])
    assert isinstance(loaded.psgs["paper"], np.memmap)
    for t in academic.node_types:
        np.testing.assert_array_equal(built.psgs[t], loaded.psgs[t])
        np.testing.assert_array_equal(built.fap["author"][t], loaded.fap["author"][t])
    ids = np.array([0, 3, 3])
    assert loaded.batch_psgs("paper", ids) == pytest.approx(float(np.asarray(built.psgs["paper"], np.float64)[ids].sum()))
    with pytest.raises(ValueError, match="uniform"):
        TypedWorkloadTables.build(academic, [3, 2], seed="requests.log")


def test_typed_tables_of_a_dataset_rewritten_in_place_are_not_reused(tmp_path):
    """As for one node type: a dataset rewritten with as many nodes of each type and other
    edges gets tables of its own graph, for each seed kind, not the old graph's."""
    path = tmp_path / "academic"
    old = HeteroGraphStore.open(generate_hetero(path, kind="academic", num_nodes=60, avg_degree=6, seed=3))
    for seed in ("uniform", "degree"):
        TypedWorkloadTables.load_or_build(old, [3, 2], seed)
    new = HeteroGraphStore.open(generate_hetero(path, kind="academic", num_nodes=60, avg_degree=6, seed=4))
    assert new.fingerprint != old.fingerprint
    assert all(new.num_nodes(t) == old.num_nodes(t) for t in new.node_types)
    TypedWorkloadTables.load_or_build(new, [3, 2], "degree")  # rewrites the PSGS beside the uniform FAP
    for seed in ("degree", "uniform"):
        loaded = TypedWorkloadTables.load_or_build(new, [3, 2], seed)
        fresh = TypedWorkloadTables.build(new, [3, 2], seed)
        for t in new.node_types:
            np.testing.assert_allclose(loaded.psgs[t], fresh.psgs[t], rtol=1e-6)
            np.testing.assert_allclose(loaded.fap["author"][t], fresh.fap["author"][t], rtol=1e-6)


def _dense_hetero(path, n=12):
    """Two node types, every a linked to every b and back: degrees n, as dense as it gets."""
    a, b = np.meshgrid(np.arange(n), np.arange(n))
    ab = np.stack([a.ravel(), b.ravel()])
    nodes = {t: {"features": np.zeros((n, 2), np.float32)} for t in ("a", "b")}
    write_hetero_edges(path, nodes, {("a", "to", "b"): ab, ("b", "to", "a"): ab.copy()})
    return HeteroGraphStore.open(path)


def test_deep_typed_psgs_stays_finite_and_an_overflowed_cache_is_computed_again(tmp_path):
    """float32 typed tables overflowed as the homogeneous ones did, and the loader read a
    stored inf as it was (no check of the values at all)."""
    graph = _dense_hetero(tmp_path / "dense")
    tf = typed_fanouts(graph.edge_types, [5] * 42)
    exact = float(sum(5 ** k for k in range(43)))
    psgs = compute_typed_psgs(graph, tf)
    for t in ("a", "b"):
        assert psgs[t].dtype == np.float32
        np.testing.assert_allclose(psgs[t], exact, rtol=1e-6)
    built = TypedWorkloadTables.load_or_build(graph, [5] * 42)
    d = TypedWorkloadTables.directory(graph.root, tf)
    np.save(d / "psgs-0.npy", np.full(12, np.inf, np.float32))  # what the float32 version stored
    again = TypedWorkloadTables.load_or_build(graph, [5] * 42)
    np.testing.assert_array_equal(again.psgs["a"], built.psgs["a"])
    assert np.isfinite(np.load(d / "psgs-0.npy")).all()
    assert again.batch_psgs("a", np.arange(12)) == pytest.approx(12 * exact, rel=1e-6)


def test_typed_psgs_past_the_table_limit_is_refused_in_one_line(tmp_path):
    from hybridgnn.errors import ConfigError

    graph = _dense_hetero(tmp_path / "dense")
    with pytest.raises(ConfigError, match=r"seed of type '[ab]' more than 1e\+30 expected sampled nodes") as info:
        TypedWorkloadTables.build(graph, [12] * 30)  # 12^30 ≈ 2.4e32
    assert "\n" not in str(info.value)


def _hand_graph(path):
    """Types a (a0, a1) and b (b0, b1); (b, writes, a): a0 lists [b0, b1], a1 none;
    (a, rev, b): b0 lists [a0], b1 [a0, a1]."""
    from hybridgnn.graph.hetero import write_hetero_dataset

    writes, rev = ("b", "writes", "a"), ("a", "rev", "b")
    root = write_hetero_dataset(
        path, nodes={"a": {"features": np.zeros((2, 2), np.float32)}, "b": {"features": np.zeros((2, 2), np.float32)}},
        edges={writes: (np.array([0, 2, 2]), np.array([0, 1])), rev: (np.array([0, 1, 3]), np.array([0, 0, 1]))})
    return HeteroGraphStore.open(root)


def test_typed_tables_of_a_hand_computed_graph_hold_the_exact_numbers(tmp_path):
    """Types a (a0, a1) and b (b0, b1). (b, writes, a): a0 lists [b0, b1], a1 none (deg 0);
    (a, rev, b): b0 lists [a0], b1 [a0, a1]. Fanouts 1, 1 for both: r_writes = [1/2, 0],
    r_rev = [1, 1/2].
    PSGS: hop 2: w_a = 1 + r_writes·(A_writes·1) = [2, 1], w_b = 1 + r_rev·(A_rev·1) = [2, 2];
    hop 1: w_a = 1 + r_writes·(A_writes·w_b) = [1 + 1/2·4, 1] = [3, 1],
    w_b = 1 + r_rev·(A_rev·w_a) = [1 + 2, 1 + 1/2·3] = [3, 5/2].
    FAP of seed type a, p0 = [1/2, 1/2]: hop 1 reaches b: A_writesᵀ(r_writes·x_a) = [1/4, 1/4];
    hop 2 reaches a: A_revᵀ(r_rev·x_b) = [1/4 + 1/8, 1/8]; acc_a = [7/8, 5/8], acc_b = [1/4, 1/4]
    (sums to the mean PSGS of a, 2)."""
    graph = _hand_graph(tmp_path / "h")
    tables = TypedWorkloadTables.load_or_build(graph, [1, 1], "uniform")
    np.testing.assert_allclose(tables.psgs["a"], [3, 1], rtol=1e-6)
    np.testing.assert_allclose(tables.psgs["b"], [3, 5 / 2], rtol=1e-6)
    np.testing.assert_allclose(tables.fap["a"]["a"], [7 / 8, 5 / 8], rtol=1e-6)
    np.testing.assert_allclose(tables.fap["a"]["b"], [1 / 4, 1 / 4], rtol=1e-6)
    assert all(v.dtype == np.float32 for v in tables.psgs.values())
    # a pair request sums both ends' PSGS
    assert tables.batch_psgs("a", np.array([0, 1])) + tables.batch_psgs("b", np.array([1])) == pytest.approx(6.5)
    reread = TypedWorkloadTables.load_or_build(graph, [1, 1], "uniform", save=False)
    np.testing.assert_allclose(reread.fap["a"]["a"], [7 / 8, 5 / 8], rtol=1e-6)


def test_edge_type_names_and_fanout_limits_are_checked(academic):
    from hybridgnn.workload.typed import MAX_FANOUT, resolve_edge_type

    both = [("a", "to", "b"), ("b", "to", "a")]
    with pytest.raises(ValueError, match="relation 'to' names 2 edge types"):
        resolve_edge_type(both, "to")  # never the first of them silently
    assert resolve_edge_type(both, "b__to__a") == ("b", "to", "a")
    types = academic.edge_types
    rest = {e: [1, 1] for e in types if e != CITES}
    with pytest.raises(ValueError, match="'paper__cites__paper' twice"):
        typed_fanouts(types, {"cites": [4, 3], "paper__cites__paper": [2, 2], **rest})
    assert typed_fanouts(types, [MAX_FANOUT, 0])[CITES] == (MAX_FANOUT, 0)
    with pytest.raises(ValueError, match=f"integers in \\[0, {MAX_FANOUT}\\]"):
        typed_fanouts(types, [MAX_FANOUT + 1, 1])


def test_typed_degree_seeds_are_proportional_to_in_degree(academic):
    deg = sum(academic.edges[e].degrees().astype(np.float64) for e in academic.edge_types_into("paper"))
    np.testing.assert_allclose(typed_seed_distribution(academic, "paper", "degree"), deg / deg.sum())
    assert not np.allclose(deg, deg[0])  # so uniform seeds would differ


def _log(path, **counts):
    """A heterogeneous server's seed log: TypedSeedCounts counting these (type, ids), saved."""
    from hybridgnn.serving.core.placement_refresh import TypedSeedCounts

    seeds = TypedSeedCounts({"a": 2, "b": 2})
    seeds.count((t, np.asarray(ids, np.int64)) for t, ids in counts.items())
    seeds.save_seed_log(path)
    return path


def test_typed_tables_from_a_seed_log_hold_the_exact_numbers(tmp_path):
    """The hand-computed graph above, seeds from a log: a counted [3, 1] (a0 three times),
    b counted [0, 2]. Each type's p0 is its counts over their sum, as a homogeneous log's:
    a: [3/4, 1/4], b: [0, 1]. PSGS does not depend on the seeds: a [3, 1], b [3, 5/2].
    FAP of seed type a: hop 1 reaches b: A_writesᵀ(r_writes·p0) = A_writesᵀ[3/8, 0] = [3/8, 3/8];
    hop 2 reaches a: A_revᵀ(r_rev·[3/8, 3/8]) = A_revᵀ[3/8, 3/16] = [9/16, 3/16];
    acc_a = [3/4 + 9/16, 1/4 + 3/16] = [21/16, 7/16], acc_b = [3/8, 3/8] (sum 5/2 = 3/4·3 + 1/4·1).
    FAP of seed type b: hop 1 reaches a: A_revᵀ(r_rev·[0, 1]) = A_revᵀ[0, 1/2] = [1/2, 1/2];
    hop 2 reaches b: A_writesᵀ(r_writes·[1/2, 1/2]) = A_writesᵀ[1/4, 0] = [1/4, 1/4];
    acc_b = [1/4, 5/4], acc_a = [1/2, 1/2] (sum 5/2, b1's PSGS)."""
    graph = _hand_graph(tmp_path / "h")
    log = _log(tmp_path / "seeds.counts.npz", a=[0, 0, 1, 0], b=[1, 1])
    with np.load(log, allow_pickle=False) as stored:  # self-describing: one counts array per type, by name
        assert {t: stored[t].tolist() for t in stored.files} == {"a": [3, 1], "b": [0, 2]}
    tables = TypedWorkloadTables.build(graph, [1, 1], log)
    assert tables.seed_key.startswith("log-")
    np.testing.assert_allclose(tables.psgs["a"], [3, 1], rtol=1e-6)
    np.testing.assert_allclose(tables.psgs["b"], [3, 5 / 2], rtol=1e-6)
    np.testing.assert_allclose(tables.fap["a"]["a"], [21 / 16, 7 / 16], rtol=1e-6)
    np.testing.assert_allclose(tables.fap["a"]["b"], [3 / 8, 3 / 8], rtol=1e-6)
    np.testing.assert_allclose(tables.fap["b"]["b"], [1 / 4, 5 / 4], rtol=1e-6)
    np.testing.assert_allclose(tables.fap["b"]["a"], [1 / 2, 1 / 2], rtol=1e-6)
    # saved under the log's key beside the uniform tables, and read back for the same log
    tables.save(graph)
    uniform = TypedWorkloadTables.load_or_build(graph, [1, 1], "uniform")
    np.testing.assert_allclose(uniform.fap["a"]["a"], [7 / 8, 5 / 8], rtol=1e-6)
    again = TypedWorkloadTables.load_or_build(graph, [1, 1], log, save=False)
    assert again.seed_key == tables.seed_key and isinstance(again.fap["b"]["b"], np.memmap)
    np.testing.assert_allclose(again.fap["b"]["b"], [1 / 4, 5 / 4], rtol=1e-6)
    # a type the log does not name (no request was rooted there) keeps the uniform seeds
    # (a counted [1, 0]: hop 1 reaches b [1/2, 1/2], hop 2 a A_revᵀ[1/2, 1/4] = [3/4, 1/4]; sum 3, a0's PSGS)
    only_a = TypedWorkloadTables.build(graph, [1, 1], _log(tmp_path / "a.counts.npz", a=[0]))
    np.testing.assert_allclose(only_a.fap["a"]["a"], [7 / 4, 1 / 4], rtol=1e-6)
    np.testing.assert_allclose(only_a.fap["a"]["b"], [1 / 2, 1 / 2], rtol=1e-6)
    for t in ("a", "b"):
        np.testing.assert_allclose(only_a.fap["b"][t], uniform.fap["b"][t], rtol=1e-6)
    assert only_a.seed_key != tables.seed_key


def _typed_counts(path, **arrays):
    from hybridgnn.workload.typed import write_typed_counts

    write_typed_counts(path, {t: np.asarray(v) for t, v in arrays.items()})
    return path


@pytest.mark.parametrize("make, match", [
    (lambda p: np.save(p / "s.counts.npy", np.ones(2)) or p / "s.counts.npy",
     r"are a homogeneous server's \(one counts array\); .* is heterogeneous: give the \.counts\.npz"),
    (lambda p: np.save(p / "ids.npy", np.ones(2, np.int64)) or p / "ids.npy", r"or a seed log \(\.counts\.npz"),
    (lambda p: p / "missing.counts.npz", r"^no seed log '.*missing\.counts\.npz' \(the seed distribution"),
    (lambda p: np.save(p / "x.npy", np.ones(2)) or (p / "x.npy").rename(p / "x.counts.npz"),
     "an .npz archive of one counts array per node type was expected, not a .npy array"),
    (lambda p: [(p / "g.counts.npz").write_bytes(b"garbage"), p / "g.counts.npz"][1], "no .npy or .npz header"),
    (lambda p: _typed_counts(p / "e.counts.npz"), "name no node type: the server counted no request"),
    (lambda p: _typed_counts(p / "c.counts.npz", a=[1, 1], c=[1]),
     r"name node type 'c', which .* does not have \(its node types are \['a', 'b'\]\)"),
    (lambda p: _typed_counts(p / "l.counts.npz", a=[1, 1, 1]),
     r"seed counts of node type 'a' in .* must hold 2 finite non-negative counts, not all zero: it holds 3$"),
    (lambda p: _typed_counts(p / "n.counts.npz", b=[1.0, -1.0]), r"type 'b' .*: some are negative$"),
    (lambda p: _typed_counts(p / "f.counts.npz", a=[1.0, np.nan]), r"type 'a' .*: some are not finite$"),
    (lambda p: _typed_counts(p / "i.counts.npz", a=[1.0, np.inf]), r"type 'a' .*: some are not finite$"),
    (lambda p: _typed_counts(p / "z.counts.npz", a=[1, 0], b=[0, 0]), r"type 'b' .*: all are zero$"),
    (lambda p: _typed_counts(p / "s.counts.npz", a=np.array(["x", "y"])), "must be numbers, got <U1"),
])
def test_a_seed_log_that_is_not_this_graphs_is_refused_in_one_line(tmp_path, make, match):
    graph = _hand_graph(tmp_path / "h")
    path = make(tmp_path)
    with pytest.raises(ValueError, match=match) as info:  # ConfigError (a ValueError) for an unreadable file
        TypedWorkloadTables.build(graph, [1, 1], path)
    assert "\n" not in str(info.value)
    assert not (graph.root / "workload").exists()


def test_workload_build_from_a_seed_log_and_its_refusals_exit_2(tmp_path, capsys):
    import json

    from hybridgnn.cli.main import main

    graph = _hand_graph(tmp_path / "h")
    log = _log(tmp_path / "seeds.counts.npz", a=[0, 0, 1, 0], b=[1, 1])
    assert main(["workload", "build", "--dataset", str(graph.root), "--fanouts", "1,1", "--seeds", str(log)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seeds"].startswith("log-")
    d = TypedWorkloadTables.directory(graph.root, typed_fanouts(graph.edge_types, [1, 1]))
    np.testing.assert_allclose(np.load(d / f"fap-{report['seeds']}-0-0.npy"), [21 / 16, 7 / 16], rtol=1e-6)
    for bad in (_typed_counts(tmp_path / "z.counts.npz", a=[0, 0]), tmp_path / "nothing.counts.npz"):
        assert main(["workload", "build", "--dataset", str(graph.root), "--fanouts", "1,1", "--seeds", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridgnn workload: error: ") and err.count("\n") == 1, err
