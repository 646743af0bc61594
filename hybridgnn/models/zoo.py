"""The model contract: which model classes hybridgnn serves, and how a model is written
down as a class name plus constructor arguments (JSON) and rebuilt from them.

Only the classes in ALLOWED are ever constructed on load, so a model directory names an
architecture, never code to import. `describe` reads a live model's options back from
its modules and refuses (one clear line) any option some serving path cannot run
exactly: a normalisation that looks at the whole batch, edge features, jumping
knowledge that mixes layers, a custom subclass. What `describe` says is then checked
by rebuilding the model and comparing its outputs (hybridgnn.models.golden).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch_geometric.nn import GATConv, GATv2Conv, GCNConv, GINConv, SAGEConv
from torch_geometric.nn.models import GAT, GCN, GIN, GraphSAGE
from torch_geometric.nn.norm import BatchNorm, LayerNorm
from torch_geometric.nn.resolver import activation_resolver

from hybridgnn.errors import ConfigError
from hybridgnn.models.decompose import input_width
from hybridgnn.models.gnn import GNN, ModelSpec

# name in config.json -> class; the names are stable, the import paths may move.
ALLOWED: dict[str, type[nn.Module]] = {
    "hybridgnn.GNN": GNN,
    "torch_geometric.GraphSAGE": GraphSAGE,
    "torch_geometric.GCN": GCN,
    "torch_geometric.GAT": GAT,
    "torch_geometric.GIN": GIN,
}
PYG_CLASSES = {cls: name for name, cls in ALLOWED.items() if cls is not GNN}

# Activations rebuilt by name, with the attributes that are their constructor options.
ACTIVATIONS: dict[type[nn.Module], tuple[str, tuple[str, ...]]] = {
    nn.ReLU: ("relu", ()),
    nn.LeakyReLU: ("leaky_relu", ("negative_slope",)),
    nn.ELU: ("elu", ("alpha",)),
    nn.GELU: ("gelu", ("approximate",)),
    nn.SiLU: ("silu", ()),
    nn.Tanh: ("tanh", ()),
    nn.Sigmoid: ("sigmoid", ()),
    nn.Softplus: ("softplus", ("beta", "threshold")),
    nn.PReLU: ("prelu", ("num_parameters",)),
    nn.Identity: ("identity", ()),
}
AGGREGATIONS = ("mean", "sum", "add", "max", "min")
JK_MODES = (None, "last", "cat", "max", "lstm")


class UnsupportedModel(ConfigError):
    """A model, or an option of it, that hybridgnn cannot serve exactly."""


def servable_copy(model: nn.Module) -> nn.Module:
    """model itself when its tensors are float32 on the CPU (as it is served and checked),
    a copy moved to the CPU when they are on a GPU (the golden graph is on the CPU: a model
    trained on a GPU failed with torch's 'tensors on different devices'); UnsupportedModel
    for other floating dtypes, which float32 serving would only approximate (float64 and
    float16 models failed with torch's 'mat1 and mat2 must have the same dtype')."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not nn.parameter.is_lazy(t)]
    other = sorted({str(t.dtype).removeprefix("torch.") for t in tensors
                    if t.is_floating_point() and t.dtype != torch.float32})
    if other:
        raise UnsupportedModel(f"{type(model).__name__} holds {', '.join(other)} weights; hybridgnn serves float32 "
                               "models: save model.float()")
    if any(t.device.type != "cpu" for t in tensors):
        return copy.deepcopy(model).cpu()
    return model


def supported_classes() -> str:
    return ", ".join(["hybridgnn.models.GNN", *(f"torch_geometric.nn.models.{c.__name__}" for c in PYG_CLASSES)])


def describe(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """(class name, constructor arguments) that rebuild `model`; UnsupportedModel when it
    is off the allowlist or uses an option hybridgnn cannot serve exactly."""
    if type(model) is GNN:
        return "hybridgnn.GNN", model.spec.to_dict()
    name = PYG_CLASSES.get(type(model))
    if name is None and _looks_heterogeneous(model):
        raise UnsupportedModel(f"{type(model).__name__} looks heterogeneous (to_hetero or HeteroConv): save it with "
                               "hybridgnn.save_model(model, path, metadata=data.metadata())")
    if name is None:
        raise UnsupportedModel(f"{type(model).__module__}.{type(model).__qualname__} is not a model class hybridgnn "
                               f"serves (nor is any subclass); supported: {supported_classes()}")
    if model.jk_mode not in JK_MODES:
        raise UnsupportedModel(f"jumping knowledge jk={model.jk_mode!r} is not supported; supported: "
                               f"{', '.join(map(repr, JK_MODES))}")
    try:
        in_channels = input_width(model)  # a lazy (-1) model is written down with the width it took
    except ValueError as exc:
        raise UnsupportedModel(str(exc)) from exc
    args: dict[str, Any] = {
        "in_channels": in_channels,
        "hidden_channels": model.hidden_channels,
        "num_layers": model.num_layers,
        "out_channels": _out_channels(model),
        "dropout": float(model.dropout.p),
        "act_first": bool(model.act_first),
        "jk": model.jk_mode,
        **_activation(model.act),
        **_norm(model),
    }
    if not isinstance(in_channels, int):
        raise UnsupportedModel("bipartite in_channels (a tuple) are not supported: one node type only")
    args.update(_conv_options(type(model), model))
    return name, args


def _looks_heterogeneous(model) -> bool:
    """Whether a model off the allowlist is one save_model reads with metadata= (to_hetero
    gives a torch.fx GraphModule; HeteroConv layers): it was refused naming the class
    torch.fx made up (GraphModule.__new__.<locals>.GraphModuleImpl), not the missing metadata."""
    from torch_geometric.nn import HeteroConv

    return isinstance(model, torch.fx.GraphModule) or any(isinstance(m, HeteroConv) for m in
                                                           (model.modules() if isinstance(model, nn.Module) else ()))


def build(name: str, args: dict[str, Any]) -> nn.Module:
    """The model `describe` wrote down, with fresh weights; UnsupportedModel for a class
    off the allowlist, ConfigError for arguments the class does not take."""
    cls = ALLOWED.get(name)
    if cls is None:
        raise UnsupportedModel(f"model class {name!r} is not one hybridgnn serves; supported: "
                               f"{', '.join(ALLOWED)}")
    if not isinstance(args, dict):
        raise ConfigError(f"model arguments must be a JSON object, got {type(args).__name__}")
    try:
        if cls is GNN:
            return GNN(ModelSpec(**args))
        return cls(**args)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, AssertionError, OverflowError) as exc:
        # PyG's constructors assert (an unknown jk) and torch raises RuntimeError (a negative width)
        raise ConfigError(f"cannot build {name} from {args}: {exc or type(exc).__name__}") from exc


def _out_channels(model) -> int | None:
    """out_channels as the model was built: None when it was not given and no head reads
    the layers (no jk). Rebuilt with hidden_channels in its place, a GAT's last layer
    would average its heads instead of concatenating them (BasicGNN forces concat=False
    on a layer mapping to out_channels), so GAT(..., heads=2) without out_channels was
    refused at save with weights that did not fit."""
    if model.jk_mode is None and not getattr(model, "_is_conv_to_out", False):
        return None
    return model.out_channels


def _activation(act) -> dict[str, Any]:
    # PyG resolves no activation named "identity": nn.Identity is written as act=None, the same model
    if act is None or type(act) is nn.Identity:
        return {"act": None}
    entry = ACTIVATIONS.get(type(act))
    if entry is None:
        raise UnsupportedModel(f"activation {type(act).__name__} is not supported; supported: "
                               f"{', '.join(n for n, _ in ACTIVATIONS.values())} (give it by name)")
    label, options = entry
    kwargs = {k: getattr(act, k) for k in options}
    # activation_resolver must give the same module back; the golden check confirms the rest.
    rebuilt = activation_resolver(label, **kwargs)
    if type(rebuilt) is not type(act):
        raise UnsupportedModel(f"activation {type(act).__name__} cannot be rebuilt by name")
    return {"act": label, "act_kwargs": kwargs or None}


def _norm(model) -> dict[str, Any]:
    # GIN's MLPs apply the norm inside each layer too: a 1-layer GIN has it only there
    inner = [m for c in model.convs for m in getattr(getattr(c, "nn", None), "norms", ())]
    norms = [m for m in [*model.norms, *inner] if not isinstance(m, nn.Identity)]
    if not norms:
        return {"norm": None, "norm_kwargs": None}
    if model.norm is None:
        raise UnsupportedModel("a norm given as a module cannot be rebuilt; give it by name "
                               "(norm='batch' or norm='layer' with norm_kwargs={'mode': 'node'})")
    for m in norms:
        if isinstance(m, BatchNorm) and m.module.track_running_stats:
            continue
        if isinstance(m, LayerNorm) and m.mode == "node":
            continue
        what = type(m).__name__ + (f"(mode={m.mode!r})" if isinstance(m, LayerNorm) else "")
        raise UnsupportedModel(
            f"norm {what} depends on which other nodes share the batch, so a node's answer would depend on "
            "other requests; supported: BatchNorm with running statistics, LayerNorm with mode='node'")
    return {"norm": model.norm, "norm_kwargs": dict(model.norm_kwargs) if model.norm_kwargs else None}


def _aggr(conv) -> str:
    aggr = conv.aggr
    if not isinstance(aggr, str) or aggr not in AGGREGATIONS:
        raise UnsupportedModel(f"aggregation {aggr!r} is not supported; supported: {', '.join(AGGREGATIONS)}")
    return aggr


def _conv_options(cls, model) -> dict[str, Any]:
    convs = list(model.convs)
    first = convs[0]
    if cls is GraphSAGE:
        _require(convs, SAGEConv)
        return {"aggr": _aggr(first), "normalize": bool(first.normalize), "root_weight": bool(first.root_weight),
                "project": bool(first.project), "bias": first.lin_l.bias is not None}
    if cls is GCN:
        _require(convs, GCNConv)
        if first.improved or first.cached or not first.add_self_loops or not first.normalize:
            raise UnsupportedModel("GCN options improved, cached, add_self_loops=False and normalize=False are not "
                                   "supported: the layer-wise paths use GCN's default normalisation")
        if _aggr(first) not in ("add", "sum"):
            raise UnsupportedModel(f"GCN with aggr={first.aggr!r} is not supported: the layer-wise paths sum GCN's "
                                   "normalised messages (aggr='add')")
        return {"bias": first.bias is not None}
    if cls is GAT:
        v2 = isinstance(first, GATv2Conv)
        _require(convs, GATv2Conv if v2 else GATConv)
        if first.edge_dim is not None:
            raise UnsupportedModel("GAT with edge_dim needs edge features, which hybridgnn does not serve")
        # The last layer of a GAT with out_channels never concatenates (BasicGNN forces it),
        # so the first layer says what the user chose.
        options = {"v2": v2, "heads": int(first.heads), "concat": bool(first.concat),
                   "negative_slope": float(first.negative_slope), "add_self_loops": bool(first.add_self_loops),
                   "bias": getattr(first, "bias", None) is not None, "residual": bool(first.residual),
                   "aggr": _aggr(first)}
        if v2:
            options["share_weights"] = bool(first.share_weights)
        return options
    _require(convs, GINConv)  # GIN
    return {"train_eps": isinstance(first.eps, nn.Parameter), "eps": float(first.initial_eps), "aggr": _aggr(first)}


def _require(convs, conv_cls) -> None:
    for c in convs:
        if type(c) is not conv_cls:
            raise UnsupportedModel(f"layer {type(c).__name__} where {conv_cls.__name__} was expected")
