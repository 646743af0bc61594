"""PSGS and FAP against Monte-Carlo tree sampling (with multiplicity, as docs/architecture.md defines)."""

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from hybridgnn.workload.tables import (
    WorkloadTables,
    compute_fap,
    compute_psgs,
    seed_distribution,
)

FANOUTS = (4, 3)


def monte_carlo(graph, seeds, fanouts, rng):
    """Expand every sampled node again at the next hop (no dedup): returns the tree size per
    seed and the feature reads per node, both summed over all seeds."""
    indptr, indices = np.asarray(graph.indptr), np.asarray(graph.indices).astype(np.int64)
    frontier, owner = seeds.copy(), np.arange(len(seeds))
    size = np.ones(len(seeds))
    reads = np.bincount(seeds, minlength=graph.num_nodes).astype(np.float64)
    for fanout in fanouts:
        deg = indptr[frontier + 1] - indptr[frontier]
        total = int(deg.sum())
        group = np.repeat(np.arange(len(frontier)), deg)
        starts = np.repeat(np.cumsum(deg) - deg, deg)
        cand = indices[np.repeat(indptr[frontier], deg) + np.arange(total) - starts]
        order = np.lexsort((rng.random(total), group))  # random order inside each frontier entry
        rank = np.arange(total) - starts
        keep = order[rank < np.repeat(np.minimum(deg, fanout), deg)]
        frontier, owner = cand[keep], owner[group[keep]]
        size += np.bincount(owner, minlength=len(seeds))
        reads += np.bincount(frontier, minlength=graph.num_nodes)
    return size, reads


def test_psgs_matches_monte_carlo(skewed_graph):
    rng = np.random.default_rng(0)
    trials = 1500
    seeds = np.repeat(np.arange(skewed_graph.num_nodes), trials)
    size, _ = monte_carlo(skewed_graph, seeds, FANOUTS, rng)
    mc = size.reshape(skewed_graph.num_nodes, trials).mean(1)
    psgs = compute_psgs(skewed_graph, FANOUTS)
    assert np.all(psgs[-3:] == 1.0)  # isolated nodes sample nothing
    np.testing.assert_allclose(psgs, mc, rtol=0.03)


@pytest.mark.parametrize("kind", ["uniform", "degree"])
def test_fap_matches_monte_carlo(skewed_graph, kind):
    rng = np.random.default_rng(1)
    p0, key = seed_distribution(skewed_graph, kind)
    assert key == kind and abs(p0.sum() - 1) < 1e-9
    requests = 90_000
    seeds = rng.choice(skewed_graph.num_nodes, size=requests, p=p0)
    _, reads = monte_carlo(skewed_graph, seeds, FANOUTS, rng)
    fap = compute_fap(skewed_graph, FANOUTS, p0)
    mc = reads / requests
    hot = fap > 0.05
    np.testing.assert_allclose(fap[hot], mc[hot], rtol=0.03)
    assert abs(fap.sum() - mc.sum()) / fap.sum() < 0.03
    # Expected reads per request = expected PSGS of a seed drawn from p0.
    assert abs(fap.sum() - (p0 * compute_psgs(skewed_graph, FANOUTS)).sum()) < 1e-3


def test_seed_distribution_from_request_log(skewed_graph, tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("1 1 2\n3\n")
    p0, key = seed_distribution(skewed_graph, str(log))
    assert key.startswith("log-")
    assert p0[1] == pytest.approx(0.5) and p0[2] == pytest.approx(0.25) and p0[0] == 0
    np.save(tmp_path / "log.npy", np.array([5, 5]))
    p0, _ = seed_distribution(skewed_graph, str(tmp_path / "log.npy"))
    assert p0[5] == 1.0
    (tmp_path / "bad.txt").write_text("1000\n")
    with pytest.raises(ValueError, match="outside"):
        seed_distribution(skewed_graph, str(tmp_path / "bad.txt"))
    for big in ("99999999999999999999", "-99999999999999999999"):  # an OverflowError traceback
        (tmp_path / "big.txt").write_text(f"1 2 {big}\n")
        with pytest.raises(ValueError, match="outside the graph's"):
            seed_distribution(skewed_graph, str(tmp_path / "big.txt"))
    with pytest.raises(ValueError, match="neither"):
        seed_distribution(skewed_graph, "zipf")
    np.save(tmp_path / "u64.npy", np.array([1, 2, 2**64 - 1], dtype=np.uint64))  # was named "the first -1"
    with pytest.raises(ValueError, match=f"outside the graph's \\[0, 60\\), the first {2**64 - 1}$"):
        seed_distribution(skewed_graph, str(tmp_path / "u64.npy"))


@pytest.mark.parametrize("name", ["log.npy", "log.counts.npy"])
@pytest.mark.parametrize("content, match", [
    (b"", r"not a readable \.npy file \(EOFError"),  # an EOFError traceback
    (b"garbage", "it has no .npy or .npz header"),  # numpy's advice to load it unsafely
])
def test_a_request_log_that_is_not_an_array_is_one_dataset_error(skewed_graph, tmp_path, name, content, match):
    from hybridgnn.graph.store import DatasetError

    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError, match=match) as info:
        seed_distribution(skewed_graph, str(tmp_path / name))
    assert "unsafely" not in str(info.value)


def test_tables_save_load_and_batch_lookup(skewed_graph):
    built = WorkloadTables.load_or_build(skewed_graph, FANOUTS)
    psgs_path, fap_path = WorkloadTables.paths(skewed_graph.root, FANOUTS, "uniform")
    assert psgs_path.is_file() and fap_path.is_file()
    loaded = WorkloadTables.load_or_build(skewed_graph, FANOUTS)
    assert isinstance(loaded.psgs.base, np.memmap)  # a view of the mapped file: no copy, shared
    np.testing.assert_array_equal(built.psgs, loaded.psgs)
    ids = np.array([0, 1, 1, 59])
    assert loaded.batch_psgs(ids) == pytest.approx(float(np.asarray(built.psgs, np.float64)[ids].sum()))


def test_tables_of_a_dataset_rewritten_in_place_are_not_reused(tmp_path):
    """Tables are found by fanouts and seed key beside the dataset: rewritten with as many
    nodes and other edges, it gets tables of its own graph, not the old one's."""
    from tests.support.graphs import make_graph

    old = make_graph(tmp_path / "g", [(0, 1), (1, 2), (2, 0)], 3)
    WorkloadTables.load_or_build(old, FANOUTS, "degree")
    new = make_graph(tmp_path / "g", [(0, 1), (0, 2), (1, 0), (1, 2)], 3)
    tables = WorkloadTables.load_or_build(new, FANOUTS, "degree")
    np.testing.assert_allclose(tables.psgs, compute_psgs(new, FANOUTS))
    np.testing.assert_allclose(tables.fap, compute_fap(new, FANOUTS, seed_distribution(new, "degree")[0]), rtol=1e-6)
    again = WorkloadTables.load_or_build(new, FANOUTS, "degree")  # saved with the new graph's fingerprint: loaded
    assert isinstance(again.psgs.base, np.memmap) and again.graph_fingerprint == new.fingerprint


@pytest.mark.parametrize("damage", [
    lambda p: p.write_bytes(b""),  # EOFError traceback at startup
    lambda p: p.write_bytes(p.read_bytes()[:100]),  # truncated: EOFError
    lambda p: p.write_bytes(b"garbage"),  # "contains pickled data ... load it unsafely": exit 2
    lambda p: np.save(p, np.full(60, np.nan, np.float32)),  # NaN PSGS routed
    lambda p: np.save(p, np.full(60, -1.0, np.float32)),
    lambda p: np.save(p, np.array(["x"] * 60)),  # string PSGS: every request failed
    lambda p: np.save(p, np.ones((60, 1), np.float32)),
])
@pytest.mark.parametrize("which", [0, 1])
def test_a_damaged_cached_table_is_computed_again(skewed_graph, damage, which):
    built = WorkloadTables.load_or_build(skewed_graph, FANOUTS)
    path = WorkloadTables.paths(skewed_graph.root, FANOUTS, "uniform")[which]
    damage(path)
    again = WorkloadTables.load_or_build(skewed_graph, FANOUTS)
    np.testing.assert_array_equal(again.psgs, built.psgs)
    np.testing.assert_array_equal(again.fap, built.fap)
    reread = WorkloadTables.load_or_build(skewed_graph, FANOUTS)  # and saved again, whole
    assert isinstance(reread.psgs.base, np.memmap) and isinstance(reread.fap.base, np.memmap)
    np.testing.assert_array_equal(reread.fap, built.fap)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(ids=st.lists(st.integers(0, 24), min_size=0, max_size=20))
def test_batch_psgs_is_the_same_sum_for_few_and_many_ids(ids):
    """Up to 8 ids are summed in Python (a reduction's fixed cost dwarfs them), more by
    numpy; either way ids past the table (nodes added by updates) count as its largest entry."""
    psgs = np.random.default_rng(0).uniform(1, 50, 20).astype(np.float32)
    tables = WorkloadTables(FANOUTS, "uniform", psgs, np.zeros(20, np.float32))
    arr = np.asarray(ids, dtype=np.int64)
    expected = sum(float(psgs[i]) if i < 20 else float(psgs.max()) for i in ids)
    assert tables.batch_psgs(arr) == pytest.approx(expected, rel=1e-6)


def _complete_graph(path, n=20):
    from tests.support.graphs import make_graph

    return make_graph(path, [(i, j) for i in range(n) for j in range(n) if i != j], n)


def test_deep_psgs_on_a_dense_graph_stays_finite_and_exact(tmp_path):
    """5 neighbours a hop for 55 hops passed float32's 3.4e38 and stored inf, which the
    batcher's running sums (inf - inf) turned into NaN; up to the limit a table is exact."""
    graph = _complete_graph(tmp_path / "dense")
    fanouts = (5,) * 42
    exact = float(sum(5 ** k for k in range(43)))  # 1 + 5 + ... + 5^42 ≈ 2.8e29 expected nodes per seed
    psgs = compute_psgs(graph, fanouts)
    assert psgs.dtype == np.float32
    np.testing.assert_allclose(psgs, exact, rtol=1e-6)
    fap = compute_fap(graph, fanouts, np.full(20, 1 / 20))
    assert np.isfinite(fap).all() and fap.sum(dtype=np.float64) == pytest.approx(exact, rel=1e-6)
    built = WorkloadTables.load_or_build(graph, fanouts)
    loaded = WorkloadTables.load_or_build(graph, fanouts)
    assert isinstance(loaded.psgs.base, np.memmap)  # the saved table was read back, not computed again
    np.testing.assert_array_equal(loaded.psgs, built.psgs)
    assert loaded.batch_psgs(np.arange(20)) == pytest.approx(20 * exact, rel=1e-6)
    assert loaded.batch_psgs(np.arange(20)) - loaded.batch_psgs(np.arange(10)) == pytest.approx(10 * exact, rel=1e-6)
    from hybridgnn.profiling.runner import BatchGenerator, ProfileConfig

    gen = BatchGenerator(loaded.psgs, ProfileConfig())  # the profile's PSGS bins (NaN edges from inf)
    assert np.isfinite(gen.edges).all() and np.isfinite(gen.next()[1])


def test_psgs_past_the_table_limit_is_refused_in_one_line(tmp_path, capsys):
    from hybridgnn.cli.main import main
    from hybridgnn.errors import ConfigError
    from hybridgnn.workload.tables import PSGS_LIMIT

    graph = _complete_graph(tmp_path / "dense")
    assert PSGS_LIMIT == 1e30
    compute_psgs(graph, (19,) * 23)  # 1 + 19 + ... + 19^23 ≈ 2.6e29: held
    with pytest.raises(ConfigError, match=r"more than 1e\+30 expected sampled nodes"):
        compute_psgs(graph, (19,) * 24)
    # 250 hops: float32 tables held inf from the 31st (a float64 chain from the 241st)
    assert main(["workload", "build", "--dataset", str(graph.root), "--fanouts", ",".join(["19"] * 250)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridgnn workload: error: fanouts [19, 19,") and err.count("\n") == 1
    assert "fewer hops or fewer neighbours" in err


def test_a_stored_table_that_overflowed_is_computed_again(tmp_path):
    """A table an earlier version stored with inf in it is computed again, never served."""
    graph = _complete_graph(tmp_path / "dense")
    fanouts = (5,) * 42
    built = WorkloadTables.load_or_build(graph, fanouts)
    psgs_path, fap_path = WorkloadTables.paths(graph.root, fanouts, "uniform")
    np.save(psgs_path, np.full(20, np.inf, np.float32))
    again = WorkloadTables.load_or_build(graph, fanouts)
    np.testing.assert_array_equal(again.psgs, built.psgs)
    assert np.isfinite(np.load(psgs_path)).all()


def test_saving_tables_replaces_the_files_a_server_has_mapped(tmp_path):
    """`workload build` (or another replica) saving over tables a running server has
    memory-mapped truncated the file under the map (SIGBUS in the server) and changed its
    values meanwhile: the server keeps the old file whole, the disk holds the new one."""
    graph = _complete_graph(tmp_path / "g")
    served = WorkloadTables.load_or_build(graph, (2, 2))
    served = WorkloadTables.load_or_build(graph, (2, 2))
    assert isinstance(served.psgs.base, np.memmap)
    before = np.array(served.psgs)
    fresh = WorkloadTables((2, 2), "uniform", before * 3, np.asarray(served.fap) * 3,
                           graph_fingerprint=graph.fingerprint)
    fresh.save(graph.root)
    np.testing.assert_array_equal(served.psgs, before)  # the old file, still whole under its map
    np.testing.assert_array_equal(WorkloadTables.load_or_build(graph, (2, 2)).psgs, before * 3)
    assert not [p.name for p in (graph.root / "workload").iterdir() if p.name.startswith(".")]  # no temporaries left


def _exact_tree(adj: np.ndarray, fanouts, i: int, hop: int = 0):
    """(expected tree size, expected reads per node) of the sample rooted at i from `hop`,
    by enumerating every equally likely draw of min(deg, fanout) distinct neighbours."""
    import itertools

    reads = np.zeros(len(adj))
    reads[i] = 1.0
    size = 1.0
    neighbours = np.flatnonzero(adj[i])
    if hop == len(fanouts) or neighbours.size == 0:
        return size, reads
    draws = list(itertools.combinations(neighbours, min(fanouts[hop], neighbours.size)))
    for draw in draws:
        for j in draw:
            s, r = _exact_tree(adj, fanouts, int(j), hop + 1)
            size += s / len(draws)
            reads += r / len(draws)
    return size, reads


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=n, max_size=n),
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
    st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n))))
def test_psgs_and_fap_equal_an_exact_enumeration_of_every_sample(case):
    """Independent of the matrix chain: every draw of every hop enumerated on small graphs."""
    from types import SimpleNamespace

    rows, fanouts, weights = case
    adj = np.array(rows, dtype=np.int64)
    n = len(adj)
    indptr = np.concatenate([[0], np.cumsum(adj.sum(axis=1))]).astype(np.int64)
    indices = np.flatnonzero(adj.reshape(-1)) % n
    graph = SimpleNamespace(indptr=indptr, indices=indices.astype(np.int64), num_nodes=n, num_edges=int(adj.sum()),
                            degrees=lambda: adj.sum(axis=1))
    p0 = np.asarray(weights) / np.sum(weights)
    trees = [_exact_tree(adj, fanouts, i) for i in range(n)]
    np.testing.assert_allclose(compute_psgs(graph, fanouts), [s for s, _ in trees], rtol=1e-5)
    np.testing.assert_allclose(compute_fap(graph, fanouts, p0), sum(p * r for p, (_, r) in zip(p0, trees, strict=True)),
                               rtol=1e-5, atol=1e-7)


def _exact_positions(rows, fanouts, i: int, hop: int = 0):
    """_exact_tree over CSR rows that may repeat a neighbour: the sampler draws positions of
    a row, so a neighbour listed twice can be drawn twice."""
    import itertools

    reads = np.zeros(len(rows))
    reads[i] = 1.0
    size = 1.0
    row = rows[i]
    if hop == len(fanouts) or not row:
        return size, reads
    draws = list(itertools.combinations(range(len(row)), min(fanouts[hop], len(row))))
    for draw in draws:
        for q in draw:
            s, r = _exact_positions(rows, fanouts, row[q], hop + 1)
            size += s / len(draws)
            reads += r / len(draws)
    return size, reads


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(0, n - 1), max_size=4), min_size=n, max_size=n),
    st.lists(st.integers(1, 3), min_size=1, max_size=3))))
def test_duplicate_edges_count_as_often_as_the_row_lists_them(case):
    """Rows with repeated neighbours and self loops (a CSR need not be deduplicated): the
    chains' SpMVs sum repeated entries, as the position-drawing sampler does."""
    from types import SimpleNamespace

    rows, fanouts = case
    n = len(rows)
    indptr = np.r_[0, np.cumsum([len(r) for r in rows])].astype(np.int64)
    indices = np.array([v for r in rows for v in r], dtype=np.int64)
    graph = SimpleNamespace(indptr=indptr, indices=indices, num_nodes=n, num_edges=indices.size,
                            degrees=lambda: np.diff(indptr))
    trees = [_exact_positions(rows, fanouts, i) for i in range(n)]
    np.testing.assert_allclose(compute_psgs(graph, fanouts), [s for s, _ in trees], rtol=1e-5)
    p0 = np.full(n, 1.0 / n)
    np.testing.assert_allclose(compute_fap(graph, fanouts, p0), sum(p * r for p, (_, r) in zip(p0, trees, strict=True)),
                               rtol=1e-5, atol=1e-7)


def test_a_dataset_without_nodes_is_one_line_not_a_division_by_zero(tmp_path):
    from hybridgnn.graph.store import GraphStore, write_dataset

    write_dataset(tmp_path / "empty", indptr=np.zeros(1, np.int64), indices=np.zeros(0, np.int64),
                  features=np.zeros((0, 4), np.float32))
    graph = GraphStore.open(tmp_path / "empty")
    for seeds in ("uniform", "degree"):
        with pytest.raises(ValueError, match="has no nodes"):
            WorkloadTables.load_or_build(graph, (5, 3), seeds)


def test_a_request_log_that_is_not_there_is_said_to_be_missing(tmp_path):
    """workload build --seeds and place --from-log with a mistyped log path said "seed
    distribution must be one of ('uniform', 'degree') or a request-log file; 'x' is neither",
    as if the file were there but not a log."""
    from hybridgnn.workload.tables import seed_distribution
    from tests.support.graphs import make_graph

    graph = make_graph(tmp_path / "g", [(0, 1), (1, 0)], 2)
    with pytest.raises(ValueError, match=r"^seed distribution '.*requets\.txt' is neither one of \('uniform', "
                                         r"'degree'\) nor a request-log file \(no such file\)$"):
        seed_distribution(graph, str(tmp_path / "requets.txt"))
    with pytest.raises(ValueError, match=r"^seed distribution '.*g' is neither .* \(a directory\)$"):
        seed_distribution(graph, str(tmp_path / "g"))
    (tmp_path / "requests.txt").write_text("0 1 1\n")
    assert seed_distribution(graph, str(tmp_path / "requests.txt"))[0].tolist() == pytest.approx([1 / 3, 2 / 3])


def test_tables_of_a_hand_computed_graph_hold_the_exact_numbers(tmp_path):
    """Rows (candidates) 0: [1, 2, 3], 1: [2], 2: [] (deg 0), 3: [0, 2]; fanouts 2, 1.
    r_1 = min(deg, 2)/deg = [2/3, 1, 0, 1], r_2 = min(deg, 1)/deg = [1/3, 1, 0, 1/2].
    PSGS, Horner: w = 1 + r_2·deg = [2, 2, 1, 2]; w = 1 + r_1·(A·w) = 1 + r_1·[5, 1, 0, 3]
    = [13/3, 2, 1, 4] (seed 0 draws 2 of {1, 2, 3}, each with probability 2/3: 1 + 2/3·5).
    FAP, uniform p0 = 1/4: x_1 = Aᵀ(r_1·p0) = [1/4, 1/6, 2/3, 1/6], x_2 = Aᵀ(r_2·x_1) =
    [1/12, 1/12, 1/3, 1/12], FAP = p0 + x_1 + x_2 = [7/12, 1/2, 5/4, 1/2] (sums to the mean
    PSGS, 17/6). Degree-weighted p0 = deg/6 = [1/2, 1/6, 0, 1/3]: FAP = [1, 11/18, 13/9, 7/9]
    (sums to Σ p0·PSGS = 23/6). A request log [0, 0, 3] gives p0 = [2/3, 0, 0, 1/3]."""
    from hybridgnn.graph.store import GraphStore, write_dataset

    rows = [[1, 2, 3], [2], [], [0, 2]]
    indptr = np.r_[0, np.cumsum([len(r) for r in rows])].astype(np.int64)
    indices = np.array([v for r in rows for v in r], dtype=np.int64)
    graph = GraphStore.open(write_dataset(tmp_path / "g", indptr=indptr, indices=indices,
                                          features=np.zeros((4, 2), np.float32)))
    fanouts = (2, 1)
    psgs = [13 / 3, 2, 1, 4]
    np.testing.assert_allclose(compute_psgs(graph, fanouts), psgs, rtol=1e-6)
    uniform = WorkloadTables.load_or_build(graph, fanouts, "uniform")
    np.testing.assert_allclose(uniform.psgs, psgs, rtol=1e-6)
    np.testing.assert_allclose(uniform.fap, [7 / 12, 1 / 2, 5 / 4, 1 / 2], rtol=1e-6)
    assert uniform.batch_psgs(np.array([0, 2, 3])) == pytest.approx(13 / 3 + 1 + 4)
    degree = WorkloadTables.load_or_build(graph, fanouts, "degree")
    np.testing.assert_allclose(seed_distribution(graph, "degree")[0], [1 / 2, 1 / 6, 0, 1 / 3])
    np.testing.assert_allclose(degree.fap, [1, 11 / 18, 13 / 9, 7 / 9], rtol=1e-6)
    log = tmp_path / "requests.txt"
    log.write_text("0 0 3\n")
    p0, key = seed_distribution(graph, log)
    np.testing.assert_allclose(p0, [2 / 3, 0, 0, 1 / 3])
    assert key.startswith("log-")
    # float32 .npy beside the dataset, PSGS keyed by the fanouts, FAP by the fanouts and p0
    d = graph.root / "workload"
    for name, want in (("psgs_2-1.npy", psgs), ("fap_2-1_uniform.npy", uniform.fap), ("fap_2-1_degree.npy", degree.fap)):
        stored = np.load(d / name)
        assert stored.dtype == np.float32 and stored.shape == (4,)
        np.testing.assert_allclose(stored, want, rtol=1e-6)
    np.testing.assert_allclose(WorkloadTables.load_or_build(graph, fanouts, log).fap,
                               compute_fap(graph, fanouts, p0), rtol=1e-6)
    assert (d / f"fap_2-1_{key}.npy").is_file()


def test_degree_seeds_are_proportional_to_degree(skewed_graph):
    """'degree' draws a seed with probability deg / Σdeg (not uniformly)."""
    deg = skewed_graph.degrees().astype(np.float64)
    p0, key = seed_distribution(skewed_graph, "degree")
    assert key == "degree"
    np.testing.assert_allclose(p0, deg / deg.sum())
    assert p0[-1] == 0 and p0.max() > 2 / skewed_graph.num_nodes  # isolated nodes are never seeds


def test_request_log_bounds_and_counts_are_checked(skewed_graph, tmp_path):
    n = skewed_graph.num_nodes
    (tmp_path / "edge.txt").write_text(f"0 {n - 1}\n")  # the last node is inside
    p0, _ = seed_distribution(skewed_graph, str(tmp_path / "edge.txt"))
    assert p0.shape == (n,) and p0[n - 1] == pytest.approx(0.5)
    (tmp_path / "past.txt").write_text(f"0 {n}\n")  # one past the last is not
    with pytest.raises(ValueError, match=f"outside the graph's \\[0, {n}\\), the first {n}$"):
        seed_distribution(skewed_graph, str(tmp_path / "past.txt"))
    np.save(tmp_path / "float.npy", np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="integer node ids"):
        seed_distribution(skewed_graph, str(tmp_path / "float.npy"))
    good = np.zeros(n)
    good[[2, 3]] = [1, 3]
    np.save(tmp_path / "good.counts.npy", good)
    p0, key = seed_distribution(skewed_graph, str(tmp_path / "good.counts.npy"))
    assert key.startswith("log-") and p0[3] == pytest.approx(0.75)
    for name, counts in (("neg", np.r_[good[:-1], -1.0]), ("zero", np.zeros(n)), ("nan", np.r_[good[:-1], np.nan]),
                         ("short", good[:-1])):
        np.save(tmp_path / f"{name}.counts.npy", counts)
        with pytest.raises(ValueError, match="finite non-negative counts, not all zero"):
            seed_distribution(skewed_graph, str(tmp_path / f"{name}.counts.npy"))
    # a heterogeneous server's log (one array per node type) was read as a text of ids
    np.savez(tmp_path / "typed.counts.npz", v=good)
    with pytest.raises(ValueError, match=r"are a heterogeneous server's \(one counts array per node type\); .* is "
                                         r"homogeneous: give the \.counts\.npy"):
        seed_distribution(skewed_graph, str(tmp_path / "typed.counts.npz"))
