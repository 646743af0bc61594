"""Message-passing layers split into local aggregation, merge and finish (Reforge §VI-B),
so that each rank aggregates the in-edges whose sources it holds and one rank, the
target's home, merges the parts into exactly the layer's output.

A layer's partial state for one target is a row of `width` floats:

    SAGE mean / sum   [Σ x_j, count]          merged by adding; mean divides by the count
    SAGE max          [max x_j, count]        merged by max over parts that saw an edge
    GCN               [Σ w_uv x_u]            merged by adding (w from whole-graph degrees)
    GAT               [Σ e^(l-m) W x_j, Σ e^(l-m), m] per head, m the part's largest logit,
                      merged stably: rescale each part by e^(m - max m) and divide

Self-loops are the home rank's business (it holds the target's own row): `self_loops`
says which targets get one. Decisions (which edges, which rank) stay with the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from hybridgnn.errors import ConfigError


def _scatter_sum(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *values.shape[1:]), dtype=values.dtype)
    return out.index_add_(0, index, values)


def _scatter_max(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-row maximum; rows without values are -inf."""
    out = torch.full((rows, *values.shape[1:]), float("-inf"), dtype=values.dtype)
    expanded = index.view(-1, *([1] * (values.dim() - 1))).expand_as(values)
    return out.scatter_reduce_(0, expanded, values, "amax", include_self=True)


class _PlainSplit:
    """A layer whose parts need nothing of the target but its home's row."""

    self_loops = "none"
    weighted = False
    needs_target_info = False

    def target_info(self, x_targets: torch.Tensor) -> None:
        return None


class SageSplit(_PlainSplit):
    """SAGEConv with mean, sum or max aggregation (project and normalize included)."""

    def __init__(self, conv: SAGEConv):
        self.conv = conv
        self.aggr = {"add": "sum"}.get(conv.aggr, conv.aggr)
        self.in_dim = conv.lin_l.in_channels
        self.width = self.in_dim + 1

    def local(self, x_src, src, dst, num_targets, info=None, weight=None) -> torch.Tensor:
        if self.conv.project:
            x_src = self.conv.lin(x_src).relu()
        msgs = x_src[src]
        agg = (_scatter_max(msgs, dst, num_targets) if self.aggr == "max"
               else _scatter_sum(msgs, dst, num_targets))
        count = torch.bincount(dst, minlength=num_targets).to(agg.dtype).unsqueeze(1)
        return torch.cat([agg, count], dim=1)

    def finish(self, idx, parts, num_targets, x_targets) -> torch.Tensor:
        values, count = parts[:, :-1], parts[:, -1:]
        total = _scatter_sum(count, idx, num_targets)
        if self.aggr == "max":
            agg = _scatter_max(values, idx, num_targets)
            agg = torch.where(total > 0, agg, torch.zeros_like(agg))
        else:
            agg = _scatter_sum(values, idx, num_targets)
            if self.aggr == "mean":
                agg = agg / total.clamp(min=1)
        out = self.conv.lin_l(agg)
        if self.conv.root_weight:
            out = out + self.conv.lin_r(x_targets)
        if self.conv.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out


class GcnSplit(_PlainSplit):
    """GCNConv with whole-graph degree weights (the caller supplies w_uv per edge)."""

    self_loops = "missing"
    weighted = True

    def __init__(self, conv: GCNConv):
        self.conv = conv
        self.width = conv.lin.in_channels

    def local(self, x_src, src, dst, num_targets, info=None, weight=None) -> torch.Tensor:
        return _scatter_sum(x_src[src] * weight.unsqueeze(1), dst, num_targets)

    def finish(self, idx, parts, num_targets, x_targets) -> torch.Tensor:
        out = self.conv.lin(_scatter_sum(parts, idx, num_targets))
        return out + self.conv.bias if self.conv.bias is not None else out


class GatSplit:
    """GATConv (shared or separate source/target maps, concat or mean over heads,
    residual, no edge features): each part sends its unnormalised softmax sum, exp-sum
    and largest logit per head."""

    weighted = False
    needs_target_info = True

    def __init__(self, conv: GATConv):
        self.conv = conv
        self.self_loops = "all" if conv.add_self_loops else "none"
        self.heads, self.channels = conv.heads, conv.out_channels
        self.lin_src = conv.lin if conv.lin is not None else conv.lin_src
        self.lin_dst = conv.lin if conv.lin is not None else conv.lin_dst
        self.width = self.heads * self.channels + 2 * self.heads

    def target_info(self, x_targets: torch.Tensor) -> torch.Tensor:
        """Each target's half of the attention logit, [T, heads]: every rank with an
        edge into the target needs it."""
        h = self.lin_dst(x_targets).view(-1, self.heads, self.channels)
        return (h * self.conv.att_dst).sum(-1)

    def local(self, x_src, src, dst, num_targets, info=None, weight=None) -> torch.Tensor:
        H, C = self.heads, self.channels
        h = self.lin_src(x_src).view(-1, H, C)
        alpha_src = (h * self.conv.att_src).sum(-1)
        logit = F.leaky_relu(alpha_src[src] + info[dst], self.conv.negative_slope)
        top = _scatter_max(logit, dst, num_targets)
        e = torch.exp(logit - top[dst])
        exp_sum = _scatter_sum(e, dst, num_targets)
        agg = _scatter_sum(e.unsqueeze(-1) * h[src], dst, num_targets).view(num_targets, H * C)
        return torch.cat([agg, exp_sum, top], dim=1)

    def finish(self, idx, parts, num_targets, x_targets) -> torch.Tensor:
        H, C = self.heads, self.channels
        agg = parts[:, : H * C].view(-1, H, C)
        exp_sum, top = parts[:, H * C: H * C + H], parts[:, H * C + H:]
        best = _scatter_max(top, idx, num_targets)
        scale = torch.exp(top - best[idx])
        num = _scatter_sum(agg * scale.unsqueeze(-1), idx, num_targets)
        den = _scatter_sum(exp_sum * scale, idx, num_targets)
        out = num / (den.unsqueeze(-1) + 1e-16)  # PyG's softmax adds the same guard
        out = out.reshape(num_targets, H * C) if self.conv.concat else out.mean(dim=1)
        if self.conv.res is not None:
            out = out + self.conv.res(x_targets)
        return out + self.conv.bias if self.conv.bias is not None else out


def split_layer(conv, index: int):
    """The split form of one layer, or ConfigError naming what has no merge function."""
    kind = type(conv).__name__
    if type(conv) is SAGEConv and isinstance(conv.aggr, str) and conv.aggr in ("mean", "max", "sum", "add"):
        return SageSplit(conv)
    if type(conv) is GCNConv:
        return GcnSplit(conv)
    # GAT's merge sums the softmax-weighted messages (and GCN's its normalised ones): another
    # aggregation (GAT(aggr="mean") is servable on one process) has no merge here
    summed = conv.aggr in ("add", "sum") if isinstance(conv.aggr, str) else False
    if type(conv) is GATConv and conv.edge_dim is None and summed:
        return GatSplit(conv)
    detail = f" with aggr={conv.aggr!r}" if type(conv) in (SAGEConv, GATConv) else ""
    raise ConfigError(f"layer {index} ({kind}{detail}) has no merge function for partitioned serving "
                      "(supported: SAGEConv mean/sum/max, GCNConv, GATConv with its sum); serve it without "
                      "--partitions")


def split_model(model) -> list:
    """Every layer of a decomposed model in split form (ConfigError on the first that has
    none)."""
    return [split_layer(conv, i) for i, conv in enumerate(model.convs)]
