"""Typed neighbour sampling (fanouts per edge type): PyG's HeteroData layout, uniform
draws per edge type (chi-square), reproducibility, both implementations."""

import numpy as np
import pytest
import torch
from torch_geometric.nn import SAGEConv, to_hetero

from hybridgnn.graph.hetero import HeteroGraphStore
from hybridgnn.graph.hetero_generate import generate_hetero
from hybridgnn.graph.hetero_import import write_hetero_edges
from hybridgnn.sampling.typed import TypedCPUSampler, TypedTorchSampler

SAMPLERS = pytest.mark.parametrize("make_sampler", [TypedCPUSampler, TypedTorchSampler.from_graph],
                                   ids=["numba", "torch"])


@pytest.fixture(scope="module")
def academic(tmp_path_factory):
    path = tmp_path_factory.mktemp("typed") / "academic"
    return HeteroGraphStore.open(generate_hetero(path, kind="academic", num_nodes=300, avg_degree=8, seed=2))


def neighbours(graph, etype, v):
    d = graph.edges[etype]
    return set(np.asarray(d.indices[d.indptr[v]:d.indptr[v + 1]]).tolist())


@SAMPLERS
def test_layout_fanouts_and_real_edges_per_type(make_sampler, academic):
    fanouts = {e: [3, 2] for e in academic.edge_types}
    fanouts[("paper", "cites", "paper")] = [5, 0]
    sampler = make_sampler(academic, fanouts, seed=4)
    seeds = {"paper": np.array([3, 9, 9, 250]), "author": np.array([7])}
    for _ in range(20):
        sub = sampler.sample(seeds)
        for t, ids in sub.node_ids.items():
            assert len(set(ids.tolist())) == ids.size and sub.num_sampled_nodes[t].sum() == ids.size
            assert sub.num_sampled_nodes[t].size == 3
        assert sub.node_ids["paper"][sub.seed_index["paper"]].tolist() == [3, 9, 9, 250]
        assert sub.num_sampled_nodes["paper"][0] == 3 and sub.num_sampled_nodes["field"][0] == 0
        assert sub.node_ids["author"][sub.seed_index["author"]].tolist() == [7]
        for e, (src, dst) in sub.edge_index.items():
            s, _, t = e
            assert sub.num_sampled_edges[e].sum() == src.size
            g_src, g_dst = sub.node_ids[s][src], sub.node_ids[t][dst]
            assert all(u in neighbours(academic, e, v) for u, v in zip(g_src.tolist(), g_dst.tolist(), strict=True))
            hop = np.repeat(np.arange(2), sub.num_sampled_edges[e])
            for k in range(2):
                pairs = set(zip(g_src[hop == k].tolist(), g_dst[hop == k].tolist(), strict=True))
                assert len(pairs) == int((hop == k).sum())  # no repeats within a hop
                per_target = np.bincount(dst[hop == k], minlength=sub.node_ids[t].size)
                assert per_target.max(initial=0) <= fanouts[e][k]
                # only nodes first reached at the previous hop expand
                lo = sub.num_sampled_nodes[t][:k].sum()
                assert np.all((dst[hop == k] >= lo) & (dst[hop == k] < lo + sub.num_sampled_nodes[t][k]))
        assert sub.num_sampled_edges[("paper", "cites", "paper")][1] == 0


@SAMPLERS
def test_full_fanouts_take_every_typed_neighbourhood(make_sampler, academic):
    sampler = make_sampler(academic, [1000, 1000], seed=0)
    sub = sampler.sample({"author": np.array([11])})
    want = {t: set() for t in academic.node_types}
    want["author"].add(11)
    frontier = {"author": {11}}
    for _ in range(2):
        nxt = {t: set() for t in academic.node_types}
        for e in academic.edge_types:
            s, _, t = e
            for v in frontier.get(t, ()):
                nxt[s] |= neighbours(academic, e, v)
        frontier = {t: v - want[t] for t, v in nxt.items()}
        for t, v in nxt.items():
            want[t] |= v
    assert {t: set(v.tolist()) for t, v in sub.node_ids.items()} == want


@SAMPLERS
def test_uniform_inclusion_per_edge_type(make_sampler, tmp_path):
    # user 0 rated items 0..19 and wished for items 20..29: each edge type drawn on its own
    rates = np.stack([np.arange(20), np.zeros(20, np.int64)])
    wishes = np.stack([np.arange(20, 30), np.zeros(10, np.int64)])
    write_hetero_edges(tmp_path / "star", {"item": {"features": np.zeros((30, 1), np.float32)},
                                           "user": {"features": np.zeros((1, 1), np.float32)}},
                       {("item", "rated_by", "user"): rates, ("item", "wished_by", "user"): wishes})
    graph = HeteroGraphStore.open(tmp_path / "star")
    sampler = make_sampler(graph, {"rated_by": [5], "wished_by": [3]}, seed=7)
    trials = 8000 if make_sampler is TypedCPUSampler else 2000
    counts = {"rated_by": np.zeros(30), "wished_by": np.zeros(30)}
    for _ in range(trials):
        sub = sampler.sample({"user": np.array([0])})
        for e, (src, _) in sub.edge_index.items():
            counts[e[1]][sub.node_ids["item"][src]] += 1
    for rel, members, fanout, dof_bound in (("rated_by", range(20), 5, 60), ("wished_by", range(20, 30), 3, 40)):
        got = counts[rel][list(members)]
        assert got.sum() == trials * fanout and counts[rel].sum() == got.sum()
        expected = trials * fanout / len(members)
        chi2 = (((got - expected) ** 2) / expected).sum()
        assert chi2 < dof_bound  # 19 and 9 dof: p < 1e-5 beyond these


@SAMPLERS
def test_reproducible_with_seed_and_errors_name_the_type(make_sampler, academic):
    a, b = make_sampler(academic, [4, 3], seed=5), make_sampler(academic, [4, 3], seed=5)
    for _ in range(3):
        x, y = a.sample({"paper": np.arange(10)}), b.sample({"paper": np.arange(10)})
        for t in x.node_ids:
            np.testing.assert_array_equal(x.node_ids[t], y.node_ids[t])
    with pytest.raises(ValueError, match="unknown node type 'venue'"):
        a.sample({"venue": np.array([0])})
    with pytest.raises(ValueError, match=r"node type 'field' must lie in \[0, 5\)"):
        a.sample({"field": np.array([5])})


@SAMPLERS
def test_a_to_hetero_model_consumes_the_sample(make_sampler, academic):
    class SAGE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = SAGEConv((-1, -1), 8), SAGEConv((-1, -1), 4)

        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    model = to_hetero(SAGE(), academic.metadata(), aggr="sum")
    sub = make_sampler(academic, [4, 3], seed=1).sample({"paper": np.array([1, 2, 3])})
    x = {t: torch.from_numpy(np.asarray(academic.nodes[t].features)[ids]) for t, ids in sub.node_ids.items()}
    edges = {e: torch.from_numpy(ei) for e, ei in sub.edge_index.items()}
    out = model(x, edges)
    assert out["paper"].shape == (sub.node_ids["paper"].size, 4)


def test_a_hop_that_fails_midway_leaves_the_maps_clean(academic, monkeypatch):
    """A hop's new nodes were numbered in the map before they were listed for the cleanup:
    an error in a later edge type's draw (out of memory on a GPU) left them numbered, and
    later batches read them as reached (torch); a failure inside the compiled hop lost the
    arrays that listed them (numba)."""
    import hybridgnn.sampling.typed as typed

    fanouts = {e: [3, 2] for e in academic.edge_types}
    seeds = {"paper": np.array([3, 9, 250]), "author": np.array([7])}

    torch_sampler = TypedTorchSampler.from_graph(academic, fanouts, seed=4)
    real_draw, calls = typed.draw_hop, {"n": 0}

    def fails_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA out of memory")
        return real_draw(*args, **kwargs)

    monkeypatch.setattr(typed, "draw_hop", fails_second)
    with pytest.raises(RuntimeError, match="out of memory"):
        torch_sampler.sample(seeds)
    assert all(bool((m == -1).all()) for m in torch_sampler._local.values())

    cpu_sampler = TypedCPUSampler(academic, fanouts, seed=4)
    real_hop, calls["n"] = typed.typed_hop, 0

    def numbers_then_fails(indptr, indices, frontier, fanout, local, nodes, count, *rest):
        calls["n"] += 1
        if calls["n"] == 2:
            local[int(indices[0])] = 5  # numbered in arrays the caller never gets back
            raise MemoryError("out of memory")
        return real_hop(indptr, indices, frontier, fanout, local, nodes, count, *rest)

    monkeypatch.setattr(typed, "typed_hop", numbers_then_fails)
    with pytest.raises(MemoryError):
        cpu_sampler.sample(seeds)
    assert all(bool((m == -1).all()) for m in cpu_sampler._local.values())


def test_indices_the_kernels_cannot_read_keep_the_torch_draw(academic, monkeypatch):
    import hybridgnn.sampling.typed as typed

    monkeypatch.setattr(typed.cuda_hop, "available", lambda device: True)
    csr = {e: (torch.from_numpy(np.asarray(d.indptr, np.int64)), torch.from_numpy(np.asarray(d.indices, np.int16)))
           for e, d in academic.edges.items()}
    sampler = TypedTorchSampler(csr, {t: academic.num_nodes(t) for t in academic.node_types},
                                {e: [3, 2] for e in academic.edge_types})
    assert not any(sampler._kernel.values())
