"""Layer decomposition: expose a model as a stack of message-passing layers with per-node
operations between them (`layer(i, ...)`), which layer-wise precompute and new-node
evaluation need. hybridgnn's own GNN already is one; PyG's BasicGNN models (GraphSAGE,
GCN, GAT, GIN, ... from torch_geometric.nn.models) are wrapped without copying weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch_geometric.nn import GCNConv
from torch_geometric.nn import Linear as PygLinear

from hybridgnn.models.gnn import GNN, apply_conv, head_input, stack_forward


class LayerStack(nn.Module):
    """A PyG BasicGNN seen layer by layer: conv i, then (before the last layer, or after
    every layer with jumping knowledge) its norm, activation and dropout exactly as
    BasicGNN.forward applies them. With jumping knowledge the output mixes a node's rows
    of every layer: `readout` (JK, then the linear head) runs on them, per node, after
    the last layer."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if getattr(model, "jk_mode", None) not in (None, "last", "cat", "max", "lstm"):
            raise ValueError(f"jumping knowledge jk={model.jk_mode!r} is not supported")
        self.model = model
        self.convs = model.convs
        kinds = {isinstance(c, GCNConv) for c in self.convs}
        if len(kinds) > 1:
            raise ValueError("mixing GCNConv with other convolutions is not supported")
        self._gcn = kinds == {True}

    @property
    def num_layers(self) -> int:
        return len(self.convs)

    @property
    def gcn_normalised(self) -> bool:
        return self._gcn

    @property
    def in_dim(self) -> int:
        return input_width(self.model)

    @property
    def out_dim(self) -> int:
        return int(self.model.out_channels)

    @property
    def readout_needed(self) -> bool:
        """Whether the output is more than the last layer's rows (jumping knowledge: JK,
        then the linear head): see readout."""
        return self.model.jk_mode is not None

    def _jk(self, layers: list[torch.Tensor]) -> torch.Tensor:
        return layers[-1] if self.model.jk_mode == "last" else self.model.jk(layers)

    def readout(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """The model's output from each layer's rows of the same nodes (jk, then the head)."""
        if not self.readout_needed:
            return layers[-1]
        return self.model.lin(self._jk(layers))

    def embedding(self, layers: list[torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        """The hidden representation the head reads: the jumping-knowledge output, or the
        last layer's input (see models.gnn.head_input)."""
        if self.readout_needed:
            return self._jk(layers)
        return head_input(layers, inputs)

    def between_layers(self, i: int, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        last = i == self.num_layers - 1
        if last and m.jk_mode is None:
            return x
        if m.act is not None and m.act_first:
            x = m.act(x)
        x = m.norms[i](x)
        if m.act is not None and not m.act_first:
            x = m.act(x)
        return m.dropout(x)  # with jumping knowledge the head runs in readout

    def layer(self, i: int, x_src: torch.Tensor, edge_index: torch.Tensor, num_targets: int,
              gcn_weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.between_layers(i, apply_conv(self.convs[i], x_src, edge_index, num_targets, gcn_weight))

    def forward(self, x, edge_index, num_sampled_nodes=None, num_sampled_edges=None, degrees=None, *,
                with_embeddings: bool = False):
        return stack_forward(self, x, edge_index, num_sampled_nodes, num_sampled_edges, degrees,
                             with_embeddings=with_embeddings)


def input_width(model: nn.Module):
    """A BasicGNN's feature width: in_channels, or for a lazy model (in_channels=-1) the
    width its first layer took on its first forward; ValueError (one line) before that.
    A bipartite (tuple) in_channels is returned as it is."""
    width = model.in_channels
    if not isinstance(width, int) or width > 0:
        return width
    # the first layer's first linear map reads the features (SAGE lin_l, GAT/GCN lin, GIN's MLP);
    # the golden check confirms the width
    first = next((m for m in model.convs[0].modules() if isinstance(m, PygLinear)), None)
    if first is None or int(first.in_channels) <= 0:
        raise ValueError(f"{type(model).__name__} has lazy in_channels={width} and has not run yet, so its feature "
                         "width is unknown: run one forward pass first, or give in_channels")
    return int(first.in_channels)


def decompose(model: nn.Module):
    """The layer-by-layer view of a model, or a clear error when it has none."""
    if isinstance(model, (GNN, LayerStack)):
        return model
    if hasattr(model, "convs") and hasattr(model, "norms") and hasattr(model, "act"):
        return LayerStack(model)
    raise ValueError(f"{type(model).__name__} is not a stack of message-passing layers hybridgnn can decompose; "
                     "use hybridgnn.models.GNN or a torch_geometric.nn.models BasicGNN")
