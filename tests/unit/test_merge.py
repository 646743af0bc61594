"""Split layers: local aggregations over any split of a block's edges, merged at the
target's home, give the layer's output (sum, mean, max, GCN weights, GAT softmax)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

from hybridgnn.distributed.merge import split_layer
from hybridgnn.errors import ConfigError
from hybridgnn.models.gnn import apply_conv, gcn_edge_weights, gcn_norm_degrees


def block(seed: int, sources: int = 40, targets: int = 9, edges: int = 160):
    """Random edges into the first `targets` of `sources` nodes, self-loops included."""
    rng = np.random.default_rng(seed)
    ei = np.stack([rng.integers(0, sources, edges), rng.integers(0, targets, edges)])
    ei = np.unique(ei, axis=1)
    ei = np.concatenate([ei, [[2, 5], [2, 5]]], axis=1)  # two explicit self-loops
    return torch.from_numpy(ei), torch.randn(sources, 6, generator=torch.Generator().manual_seed(seed))


def split_and_merge(layer, x, ei, targets, parts: int, seed: int, weight=None):
    """Edges dealt to `parts` ranks at random; each aggregates its own, all merged."""
    owner = torch.from_numpy(np.random.default_rng(seed).integers(0, parts, ei.shape[1]))
    info = layer.target_info(x[:targets]) if layer.needs_target_info else None
    idx, rows = [], []
    for p in range(parts):
        mine = owner == p
        if not bool(mine.any()):
            continue
        part = layer.local(x, ei[0, mine], ei[1, mine], targets, info, weight[mine] if weight is not None else None)
        hit = torch.nonzero(torch.bincount(ei[1, mine], minlength=targets)).squeeze(1)
        idx.append(hit)
        rows.append(part[hit])
    return layer.finish(torch.cat(idx), torch.cat(rows), targets, x[:targets])


def with_gat_loops(ei, targets):
    keep = ei[0] != ei[1]
    loops = torch.arange(targets)
    return torch.cat([ei[:, keep], torch.stack([loops, loops])], dim=1)


@pytest.mark.parametrize("conv", [SAGEConv(6, 5), SAGEConv(6, 5, aggr="max"), SAGEConv(6, 5, aggr="sum"),
                                  SAGEConv(6, 5, project=True, normalize=True), SAGEConv(6, 5, root_weight=False),
                                  GATConv(6, 3, heads=2), GATConv(6, 5, heads=3, concat=False, residual=True),
                                  GATConv((6, 6), 4, heads=2), GATConv(6, 3, heads=2, add_self_loops=False)])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_layers_equal_the_layer(conv, parts):
    torch.manual_seed(parts)
    ei, x = block(parts)
    targets = 9
    with torch.no_grad():
        conv.eval()
        expected = apply_conv(conv, x, ei, targets)
        layer = split_layer(conv, 0)
        edges = with_gat_loops(ei, targets) if layer.self_loops == "all" else ei
        got = split_and_merge(layer, x, edges, targets, parts, seed=parts)
    assert torch.allclose(got, expected, atol=1e-5), float((got - expected).abs().max())


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_gcn_split_equals_the_weighted_layer(parts):
    ei, x = block(parts + 10)
    targets = 9
    conv = GCNConv(6, 5).eval()
    torch.nn.init.normal_(conv.bias, generator=torch.Generator().manual_seed(parts))  # PyG starts it at 0
    degree, has_loop = gcn_norm_degrees(ei.numpy(), 40)
    full, w = gcn_edge_weights(ei.numpy(), np.arange(40), targets, degree, has_loop)
    full, w = torch.from_numpy(full), torch.from_numpy(w)
    with torch.no_grad():
        expected = apply_conv(conv, x, full, targets, w)
        got = split_and_merge(split_layer(conv, 0), x, full, targets, parts, seed=parts, weight=w)
    assert torch.allclose(got, expected, atol=1e-5)


def test_max_of_a_target_without_edges_is_zero_and_mean_is_zero():
    x = torch.randn(4, 6)
    ei = torch.tensor([[1, 2], [0, 0]])
    for aggr in ("max", "mean"):
        conv = SAGEConv(6, 3, aggr=aggr, root_weight=False).eval()
        with torch.no_grad():
            got = split_and_merge(split_layer(conv, 0), x, ei, 2, parts=2, seed=0)
            assert torch.allclose(got, apply_conv(conv, x, ei, 2), atol=1e-6)


def test_gat_merge_is_stable_for_huge_logits():
    conv = GATConv(6, 3, heads=2).eval()
    with torch.no_grad():
        conv.att_src.mul_(400.0)
        ei, x = block(3)
        edges = with_gat_loops(ei, 9)
        got = split_and_merge(split_layer(conv, 0), x, edges, 9, parts=3, seed=1)
        assert torch.isfinite(got).all()
        assert torch.allclose(got, apply_conv(conv, x, ei, 9), atol=1e-4)


def test_layers_without_a_merge_function_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"layer 1 \(GINConv\) has no merge function") as err:
        split_layer(GINConv(torch.nn.Linear(4, 4)), 1)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="aggr='std'"):
        split_layer(SAGEConv(4, 4, aggr="std"), 0)
    # GAT's merge sums its softmax-weighted messages: a mean of them (servable on one process) has none
    with pytest.raises(ConfigError, match=r"GATConv with aggr='mean'"):
        split_layer(GATConv(4, 4, heads=2, aggr="mean"), 0)


def test_layers_whose_merge_is_not_the_one_here_are_refused():
    """An edge-featured GAT weighs its logits by edge features the parts do not send, and
    a subclass of SAGEConv may message otherwise: neither is split as the plain layer."""
    with pytest.raises(ConfigError, match=r"layer 0 \(GATConv with aggr='add'\) has no merge function"):
        split_layer(GATConv(4, 4, heads=2, edge_dim=3), 0)

    class Scaled(SAGEConv):
        def message(self, x_j):
            return 2 * x_j

    with pytest.raises(ConfigError, match=r"layer 2 \(Scaled\) has no merge function"):
        split_layer(Scaled(4, 4), 2)
