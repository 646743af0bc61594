"""Link decoders: a score for a pair of nodes from the model's outputs of both ends,
called as decoder(z_src [n, d_s], z_dst [n, d_d]) -> scores [n] (or [n, 1]).

"dot" is the inner product (PyG's link-prediction examples). The user's own module is
kept as data, never as code or pickle: torch.fx traces its forward into a graph of
allowlisted tensor operations (decoder.json) whose tensors go to decoder.pt (loaded
weights_only). Submodules are rewritten as the functional calls they make (a Linear is
F.linear with its weight and bias), so the file names operations only. A module that
traces to anything else (control flow on values, other modules or functions) is refused
in one line. The rebuilt decoder must reproduce the module's scores on golden inputs for
each pair of node types it scores, when saved and again when loaded.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridgnn.config import read_json
from hybridgnn.models.golden import GOLDEN_TOLERANCE, max_relative_error
from hybridgnn.models.zoo import UnsupportedModel

DECODER_GRAPH = "decoder.json"
DECODER_TENSORS = "decoder.pt"
GOLDEN_PAIRS = 9  # rows of the golden inputs per type pair


def _identity(x, *args, **kwargs):
    return x


# Every callable a decoder graph may name, by the name the file gives it.
FUNCTIONS: dict[str, Callable] = {
    **{f"operator.{n}": getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "neg", "getitem", "matmul",
                                                         "pow")},
    **{f"torch.{n}": getattr(torch, n) for n in (
        "cat", "stack", "sum", "mean", "mul", "add", "sub", "div", "sigmoid", "tanh", "relu", "matmul", "abs", "exp",
        "log", "squeeze", "unsqueeze", "flatten", "einsum", "clamp", "cosine_similarity", "sqrt", "maximum",
        "minimum", "square", "prod", "norm")},
    **{f"F.{n}": getattr(F, n) for n in (
        "linear", "bilinear", "relu", "leaky_relu", "elu", "gelu", "silu", "softplus", "normalize",
        "cosine_similarity", "layer_norm", "batch_norm", "tanh", "sigmoid")},
    "F.dropout": _identity,  # traced in eval mode: dropout is the identity when serving
}
_NAME_OF = {id(f): n for n, f in FUNCTIONS.items() if f is not _identity}
_NAME_OF[id(F.dropout)] = "F.dropout"
METHODS = frozenset((
    "sum", "mean", "mul", "add", "sub", "div", "view", "reshape", "squeeze", "unsqueeze", "flatten", "relu",
    "sigmoid", "tanh", "t", "matmul", "abs", "exp", "log", "neg", "contiguous", "float", "transpose", "norm",
    "clamp", "pow", "sqrt", "size", "prod", "square", "softmax", "max", "min", "amax", "amin"))


def _module_call(mod: nn.Module, name: str, args: tuple) -> tuple[str, list, dict]:
    """(function, args, kwargs) a leaf module's call amounts to; its tensors are named
    {"p": "<module>.<tensor>"}. UnsupportedModel for any other module."""
    def p(attr):
        return {"p": f"{name}.{attr}"} if getattr(mod, attr, None) is not None else None

    x = list(args)
    if isinstance(mod, nn.Linear):
        return "F.linear", [*x, p("weight"), p("bias")], {}
    if isinstance(mod, nn.Bilinear):
        return "F.bilinear", [*x, p("weight"), p("bias")], {}
    if isinstance(mod, (nn.Identity, nn.Dropout)):
        return "F.dropout", x, {}
    simple = {nn.ReLU: "F.relu", nn.Sigmoid: "torch.sigmoid", nn.Tanh: "torch.tanh", nn.SiLU: "F.silu"}
    if type(mod) in simple:
        return simple[type(mod)], x, {}
    if isinstance(mod, nn.LeakyReLU):
        return "F.leaky_relu", [*x, float(mod.negative_slope)], {}
    if isinstance(mod, nn.ELU):
        return "F.elu", [*x, float(mod.alpha)], {}
    if isinstance(mod, nn.GELU):
        return "F.gelu", x, {"approximate": mod.approximate}
    if isinstance(mod, nn.Softplus):
        return "F.softplus", x, {"beta": float(mod.beta), "threshold": float(mod.threshold)}
    if isinstance(mod, nn.LayerNorm):
        return "F.layer_norm", [*x, list(mod.normalized_shape), p("weight"), p("bias"), float(mod.eps)], {}
    if isinstance(mod, nn.BatchNorm1d) and mod.track_running_stats:
        return "F.batch_norm", [*x, p("running_mean"), p("running_var"), p("weight"), p("bias"), False, 0.0,
                                float(mod.eps)], {}
    raise UnsupportedModel(f"the link decoder uses {type(mod).__name__} ({name}), which a decoder cannot hold; "
                           "supported: Linear, Bilinear, ReLU, LeakyReLU, ELU, GELU, SiLU, Sigmoid, Tanh, Softplus, "
                           "LayerNorm, BatchNorm1d, Dropout, Identity, and tensor operations")


def _encode(a):
    """A traced argument as JSON: nodes {"n"}, tuples {"t"}, lists {"l"}, slices {"s"}."""
    if isinstance(a, torch.fx.Node):
        return {"n": a.name}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, dict) and set(a) == {"p"}:
        return a
    if isinstance(a, tuple):
        return {"t": [_encode(v) for v in a]}
    if isinstance(a, list):
        return {"l": [_encode(v) for v in a]}
    if isinstance(a, slice):
        return {"s": [_encode(a.start), _encode(a.stop), _encode(a.step)]}
    if a is Ellipsis:
        return {"e": True}
    raise UnsupportedModel(f"the link decoder passes a {type(a).__name__} to an operation, which a decoder cannot "
                           "hold (numbers, tensors, tuples and slices can be held)")


def trace_decoder(module: nn.Module) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The module's forward as decoder-graph nodes and the tensors they name."""
    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception as exc:  # fx raises several types; the cause is what helps
        raise UnsupportedModel(f"the link decoder cannot be traced with torch.fx (no control flow on tensor "
                               f"values): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    nodes, tensors = [], {}
    modules = dict(traced.named_modules())
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            nodes.append({"op": "input", "name": node.name})
            continue
        if node.op == "output":
            nodes.append({"op": "output", "args": [_encode(node.args[0])]})
            continue
        if node.op == "get_attr":
            value = _attr(traced, node.target)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedModel(f"the link decoder reads {node.target}, which is not a tensor")
            tensors[node.target] = value.detach().clone()
            nodes.append({"op": "tensor", "name": node.name, "target": node.target})
            continue
        if node.op == "call_module":
            target, args, kwargs = _module_call(modules[node.target], node.target, node.args)
            for a in args:
                if isinstance(a, dict) and "p" in a:
                    tensors[a["p"]] = _attr(traced, a["p"]).detach().clone()
            nodes.append({"op": "call", "name": node.name, "target": target, "args": [_encode(a) for a in args],
                          "kwargs": {k: _encode(v) for k, v in {**node.kwargs, **kwargs}.items()}})
            continue
        if node.op == "call_function":
            target = _NAME_OF.get(id(node.target))
            if target is None:
                raise UnsupportedModel(f"the link decoder calls {getattr(node.target, '__name__', node.target)}, "
                                       "which a decoder cannot hold; see hybridgnn.models.link.FUNCTIONS")
            op = "call"
        else:  # call_method
            target, op = node.target, "method"
            if target not in METHODS:
                raise UnsupportedModel(f"the link decoder calls the tensor method .{target}(), which a decoder "
                                       "cannot hold; see hybridgnn.models.link.METHODS")
        nodes.append({"op": op, "name": node.name, "target": target, "args": [_encode(a) for a in node.args],
                      "kwargs": {k: _encode(v) for k, v in node.kwargs.items()}})
    if sum(n["op"] == "input" for n in nodes) != 2:
        raise UnsupportedModel("a link decoder's forward takes exactly two tensors: (z_src, z_dst)")
    return nodes, tensors


def _attr(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


class GraphDecoder:
    """A decoder graph evaluated node by node: only the operations FUNCTIONS and METHODS
    name, over the inputs, its own tensors and earlier results. Raises ValueError for a
    graph that names anything else (a damaged or hostile decoder.json)."""

    def __init__(self, nodes: list[dict], tensors: dict[str, torch.Tensor]):
        seen: set[str] = set()
        for n in nodes:
            if not isinstance(n, dict) or n.get("op") not in ("input", "output", "tensor", "call", "method"):
                raise ValueError(f"not a decoder-graph node: {str(n)[:80]}")
            if n["op"] == "call" and n.get("target") not in FUNCTIONS:
                raise ValueError(f"decoder graph calls {str(n.get('target'))[:80]}, which is not allowed")
            if n["op"] == "method" and n.get("target") not in METHODS:
                raise ValueError(f"decoder graph calls method {str(n.get('target'))[:80]}, which is not allowed")
            if n["op"] == "tensor" and n.get("target") not in tensors:
                raise ValueError(f"decoder graph reads tensor {str(n.get('target'))[:80]}, which decoder.pt lacks")
            if n["op"] != "output":
                if not isinstance(n.get("name"), str):
                    raise ValueError("a decoder-graph node lacks its name")
                seen.add(n["name"])
        if [n["op"] for n in nodes].count("output") != 1 or nodes[-1]["op"] != "output":
            raise ValueError("a decoder graph ends with its one output")
        self.nodes = nodes
        self.tensors = tensors

    def to(self, device) -> GraphDecoder:
        return GraphDecoder(self.nodes, {k: v.to(device) for k, v in self.tensors.items()})

    def _value(self, a, env):
        if isinstance(a, dict):
            (kind, v), = a.items()
            if kind == "n":
                return env[v]
            if kind == "p":
                return self.tensors[v]
            if kind == "t":
                return tuple(self._value(x, env) for x in v)
            if kind == "l":
                return [self._value(x, env) for x in v]
            if kind == "s":
                return slice(*(self._value(x, env) for x in v))
            if kind == "e":
                return Ellipsis
            raise ValueError(f"unknown decoder-graph value {kind!r}")
        return a

    def __call__(self, z_src: torch.Tensor, z_dst: torch.Tensor) -> torch.Tensor:
        env: dict = {}
        inputs = iter((z_src, z_dst))
        for n in self.nodes:
            op = n["op"]
            if op == "input":
                env[n["name"]] = next(inputs)
            elif op == "tensor":
                env[n["name"]] = self.tensors[n["target"]]
            elif op == "output":
                return self._value(n["args"][0], env)
            else:
                args = [self._value(a, env) for a in n["args"]]
                kwargs = {k: self._value(v, env) for k, v in n["kwargs"].items()}
                if op == "call":
                    if n["target"] in _ARITHMETIC:
                        _check_operands(n["target"], args)
                    env[n["name"]] = FUNCTIONS[n["target"]](*args, **kwargs)
                else:
                    if not isinstance(args[0], torch.Tensor):
                        raise ValueError(f"decoder graph calls .{n['target']}() on a {type(args[0]).__name__}")
                    env[n["name"]] = getattr(args[0], n["target"])(*args[1:], **kwargs)
        raise ValueError("decoder graph has no output")


_ARITHMETIC = frozenset(f"operator.{n}" for n in ("add", "sub", "mul", "truediv", "neg", "matmul", "pow"))
_MAX_SCALAR = 1 << 63


def _check_operands(target: str, args: list) -> None:
    """ValueError unless arithmetic a decoder graph asks for is on tensors or numbers of
    a tensor's size: a hostile decoder.json multiplied a string by 10**12, or chained
    integer powers, and the load ran out of memory or time (Python evaluates such
    operations on its own objects, without bound)."""
    for a in args:
        if isinstance(a, torch.Tensor) or isinstance(a, float):
            continue
        if not isinstance(a, int) or abs(a) > _MAX_SCALAR:
            raise ValueError(f"decoder graph applies {target} to {type(a).__name__} {str(a)[:40]}; "
                             "arithmetic takes tensors and numbers")
    if target == "operator.pow" and len(args) == 2 and all(type(a) is int for a in args) and abs(args[1]) > 64:
        raise ValueError(f"decoder graph raises an integer to the power {args[1]}")


def dot(z_src: torch.Tensor, z_dst: torch.Tensor) -> torch.Tensor:
    return (z_src * z_dst).sum(-1)


def scores_of(decoder, z_src: torch.Tensor, z_dst: torch.Tensor) -> torch.Tensor:
    """decoder's scores of n pairs as float32 [n]; ValueError when it gives another count."""
    out = decoder(z_src, z_dst)
    if not isinstance(out, torch.Tensor) or out.numel() != z_src.shape[0]:
        raise ValueError(f"the decoder gives {getattr(out, 'shape', type(out).__name__)} for {z_src.shape[0]} pairs "
                         "(one score per pair expected)")
    return out.reshape(-1).float()


def _golden_inputs(widths: dict[str, int]) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(20261127)
    return {t: torch.from_numpy(rng.standard_normal((GOLDEN_PAIRS, w)).astype(np.float32)) for t, w in widths.items()}


def _scored_pairs(decoder, z: dict[str, torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """Every (src type, dst type) the decoder scores, with its golden scores."""
    out = {}
    for s, zs in z.items():
        for d, zd in z.items():
            try:
                with torch.inference_mode():
                    out[s, d] = scores_of(decoder, zs, zd)
            except Exception:  # widths that do not fit this pair: it is not scored
                continue
    return out


def _batch_dependent(decoder, z: dict[str, torch.Tensor], pairs: dict) -> tuple[str, str] | None:
    """The first scored (src type, dst type) whose golden scores change when each pair is
    scored alone (a decoder that mixes rows: its answer would depend on the batch)."""
    for (s, d), want in pairs.items():
        try:
            with torch.inference_mode():
                alone = torch.cat([scores_of(decoder, z[s][i:i + 1], z[d][i:i + 1]) for i in range(GOLDEN_PAIRS)])
        except Exception:  # fails on one pair, which a request may send
            return s, d
        if max_relative_error(alone, want) > GOLDEN_TOLERANCE:
            return s, d
    return None


def save_decoder(root: Path, decoder, out_dims: dict[str, int]) -> dict:
    """Write a link decoder ("dot" or a module) beside a model; its config.json entry
    ({"kind", "pairs"}). UnsupportedModel (one line) when it cannot be served exactly."""
    z = _golden_inputs(out_dims)
    root.mkdir(parents=True, exist_ok=True)
    if isinstance(decoder, str):
        if decoder != "dot":
            raise UnsupportedModel(f"link_decoder must be 'dot' or a torch.nn.Module, got {decoder!r}")
        pairs = _scored_pairs(dot, z)
        kind, golden = "dot", {}
    elif isinstance(decoder, nn.Module):
        was_training = decoder.training
        decoder.eval()
        try:
            nodes, tensors = trace_decoder(decoder)
            expected = _scored_pairs(decoder, z)
        finally:
            decoder.train(was_training)
        rebuilt = GraphDecoder(nodes, tensors)
        pairs = _scored_pairs(rebuilt, z)
        for key, want in expected.items():
            got = pairs.get(key)
            if got is None or max_relative_error(got, want) > GOLDEN_TOLERANCE:
                raise UnsupportedModel(f"the link decoder's traced graph does not reproduce its scores for node types "
                                       f"{key}; it cannot be served exactly")
        mixed = _batch_dependent(rebuilt, z, pairs)
        if mixed is not None:
            raise UnsupportedModel(f"the link decoder's score of a pair depends on the other pairs scored with it (a "
                                   f"softmax, mean or max over rows?) for node types {mixed}; the server scores pairs "
                                   "in batches of any size, so it cannot be served exactly")
        kind = "graph"
        golden = {f"tensor/{k}": v for k, v in tensors.items()}
        (root / DECODER_GRAPH).write_text(json.dumps({"nodes": nodes}, indent=1) + "\n")
    else:
        raise UnsupportedModel(f"link_decoder must be 'dot' or a torch.nn.Module, got {type(decoder).__name__}")
    if not pairs:
        raise UnsupportedModel(f"the link decoder scores no pair of the model's node types (output widths "
                               f"{out_dims})")
    types = list(out_dims)
    golden.update({f"z/{types.index(t)}": v for t, v in z.items()})
    golden.update({f"scores/{types.index(s)}/{types.index(d)}": v for (s, d), v in pairs.items()})
    torch.save(golden, root / DECODER_TENSORS)
    return {"kind": kind, "pairs": [[s, d] for s, d in pairs]}


def load_decoder(root: Path, entry: dict, out_dims: dict[str, int]):
    """The decoder a model directory's config.json names (entry: its link_decoder), checked
    against its golden scores; ValueError (one line) when it is damaged or differs."""
    from hybridgnn.models.checkpoint import load_tensors

    if not isinstance(entry, dict) or entry.get("kind") not in ("dot", "graph") or not isinstance(
            entry.get("pairs"), list):
        raise ValueError(f"{root}/config.json: link_decoder must be {{'kind': 'dot' | 'graph', 'pairs': [...]}}")
    saved = load_tensors(root / DECODER_TENSORS, "cpu")
    if entry["kind"] == "dot":
        decoder = dot
    else:
        try:
            nodes = read_json(root / DECODER_GRAPH)["nodes"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{root / DECODER_GRAPH} cannot be read: {exc}") from None
        decoder = GraphDecoder(nodes, {k[len("tensor/"):]: v for k, v in saved.items() if k.startswith("tensor/")})
    types = list(out_dims)
    pairs = []
    for pair in entry["pairs"]:
        if not (isinstance(pair, list) and len(pair) == 2 and all(t in out_dims for t in pair)):
            raise ValueError(f"{root}/config.json: link_decoder pair {pair!r} does not name two of {types}")
        s, d = pair
        zs, zd = saved.get(f"z/{types.index(s)}"), saved.get(f"z/{types.index(d)}")
        want = saved.get(f"scores/{types.index(s)}/{types.index(d)}")
        if zs is None or zd is None or want is None:
            raise ValueError(f"{root / DECODER_TENSORS} lacks the golden scores of pair {pair}")
        try:
            with torch.inference_mode():
                got = scores_of(decoder, zs.float(), zd.float())
        except Exception as exc:
            raise ValueError(f"the link decoder fails on its golden inputs for {pair}: {exc}") from None
        if max_relative_error(got, want.float()) > GOLDEN_TOLERANCE:
            raise ValueError(f"the link decoder of {root} does not reproduce its golden scores for {pair}")
        pairs.append((s, d))
    return decoder, pairs
