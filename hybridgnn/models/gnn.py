"""GraphSAGE, GCN and GAT as a stack of PyG message-passing layers with per-node
operations (activation, dropout) between them.

forward() takes a sampled subgraph in PyG's hop order and trims it per layer: layer i
(of L) only needs targets within L-i-1 hops of the seeds and the edges into them, which
are prefixes of the node and edge arrays (SAGE, GAT; GCN's degree normalisation needs
the whole sample, so it is not trimmed). The layer stack is exposed (`layer`) so
layer-wise inference can run one layer over all nodes at a time.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GATConv, GATv2Conv, GCNConv, GINConv, GraphConv, SAGEConv

MODEL_KINDS = ("sage", "gcn", "gat")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture; out_dim is the number of classes (the last layer's width)."""

    kind: str
    in_dim: int
    hidden_dim: int
    out_dim: int
    num_layers: int = 2
    heads: int = 4
    dropout: float = 0.5

    def __post_init__(self):
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        for name in ("in_dim", "hidden_dim", "out_dim", "num_layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "gat" and self.hidden_dim % self.heads:
            raise ValueError(f"GAT hidden_dim ({self.hidden_dim}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be within [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


# Sparse CSR products are stable for what is used here (CSR times dense, CPU and CUDA).
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")

# Convolutions that take a (source, target) pair, so a layer computes only its targets.
BIPARTITE_CONVS = (SAGEConv, GATConv, GATv2Conv, GINConv, GraphConv)


def apply_conv(conv: nn.Module, x_src: torch.Tensor, edge_index: torch.Tensor, num_targets: int,
               gcn_weight: torch.Tensor | None = None) -> torch.Tensor:
    """One message-passing layer on a block whose first num_targets sources are the targets;
    returns the targets' rows. gcn_weight: see GNN.layer."""
    if gcn_weight is not None:
        if not isinstance(conv, GCNConv):
            raise ValueError("gcn_weight applies to GCN layers only")
        out = _weighted_sum_then_linear(conv, x_src, edge_index, num_targets, gcn_weight)
        return out + conv.bias if conv.bias is not None else out
    if isinstance(conv, GATv2Conv):  # takes no size: the pair's lengths give it
        return conv((x_src, x_src[:num_targets]), edge_index)
    if isinstance(conv, BIPARTITE_CONVS):
        return conv((x_src, x_src[:num_targets]), edge_index, size=(x_src.shape[0], num_targets))
    return conv(x_src, edge_index)[:num_targets]


def _weighted_sum_then_linear(conv: GCNConv, x_src: torch.Tensor, edge_index: torch.Tensor, num_targets: int,
                              weight: torch.Tensor) -> torch.Tensor:
    """Σ_j w_ij · (x_j W) over a block, in the cheaper order: the linear map commutes with
    the weighted sum, so aggregate the inputs into the targets first and transform only
    the targets when that costs fewer multiply-adds (many sources, few targets: a request's
    block), else transform every source first (PyG's order)."""
    num_src, f_in = x_src.shape
    f_out = conv.lin.weight.shape[0]
    edges = edge_index.shape[1]
    aggregate_first = edges * f_in + num_targets * f_in * f_out < num_src * f_in * f_out + edges * f_out
    src, dst = edge_index[0], edge_index[1]
    if aggregate_first and (edges == 0 or int(dst.max()) < num_targets):
        # A CSR matrix times the inputs (one fused sparse-dense product, several times faster
        # than gather, scale and index_add); blocks arrive as a few sorted runs of targets,
        # which a stable sort orders almost for free.
        if dst.device.type == "cpu":
            order = torch.from_numpy(np.argsort(dst.numpy(), kind="stable"))
        else:
            order = torch.argsort(dst, stable=True)
        crow = torch.zeros(num_targets + 1, dtype=torch.int64, device=dst.device)
        torch.cumsum(torch.bincount(dst, minlength=num_targets), 0, out=crow[1:])
        adj = torch.sparse_csr_tensor(crow, src[order], weight[order].to(x_src.dtype), (num_targets, num_src),
                                      check_invariants=False)
        return conv.lin(adj @ x_src)
    return conv.propagate(edge_index, x=conv.lin(x_src), edge_weight=weight)[:num_targets]


def gcn_norm_degrees(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(normalising degree, has self-loop) per node as PyG's gcn_norm sees a whole graph
    of (source, target) edges: in-degree, plus the self-loop add_remaining_self_loops adds
    to every node that lacks one."""
    src, dst = edge_index
    has_loop = np.zeros(num_nodes, dtype=bool)
    has_loop[dst[src == dst]] = True
    return np.bincount(dst, minlength=num_nodes) + (~has_loop), has_loop


def gcn_edge_weights(edge_index: np.ndarray, sources: np.ndarray, num_targets: int, norm_degree: np.ndarray,
                     has_loop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block (local edges over `sources`, whose first num_targets are the targets) plus
    a self-loop for each target that lacks one, with gcn_norm's whole-graph weights
    1/sqrt(d_u d_v): what GNN.layer's gcn_weight expects."""
    loops = np.flatnonzero(~has_loop[sources[:num_targets]])
    ei = np.concatenate([edge_index, np.stack([loops, loops])], axis=1)
    inv_sqrt = 1.0 / np.sqrt(norm_degree[sources].astype(np.float64))
    w = inv_sqrt[ei[0]] * inv_sqrt[ei[1]]
    return ei, w.astype(np.float32)


def _conv(spec: ModelSpec, in_dim: int, out_dim: int, last: bool) -> nn.Module:
    if spec.kind == "sage":
        return SAGEConv(in_dim, out_dim)
    if spec.kind == "gcn":
        return GCNConv(in_dim, out_dim)
    heads = 1 if last else spec.heads
    return GATConv(in_dim, out_dim // heads, heads=heads, concat=True, add_self_loops=True)


class GNN(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        dims = [spec.in_dim] + [spec.hidden_dim] * (spec.num_layers - 1) + [spec.out_dim]
        self.convs = nn.ModuleList(
            _conv(spec, dims[i], dims[i + 1], last=(i == spec.num_layers - 1)) for i in range(spec.num_layers)
        )

    @property
    def num_layers(self) -> int:
        return len(self.convs)

    @property
    def gcn_normalised(self) -> bool:
        """Whether layers normalise by degree (GCN): whole-graph blocks then pass gcn_weight."""
        return self.spec.kind == "gcn"

    def layer(self, i: int, x_src: torch.Tensor, edge_index: torch.Tensor, num_targets: int,
              gcn_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i on a graph whose first num_targets source rows are the targets; returns the
        targets' outputs, activation and dropout included (none after the last layer).

        gcn_weight (GCN only): normalised edge weights, self-loops included in edge_index,
        computed from whole-graph degrees; the layer then skips PyG's in-subgraph
        normalisation, so a 1-hop block gives exactly the whole-graph result."""
        return self.between_layers(i, apply_conv(self.convs[i], x_src, edge_index, num_targets, gcn_weight))

    def between_layers(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """The per-node operations after layer i (none after the last)."""
        if i < self.num_layers - 1:
            out = F.relu(out)
            out = F.dropout(out, p=self.spec.dropout, training=self.training)
        return out

    readout_needed = False  # the last layer's rows are the output

    def readout(self, layers: list[torch.Tensor]) -> torch.Tensor:
        return layers[-1]

    def embedding(self, layers: list[torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        """The hidden representation the last layer (the head) reads: see head_input."""
        return head_input(layers, inputs)

    @property
    def in_dim(self) -> int:
        return self.spec.in_dim

    @property
    def out_dim(self) -> int:
        return self.spec.out_dim

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, num_sampled_nodes=None, num_sampled_edges=None,
                degrees=None, *, with_embeddings: bool = False):
        """x rows follow the sample's node order; without per-hop counts every layer runs on
        the whole graph (full-graph inference). See stack_forward."""
        return stack_forward(self, x, edge_index, num_sampled_nodes, num_sampled_edges, degrees,
                             with_embeddings=with_embeddings)


def stack_forward(stack, x: torch.Tensor, edge_index: torch.Tensor, num_sampled_nodes=None,
                  num_sampled_edges=None, degrees: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                  with_embeddings: bool = False):
    """Run a layer stack (anything with num_layers, layer(), readout(), embedding() and
    gcn_normalised) on the whole graph, or on a sample in hop order (per-hop node and edge
    counts), returning the seeds' logits (and, with_embeddings, (logits, embeddings): see
    `head_input`); layer i then only computes targets within L-i-1 hops of the seeds.

    degrees (GCN): whole-graph (in-degree, has self-loop) of every sample node. Each
    target's sampled neighbours are then weighted as gcn_norm weights them in the whole
    graph and scaled by in-degree / sampled count, so the aggregate estimates the full
    neighbourhood's without bias, equals it when every neighbour was sampled, and does
    not depend on which other seeds share the batch. Without it a GCN sample is
    normalised by its own degrees (PyG's behaviour on a sampled subgraph, as in training)."""
    keep_all = stack.readout_needed or with_embeddings  # else only the last layer's rows matter
    if num_sampled_nodes is None:
        inputs, outs = x, []
        for i in range(stack.num_layers):
            x = stack.layer(i, x, edge_index, x.shape[0])
            outs = [*outs, x] if keep_all else [x]
        return _heads(stack, outs, inputs, with_embeddings)
    nodes = [int(v) for v in num_sampled_nodes]
    edges = [int(v) for v in num_sampled_edges]
    hops = len(edges)
    if hops < stack.num_layers:
        raise ValueError(f"sample has {hops} {'hop' if hops == 1 else 'hops'} but the model has {stack.num_layers} "
                         "layers")
    cum_nodes = [sum(nodes[: k + 1]) for k in range(len(nodes))]
    cum_edges = [sum(edges[:k]) for k in range(len(edges) + 1)]
    depth, seeds = stack.num_layers, cum_nodes[0]
    x = x[: cum_nodes[depth]]
    inputs, outs = x[:seeds], []  # the seeds' rows of every layer (seeds come first at every layer)
    if stack.gcn_normalised and degrees is None:
        # In-subgraph degrees: dropping outer edges would change the degrees of inner
        # nodes, so every layer runs on the whole sample.
        edge_index = edge_index[:, : cum_edges[depth]]
        for i in range(stack.num_layers):
            x = stack.layer(i, x, edge_index, x.shape[0])
            outs = [*outs, x[:seeds]] if keep_all else [x[:seeds]]
        return _heads(stack, outs, inputs, with_embeddings)
    for i in range(stack.num_layers):
        remaining = depth - i  # this layer's targets lie within remaining-1 hops
        block, targets = edge_index[:, : cum_edges[remaining]], cum_nodes[remaining - 1]
        weight = None
        if stack.gcn_normalised:
            block, weight = sampled_gcn_weights(block, targets, *degrees)
        x = stack.layer(i, x, block, targets, gcn_weight=weight)
        outs = [*outs, x[:seeds]] if keep_all else [x[:seeds]]
    return _heads(stack, outs, inputs, with_embeddings)


def _heads(stack, outs, inputs, with_embeddings: bool):
    logits = stack.readout(outs)
    return (logits, stack.embedding(outs, inputs)) if with_embeddings else logits


def embedding_width(stack) -> int:
    """The width of a stack's `embedding` output, by running it on one edgeless node."""
    x = torch.zeros(1, stack.in_dim)
    with torch.inference_mode():
        return int(stack_forward(stack, x, torch.zeros(2, 0, dtype=torch.long), with_embeddings=True)[1].shape[1])


def head_input(layers: list, inputs):
    """What the head of a model without jumping knowledge (its last layer) reads, from a
    node's rows of every layer: layer L-1's rows, or the features of a 1-layer model."""
    return layers[-2] if len(layers) >= 2 else inputs


def sampled_gcn_weights(block: torch.Tensor, num_targets: int, in_degree: torch.Tensor,
                        has_loop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled block plus the self-loops gcn_norm adds, with weights
    (d_v / s_v) / sqrt(d^_u d^_v) on sampled edges u -> v (d: whole-graph in-degree, s: sampled
    in-edges, d^ = d + 1 without a self-loop) and 1 / d^_v on the added loops."""
    src, dst = block[0], block[1]
    deg = in_degree.to(torch.float64)
    inv_sqrt = (deg + (~has_loop).to(torch.float64)).clamp_(min=1).rsqrt()
    sampled = torch.bincount(dst, minlength=num_targets).to(torch.float64).clamp_(min=1)
    scale = deg[:num_targets] / sampled
    w = scale[dst] * inv_sqrt[src] * inv_sqrt[dst]
    loops = torch.nonzero(~has_loop[:num_targets]).squeeze(1)
    block = torch.cat([block, torch.stack([loops, loops])], dim=1)
    w = torch.cat([w, inv_sqrt[loops].square()])
    return block, w.to(torch.float32)


def build_model(spec: ModelSpec) -> GNN:
    return GNN(spec)
