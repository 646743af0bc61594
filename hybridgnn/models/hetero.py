"""Heterogeneous models: one convolution per edge type and layer, messages of every edge
type into a node type combined by a cross-type aggregation, a per-type activation between
layers and optional per-type linear heads (HeteroGNN).

PyG users build these with `to_hetero(BasicGNN, metadata, aggr)` (or of their own
module) or with `HeteroConv` layers; `candidates_from_pyg` reads either back as HeteroGNN
descriptions (JSON; one per option the modules do not record, such as to_hetero's
cross-type aggregation) plus a state_dict mapped onto them, so a model directory names an
architecture and never code. Whatever it cannot read exactly (other convolutions, norms,
jumping knowledge) is refused in one line; saving keeps the description that reproduces
the model's own forward on a generated graph (hetero_checkpoint.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch_geometric.nn import GATConv, GraphConv, SAGEConv
from torch_geometric.nn import Linear as PygLinear
from torch_geometric.nn.resolver import activation_resolver

from hybridgnn.models.zoo import (
    ACTIVATIONS,
    AGGREGATIONS,
    UnsupportedModel,
    _activation,
)
from hybridgnn.types import EdgeType

CROSS_AGGRS = ("sum", "mean", "max", "min")
# Activations tried between the layers of to_hetero(<the user's own module>), where the
# forward calls a function (x.relu(), F.elu(x)) that no module records.
USER_ACTIVATIONS = ("relu", "elu", "leaky_relu", "gelu", "tanh", "sigmoid", "silu", None)
CONVS: dict[str, type[nn.Module]] = {"sage": SAGEConv, "gat": GATConv, "graph": GraphConv}


def edge_key(edge_type: EdgeType) -> str:
    return "__".join(edge_type)


def _widths(conv: nn.Module) -> tuple[int, int]:
    """(source width, target width) a materialised convolution reads; UnsupportedModel
    while a lazy (-1) size is still unknown."""
    if isinstance(conv, SAGEConv):
        src = conv.lin_l.weight
        dst = conv.lin_r.weight if conv.root_weight else None
    elif isinstance(conv, GATConv):
        src = conv.lin.weight if conv.lin is not None else conv.lin_src.weight
        dst = conv.lin.weight if conv.lin is not None else conv.lin_dst.weight
    else:
        src, dst = conv.lin_rel.weight, conv.lin_root.weight
    if isinstance(src, nn.parameter.UninitializedParameter) or isinstance(dst, nn.parameter.UninitializedParameter):
        raise UnsupportedModel("the model has lazy (-1) sizes that are still unknown: run one forward pass on your "
                               "data before saving it")
    in_src = int(src.shape[1])
    return in_src, int(dst.shape[1]) if dst is not None else -1


def conv_spec(conv: nn.Module) -> dict[str, Any]:
    """One edge type's convolution as JSON (kind and constructor arguments, sizes resolved)."""
    kind = next((k for k, cls in CONVS.items() if type(conv) is cls), None)
    if kind is None:
        raise UnsupportedModel(f"{type(conv).__name__} is not served in heterogeneous models; supported: "
                               "SAGEConv, GATConv (add_self_loops=False across types), GraphConv")
    in_src, in_dst = _widths(conv)
    tuple_in = isinstance(conv.in_channels, (tuple, list))
    in_channels: Any = [in_src, in_dst if in_dst > 0 else in_src] if tuple_in else in_src
    args: dict[str, Any] = {"in_channels": in_channels, "out_channels": int(conv.out_channels)}
    if kind == "sage":
        if conv.aggr not in AGGREGATIONS:
            raise UnsupportedModel(f"SAGEConv aggregation {conv.aggr!r} is not supported; supported: {AGGREGATIONS}")
        args.update(aggr=conv.aggr, normalize=bool(conv.normalize), root_weight=bool(conv.root_weight),
                    project=bool(conv.project), bias=conv.lin_l.bias is not None)
    elif kind == "gat":
        if conv.edge_dim is not None:
            raise UnsupportedModel("GATConv with edge_dim needs edge features, which hybridgnn does not serve")
        if conv.add_self_loops:
            # loops would join a target row to the source row of the same position, which
            # only holds when both are the same nodes (never across types, nor in batches)
            raise UnsupportedModel("GATConv in a heterogeneous model must have add_self_loops=False (add a self "
                                   "edge type to the graph instead)")
        args.update(heads=int(conv.heads), concat=bool(conv.concat), negative_slope=float(conv.negative_slope),
                    add_self_loops=bool(conv.add_self_loops), bias=conv.bias is not None,
                    residual=bool(conv.residual))
    else:
        if conv.aggr not in AGGREGATIONS:
            raise UnsupportedModel(f"GraphConv aggregation {conv.aggr!r} is not supported; supported: {AGGREGATIONS}")
        args.update(aggr=conv.aggr, bias=conv.lin_rel.bias is not None)
    return {"kind": kind, "args": args}


def build_conv(spec: dict[str, Any]) -> nn.Module:
    args = dict(spec["args"])
    if isinstance(args["in_channels"], list):
        args["in_channels"] = tuple(args["in_channels"])
    return CONVS[spec["kind"]](**args)


class HeteroGNN(nn.Module):
    """Layers of per-edge-type convolutions (module docstring). Built from JSON only:
    node_types, edge_types ([src, rel, dst] lists), layers ([{"aggr": cross-type
    aggregation, "convs": {edge key: conv_spec}}]), the activation between layers (by
    name) with act_first ordering irrelevant here (no norms), and heads ({node type:
    [in, out, bias]}: a Linear after the last layer)."""

    def __init__(self, node_types: list[str], edge_types: list[list[str]], layers: list[dict],
                 act: str | None = "relu", act_kwargs: dict | None = None, heads: dict | None = None):
        super().__init__()
        self.node_types = list(node_types)
        self.edge_types: list[EdgeType] = [tuple(e) for e in edge_types]  # type: ignore[misc]
        self._key_of = {e: f"e{j}" for j, e in enumerate(self.edge_types)}  # '.'-free ModuleDict keys
        self.aggrs = [layer["aggr"] for layer in layers]
        for aggr in self.aggrs:
            if aggr not in CROSS_AGGRS:
                raise UnsupportedModel(f"cross-type aggregation {aggr!r} is not supported; supported: {CROSS_AGGRS}")
        by_key = {edge_key(e): e for e in self.edge_types}
        self.convs = nn.ModuleList()
        self.layer_edges: list[list[EdgeType]] = []
        for layer in layers:
            unknown = [k for k in layer["convs"] if k not in by_key]
            if unknown:
                raise UnsupportedModel(f"convolutions for edge types {unknown} that the metadata does not list")
            edges = [e for e in self.edge_types if edge_key(e) in layer["convs"]]
            self.layer_edges.append(edges)
            self.convs.append(nn.ModuleDict({self._key_of[e]: build_conv(layer["convs"][edge_key(e)]) for e in edges}))
        self.act = activation_resolver(act, **(act_kwargs or {})) if act is not None else None
        self.heads = nn.ModuleDict({t: nn.Linear(i, o, bias=b) for t, (i, o, b) in (heads or {}).items()})

    @property
    def num_layers(self) -> int:
        return len(self.convs)

    def conv(self, i: int, edge_type: EdgeType) -> nn.Module:
        return self.convs[i][self._key_of[edge_type]]

    def layer(self, i: int, x: dict[str, torch.Tensor], edge_index: dict[EdgeType, torch.Tensor],
              x_dst: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Layer i: every edge type's convolution, combined per target type, then the
        activation unless it is the last layer. x holds the source rows; x_dst the target
        rows when they are other rows (default: x, i.e. sources and targets are the same
        nodes, as over a whole graph or a whole sample)."""
        x_dst = x if x_dst is None else x_dst
        parts: dict[str, list[torch.Tensor]] = {}
        for e in self.layer_edges[i]:
            s, _, t = e
            if s not in x or t not in x_dst or e not in edge_index:
                continue
            inputs = x[s] if (s == t and x_dst is x) else (x[s], x_dst[t])
            parts.setdefault(t, []).append(self.conv(i, e)(inputs, edge_index[e]))
        out = {t: _combine(v, self.aggrs[i]) for t, v in parts.items()}
        if i < self.num_layers - 1 and self.act is not None:
            out = {t: self.act(v) for t, v in out.items()}
        return out

    def head(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The last layer's rows through each type's head (types without one pass through)."""
        return {t: self.heads[t](v) if t in self.heads else v for t, v in x.items()}

    def forward(self, x: dict[str, torch.Tensor], edge_index: dict[EdgeType, torch.Tensor]) -> dict[str, torch.Tensor]:
        for i in range(self.num_layers):
            x = self.layer(i, x, edge_index)
        return self.head(x)

    def forward_sampled(self, x: dict[str, torch.Tensor], edge_index: dict[EdgeType, torch.Tensor],
                        nodes_per_hop: dict[str, list[int]], edges_per_hop: dict[EdgeType, list[int]]):
        """(last layer's rows, head's rows) of a typed sample's first nodes: layer i computes
        only targets within L-1-i hops, over the edges drawn from them (PyG's
        trim_to_layer), so the seeds' rows equal the whole sample's forward. The sample
        lists each type's nodes by hop (nodes_per_hop) and each edge type's edges by the
        hop they were drawn at (edges_per_hop), as the typed samplers give them."""
        node_ends = {t: np.cumsum(v).tolist() for t, v in nodes_per_hop.items()}
        edge_ends = {e: np.cumsum(v).tolist() for e, v in edges_per_hop.items()}
        last = self.num_layers - 1
        for i in range(self.num_layers):
            hop = last - i  # the farthest hop whose targets layer i computes
            x_dst = {t: v[: node_ends[t][min(hop, len(node_ends[t]) - 1)]] for t, v in x.items()}
            edges = {e: ei[:, : edge_ends[e][hop]] if hop < len(edge_ends[e]) else ei
                     for e, ei in edge_index.items()}
            x = self.layer(i, x, edges, x_dst)
        return x, self.head(x)


def _combine(values: list[torch.Tensor], aggr: str) -> torch.Tensor:
    if len(values) == 1:
        return values[0]
    stacked = torch.stack(values)
    if aggr == "sum":
        return stacked.sum(0)
    if aggr == "mean":
        return stacked.mean(0)
    return stacked.amax(0) if aggr == "max" else stacked.amin(0)


def _head_spec(lin) -> list:
    """[in, out, bias] of a torch.nn.Linear or torch_geometric.nn.Linear (same weights)."""
    if type(lin) not in (nn.Linear, PygLinear):
        raise UnsupportedModel(f"a head must be a torch.nn.Linear or torch_geometric.nn.Linear, got "
                               f"{type(lin).__name__}")
    if isinstance(lin.weight, nn.parameter.UninitializedParameter):
        raise UnsupportedModel("the model's head has a lazy (-1) size that is still unknown: run one forward pass "
                               "on your data before saving it")
    return [int(lin.weight.shape[1]), int(lin.weight.shape[0]), lin.bias is not None]


def _layers_from(convs_per_layer: list[dict[EdgeType, nn.Module]], aggrs: list[str]):
    layers, state = [], {}
    for i, (convs, aggr) in enumerate(zip(convs_per_layer, aggrs, strict=True)):
        layers.append({"aggr": aggr, "convs": {edge_key(e): conv_spec(c) for e, c in convs.items()}})
        for e, c in convs.items():
            state[e, i] = c.state_dict()
    return layers, state


def candidates_from_pyg(model: nn.Module, metadata) -> tuple[list[dict[str, Any]], dict]:
    """Descriptions of `model` as HeteroGNN arguments (one per unknown the modules do not
    record, e.g. to_hetero's cross-type aggregation), and the weights to load into each
    (weights(hetero) copies them). UnsupportedModel when no description can fit."""
    node_types, edge_types = list(metadata[0]), [tuple(e) for e in metadata[1]]
    convs = getattr(model, "convs", None)
    if convs is None and isinstance(model, torch.fx.GraphModule):
        pass  # to_hetero of the user's own module: read from its graph below
    elif not isinstance(convs, nn.ModuleList) or not len(convs):
        raise UnsupportedModel(f"{type(model).__name__} is not a heterogeneous model hybridgnn reads: expected "
                               "to_hetero(<a BasicGNN or your own module>) or a module whose `convs` is a "
                               "ModuleList of HeteroConv")
    from torch_geometric.nn import HeteroConv

    heads: dict[str, nn.Module] = {}
    if convs is None:  # to_hetero(the user's own module)
        per_layer, heads, act_module = _user_module_layers(model, node_types, edge_types)
        # the cross-type aggregation is never recorded, and a functional activation (x.relu())
        # is no module: every option is tried against the model's forward, and only one that
        # reproduces it is kept
        aggr_options = [[a] * len(per_layer) for a in CROSS_AGGRS]
        act_options = ([_activation(act_module)] if act_module is not None
                       else [{"act": a, "act_kwargs": None} for a in USER_ACTIVATIONS])
    elif all(isinstance(c, HeteroConv) for c in convs):  # the user's own HeteroConv model
        per_layer = [{tuple(k) if isinstance(k, tuple) else tuple(k.split("__")): m for k, m in c.convs.items()}
                     for c in convs]
        aggr_options = [[c.aggr for c in convs]]
        act = getattr(model, "act", None)
        act_options = [_activation(act)] if isinstance(act, nn.Module) else [{"act": "relu", "act_kwargs": None}]
        lin = getattr(model, "lin", None)
        if isinstance(lin, nn.ModuleDict):
            heads = dict(lin.items())
        elif lin is not None:
            raise UnsupportedModel("a HeteroConv model's head must be a ModuleDict of Linear per node type named "
                                   "`lin` (a head on one type's rows only cannot be read from the modules)")
    elif all(isinstance(c, nn.ModuleDict) for c in convs) and (
            isinstance(getattr(model, "act", None), nn.ModuleDict) or len(convs) == 1):
        # (to_hetero leaves a module its traced forward never calls as it is: the activation of
        # a one-layer BasicGNN, which it was refused for, as not a to_hetero model)
        per_layer = [{tuple(k.split("__")): m for k, m in c.items()} for c in convs]
        if getattr(model, "jk", None) is not None or "lin" in dict(model.named_children()):
            raise UnsupportedModel("to_hetero models with jumping knowledge (jk) are not served yet")
        norms = getattr(model, "norms", None)
        if norms is not None and any(not isinstance(m, nn.Identity) for layer in norms
                                     for m in (layer.values() if isinstance(layer, nn.ModuleDict) else [layer])):
            raise UnsupportedModel("to_hetero models with norms are not served yet (norm=None)")
        acts = list(model.act.values()) if isinstance(getattr(model, "act", None), nn.ModuleDict) else []
        if len({type(a) for a in acts}) > 1:
            raise UnsupportedModel("the activation differs between node types")
        act_options = [_activation(acts[0] if acts else None)]
        # to_hetero does not record its cross-type aggregation: every one is tried against
        # the model's forward, and only the one that reproduces it is kept.
        aggr_options = [[a] * len(convs) for a in CROSS_AGGRS]
    else:
        raise UnsupportedModel(f"{type(model).__name__} is not a heterogeneous model hybridgnn reads: its convs hold "
                               f"{type(convs[0]).__name__}, where HeteroConv layers or a to_hetero model were "
                               "expected (save a homogeneous model without metadata=)")
    for layer in per_layer:
        for e in layer:
            if e not in edge_types:
                raise UnsupportedModel(f"the model has a convolution for edge type {edge_key(e)!r}, which the "
                                       "metadata does not list")
    for act in act_options:
        if act["act"] is not None and act["act"] not in {n for n, _ in ACTIVATIONS.values()}:
            raise UnsupportedModel(f"activation {act['act']!r} is not supported")
    layers, state = _layers_from(per_layer, aggr_options[0])
    head_spec = {t: _head_spec(m) for t, m in heads.items()}
    options = []
    for aggrs in aggr_options:
        for act in act_options:
            options.append({"node_types": node_types, "edge_types": [list(e) for e in edge_types],
                            "layers": [{**layer, "aggr": a} for layer, a in zip(layers, aggrs, strict=True)],
                            **act, "heads": head_spec or None})
    return options, {"convs": state, "heads": {t: m.state_dict() for t, m in heads.items()}}


def _user_module_layers(model: torch.fx.GraphModule, node_types: list[str], edge_types: list[EdgeType]):
    """(convolutions per layer, heads) of to_hetero(<the user's own module>), read from the
    graph to_hetero wrote: each message-passing child, in the order the forward first
    calls it, is a layer (a ModuleDict with one convolution per edge type), and a child
    of Linear per node type called after the last layer is the head. Any other module,
    or a layer or head called out of that order (skip connections, jumping knowledge),
    is refused in one line; functions between layers are confirmed by the golden check."""
    from torch_geometric.nn import MessagePassing

    by_key = {edge_key(e): e for e in edge_types}
    layers: dict[str, dict[EdgeType, nn.Module]] = {}
    heads: dict[str, nn.Module] = {}
    head_owner = None
    acts: list[nn.Module] = []
    for node in model.graph.nodes:
        if node.kwargs.get("training") is True and "dropout" in str(getattr(node.target, "__name__", node.target)):
            raise UnsupportedModel("the model's forward calls dropout with training=True fixed by to_hetero's trace "
                                   "(F.dropout(x, training=self.training) is read once, when to_hetero runs): use "
                                   "torch.nn.Dropout, or call to_hetero on the module in eval mode")
        if node.op != "call_module":
            continue
        owner, _, key = str(node.target).rpartition(".")
        module = model.get_submodule(str(node.target))
        if isinstance(module, MessagePassing):
            if head_owner is not None:
                raise UnsupportedModel(f"module {owner!r} runs after the head {head_owner!r}; hybridgnn serves "
                                       "layers of convolutions followed by an optional Linear head")
            if key not in by_key:
                raise UnsupportedModel(f"module {str(node.target)!r} is a convolution for an edge type the metadata "
                                       "does not list")
            if owner in layers and owner != next(reversed(layers)):
                raise UnsupportedModel(f"convolution {owner!r} is called again after a later layer (a skip or "
                                       "shared layer), which hybridgnn does not serve")
            layers.setdefault(owner, {})[by_key[key]] = module
        elif type(module) in ACTIVATIONS and key in node_types:
            acts.append(module)
        elif isinstance(module, nn.Dropout) and key in node_types:
            continue  # identity in eval mode, which is how models are served
        elif type(module) in (nn.Linear, PygLinear) and key in node_types and layers:
            last = next(reversed(layers))
            if _modules_read(node, model) != {last}:
                raise UnsupportedModel(f"module {owner!r} reads something other than the last layer {last!r} (a "
                                       "skip connection?); hybridgnn serves a Linear head on the last layer's rows")
            if head_owner not in (None, owner):
                raise UnsupportedModel(f"two heads ({head_owner!r} and {owner!r}) after the last layer; hybridgnn "
                                       "serves one Linear per node type")
            head_owner = owner
            heads[key] = module
        else:
            raise UnsupportedModel(f"module {str(node.target)!r} ({type(module).__name__}) is not served in a "
                                   "to_hetero model: hybridgnn reads convolutions (SAGEConv, GATConv, GraphConv), "
                                   "functional activations between them and a Linear head after the last one")
    if not layers:
        raise UnsupportedModel(f"{type(model).__name__} calls no convolution; save a to_hetero or HeteroConv model")
    if len({type(a) for a in acts}) > 1:
        raise UnsupportedModel(f"the model's activations differ ({sorted({type(a).__name__ for a in acts})}); "
                               "hybridgnn serves one activation between layers")
    return list(layers.values()), heads, acts[0] if acts else None


def _modules_read(node, model: torch.fx.GraphModule) -> set[str]:
    """The modules (owner names) whose outputs reach `node` through functions, dropout and
    activation modules alone (those change no layer's rows in eval mode, or only
    elementwise)."""
    found, seen, stack = set(), set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_module" and not isinstance(model.get_submodule(str(n.target)),
                                                    (nn.Dropout, *ACTIVATIONS)):
            found.add(str(n.target).rpartition(".")[0])
        else:
            stack.extend(n.all_input_nodes)
    return found


def load_weights(hetero: HeteroGNN, weights: dict) -> None:
    """Copy the weights candidates_from_pyg collected into a HeteroGNN built from one of
    its descriptions (strict: every tensor must fit)."""
    for (e, i), state in weights["convs"].items():
        hetero.conv(i, e).load_state_dict(state, strict=True)
    for t, state in weights["heads"].items():
        hetero.heads[t].load_state_dict(state, strict=True)
