"""Heterogeneous graphs and models for tests: a generated graph's whole-graph tensors,
and PyG models of each kind hybridgnn serves, trained on nothing (their weights are
random; exactness does not need training)."""

from __future__ import annotations

import numpy as np
import torch
from torch_geometric.nn import (
    GATConv,
    GraphConv,
    GraphSAGE,
    HeteroConv,
    Linear,
    SAGEConv,
    to_hetero,
)


def whole(graph):
    """(x per type, edge_index per edge type) of a HeteroGraphStore, for a plain PyG forward."""
    x = {t: torch.from_numpy(np.array(n.features)) for t, n in graph.nodes.items()}
    ei = {}
    for e, d in graph.edges.items():
        dst = np.repeat(np.arange(d.indptr.shape[0] - 1), np.diff(d.indptr))
        ei[e] = torch.from_numpy(np.stack([np.asarray(d.indices, dtype=np.int64), dst]))
    return x, ei


class HeteroSAGE(torch.nn.Module):
    """A user's own HeteroConv model: convs, relu between layers, a head per type."""

    def __init__(self, metadata, out_types, out_channels: int = 3):
        super().__init__()
        self.convs = torch.nn.ModuleList([
            HeteroConv({e: (GraphConv(-1, 16) if e[0] == e[2] else SAGEConv((-1, -1), 16)) for e in metadata[1]},
                       aggr=aggr) for aggr in ("sum", "mean")])
        self.lin = torch.nn.ModuleDict({t: Linear(-1, out_channels) for t in out_types})

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = {t: v.relu() for t, v in x.items()}
        return {t: self.lin[t](v) if t in self.lin else v for t, v in x.items()}


class OwnGNN(torch.nn.Module):
    """A user's own homogeneous module, as PyG's to_hetero tutorial writes one: lazy
    convolutions, a functional or module activation, dropout, a Linear head."""

    def __init__(self, conv: str = "sage", act: str = "relu", head: bool = True):
        super().__init__()
        make = {"sage": lambda: SAGEConv((-1, -1), 16),
                "gat": lambda: GATConv((-1, -1), 8, heads=2, add_self_loops=False)}[conv]
        self.conv1, self.conv2 = make(), make()
        self.act = torch.nn.ELU() if act == "elu-module" else None
        self.drop = torch.nn.Dropout(0.3)
        self.lin = Linear(-1, 5) if head else None

    def forward(self, x, edge_index):
        x = self.conv1(x, edge_index)
        x = self.act(x) if self.act is not None else x.relu()
        x = self.drop(x)
        x = self.conv2(x, edge_index)
        return self.lin(self.drop(x)) if self.lin is not None else x  # dropout before the head, too


class MLPDecoder(torch.nn.Module):
    """A user's own link decoder, as PyG's link-prediction examples write them."""

    def __init__(self, width: int, hidden: int = 8):
        super().__init__()
        self.lin1 = torch.nn.Linear(2 * width, hidden)
        self.lin2 = torch.nn.Linear(hidden, 1)

    def forward(self, z_src, z_dst):
        z = torch.cat([z_src, z_dst], dim=-1)
        return self.lin2(self.lin1(z).relu()).view(-1)


def built(model, graph, seed: int = 0):
    """model with its lazy sizes materialised (one forward, as training would), in eval mode."""
    torch.manual_seed(seed)
    x, ei = whole(graph)
    with torch.no_grad():
        model(x, ei)
    return model.eval()


def sage(graph, out_channels: int = 8):
    return to_hetero(GraphSAGE((-1, -1), 16, num_layers=2, out_channels=out_channels), graph.metadata(), aggr="sum")
