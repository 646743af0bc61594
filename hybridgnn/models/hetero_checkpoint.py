"""Heterogeneous model directories: config.json (class hybridgnn.HeteroGNN, its JSON
arguments, the graph's metadata, serving hints), model.pt (the HeteroGNN state_dict) and
golden.pt (the saved model's answers on a small generated graph of the same types).

As for homogeneous models (checkpoint.py), saving rebuilds the model from its description
and refuses unless it reproduces the model's own forward, and loading (weights_only)
refuses unless every evaluation path reproduces the golden answers: the rebuilt model's
forward over the whole graph, and its evaluation of a typed sample that takes every
neighbour (what the sampling pipelines run).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hybridgnn.capabilities import write_replacing
from hybridgnn.config import SMALL_JSON_BYTES, read_json
from hybridgnn.errors import ConfigError
from hybridgnn.models.checkpoint import (
    CONFIG,
    FORMAT,
    GOLDEN,
    WEIGHTS,
    CheckpointError,
    check_extra,
    check_fits,
    load_tensors,
)
from hybridgnn.models.golden import GOLDEN_TOLERANCE, max_relative_error
from hybridgnn.models.hetero import (
    HeteroGNN,
    candidates_from_pyg,
    edge_key,
    load_weights,
)
from hybridgnn.models.link import save_decoder
from hybridgnn.models.zoo import UnsupportedModel, servable_copy
from hybridgnn.types import EdgeType
from hybridgnn.workload.typed import num_hops, typed_fanouts

HETERO_CLASS = "hybridgnn.HeteroGNN"
GOLDEN_SIZES = (23, 17, 11, 29, 13)  # nodes per type (cycled): types of different sizes


def input_widths(model: HeteroGNN) -> dict[str, int]:
    """The feature width each node type's rows must have (read from layer 0's weights)."""
    widths: dict[str, int] = {}
    for e in model.layer_edges[0]:
        s, _, t = e
        conv = model.conv(0, e)
        args = conv.in_channels if isinstance(conv.in_channels, tuple) else (conv.in_channels,) * 2
        for ntype, w in ((s, args[0]), (t, args[1])):
            if w is None or int(w) <= 0:
                continue
            if widths.setdefault(ntype, int(w)) != int(w):
                raise UnsupportedModel(f"layer 0 reads node type {ntype!r} with widths {widths[ntype]} and {w}")
    return {t: widths.get(t, 1) for t in model.node_types}


def golden_graph(model: HeteroGNN) -> tuple[dict[str, torch.Tensor], dict[EdgeType, torch.Tensor]]:
    """The fixed test graph for a model's types and widths (the same bytes everywhere)."""
    rng = np.random.default_rng(20261126)
    widths = input_widths(model)
    sizes = {t: GOLDEN_SIZES[i % len(GOLDEN_SIZES)] for i, t in enumerate(model.node_types)}
    x = {t: torch.from_numpy(rng.standard_normal((sizes[t], widths[t])).astype(np.float32)) for t in model.node_types}
    edges = {}
    for e in model.edge_types:
        s, _, t = e
        # every target but the last reads 1-4 sources; target 0 reads from every source (a hub)
        counts = rng.integers(1, 5, sizes[t])
        counts[-1] = 0
        dst = np.repeat(np.arange(sizes[t]), counts)
        src = rng.integers(0, sizes[s], dst.size)
        dst, src = np.concatenate([dst, np.zeros(sizes[s], np.int64)]), np.concatenate([src, np.arange(sizes[s])])
        pairs = np.unique(np.stack([src, dst]), axis=1)
        edges[e] = torch.from_numpy(pairs.astype(np.int64))
    return x, edges


def full_typed_sample(edges: dict[EdgeType, torch.Tensor], seeds: dict[str, np.ndarray], hops: int):
    """Every in-neighbour of every node within `hops`, in the typed samplers' layout:
    (node ids per type, local edge_index per edge type)."""
    nodes = {t: list(v.tolist()) for t, v in seeds.items()}
    frontier = {t: set(v) for t, v in nodes.items()}
    for _ in range(hops):
        reached: dict[str, list[int]] = {}
        for (s, _, t), ei in edges.items():
            mask = np.isin(ei[1].numpy(), list(frontier.get(t, ())))
            for u in ei[0].numpy()[mask].tolist():
                if u not in nodes.setdefault(s, []) and u not in reached.setdefault(s, []):
                    reached[s].append(u)
        for s, new in reached.items():
            nodes.setdefault(s, []).extend(new)
        frontier = {s: set(v) for s, v in reached.items()}
    ids = {t: np.asarray(v, np.int64) for t, v in nodes.items()}
    local = {t: {g: i for i, g in enumerate(v.tolist())} for t, v in ids.items()}
    out = {}
    for e, ei in edges.items():
        s, _, t = e
        if s not in local or t not in local:
            continue
        keep = [(local[s][a], local[t][b]) for a, b in ei.t().tolist() if a in local[s] and b in local[t]]
        out[e] = torch.tensor(keep, dtype=torch.int64).t().reshape(2, -1)
    return ids, out


def mismatches(model: HeteroGNN, x, edges, expected: dict[str, torch.Tensor]) -> list[str]:
    """Which evaluation paths differ from `expected` beyond GOLDEN_TOLERANCE (empty: none)."""
    found = []
    with torch.inference_mode():
        got = model(x, edges)
    for t, want in expected.items():
        if t not in got or got[t].shape != want.shape:
            shape = list(got[t].shape) if t in got else "no"
            found.append(f"the whole-graph forward gives {shape} rows for node type {t!r} where the model gives "
                         f"{list(want.shape)}")
            continue
        err = max_relative_error(got[t].float(), want)
        if err > GOLDEN_TOLERANCE:
            found.append(f"the whole-graph forward differs for node type {t!r} by {err:.3g}")
    seed_type = next(iter(expected))
    seeds = np.arange(0, x[seed_type].shape[0], 3, dtype=np.int64)
    ids, sub_edges = full_typed_sample(edges, {seed_type: seeds}, model.num_layers)
    with torch.inference_mode():
        rows = model({t: x[t][torch.from_numpy(v)] for t, v in ids.items() if v.size}, sub_edges)
    err = max_relative_error(rows[seed_type][: seeds.size].float(), expected[seed_type][torch.from_numpy(seeds)]) \
        if seed_type in rows else float("inf")
    if err > GOLDEN_TOLERANCE and not found:  # a whole-graph mismatch already says it
        found.append(f"sampled evaluation with every neighbour taken differs by {err:.3g}")
    return found


def _reference(model: nn.Module, x, edges) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        out = model(x, edges)
    if not isinstance(out, dict):
        raise UnsupportedModel(f"the model's forward returns {type(out).__name__}; a heterogeneous model returns a "
                               "dict of rows per node type")
    return {t: v.float() for t, v in out.items()}


def save_hetero_model(model: nn.Module, path: str | Path, metadata, *, fanouts=None, extra: dict | None = None,
                      link_decoder=None) -> Path:
    """Write a to_hetero or HeteroConv model as a model directory (see the module
    docstring); UnsupportedModel (one line) when it cannot be served exactly.
    link_decoder: "dot" or a module scoring (z_src, z_dst) pairs (models/link.py)."""
    root = Path(path).expanduser()  # "~/models/x" from Python, as the CLI reads it
    check_extra(extra, {"format", "class", "args", "num_layers", "in_dims", "out_dims", "fanouts", "link_decoder"})
    if not isinstance(model, nn.Module):
        raise UnsupportedModel(f"a {type(model).__name__} is not a heterogeneous model hybridgnn reads: expected "
                               "to_hetero(<a BasicGNN or your own module>) or a module of HeteroConv layers")
    model = servable_copy(model)
    if isinstance(link_decoder, nn.Module):
        link_decoder = servable_copy(link_decoder)
    was_training = model.training
    model.eval()
    try:
        options, weights = candidates_from_pyg(model, metadata)
        problems: list[str] = []
        for args in options:
            rebuilt = HeteroGNN(**args).eval()
            load_weights(rebuilt, weights)
            x, edges = golden_graph(rebuilt)
            expected = _reference(model, x, edges)
            if not all(bool(torch.isfinite(v).all()) for v in expected.values()):
                # as homogeneous models say it: NaN never matches, so it read as a model not served exactly
                raise UnsupportedModel(f"{type(model).__name__} gives non-finite outputs (NaN or inf) on the golden "
                                       "graph, so its answers cannot be checked; look for NaN or inf weights")
            try:
                problems = mismatches(rebuilt, x, edges, expected)
            except RuntimeError as exc:  # what was read does not even run (widths that do not chain)
                problems = [f"the model as read does not run: {str(exc).splitlines()[0] if str(exc) else exc!r}"]
            if not problems:
                break
    finally:
        model.train(was_training)
    if problems:
        raise UnsupportedModel(f"{type(model).__name__} cannot be served exactly: " + "; ".join(problems))
    if fanouts is not None:  # as serve reads them: written as given, serve refused the saved model
        fanouts = _plain_fanouts(fanouts)
        try:
            hops = num_hops(typed_fanouts(rebuilt.edge_types, fanouts))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"save_model fanouts: {exc}") from None
        if hops < rebuilt.num_layers:
            raise ConfigError(f"save_model fanouts give {hops} {'hop' if hops == 1 else 'hops'} but the model has "
                              f"{rebuilt.num_layers} layers")
    config = {"format": FORMAT, "class": HETERO_CLASS, "args": args, "num_layers": rebuilt.num_layers,
              "in_dims": input_widths(rebuilt), "out_dims": {t: int(v.shape[1]) for t, v in expected.items()},
              **({"fanouts": _fanouts_json(fanouts)} if fanouts is not None else {}), **(extra or {})}
    root.mkdir(parents=True, exist_ok=True)
    if link_decoder is not None:
        config["link_decoder"] = save_decoder(root, link_decoder, config["out_dims"])
    golden = {f"x/{i}": x[t] for i, t in enumerate(rebuilt.node_types)}
    golden.update({f"edge_index/{j}": edges[e] for j, e in enumerate(rebuilt.edge_types)})
    golden.update({f"out/{rebuilt.node_types.index(t)}": v for t, v in expected.items()})
    write_replacing(root / WEIGHTS, lambda p: torch.save(rebuilt.state_dict(), p))
    write_replacing(root / GOLDEN, lambda p: torch.save(golden, p))
    write_replacing(root / CONFIG, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    return root


def _plain_fanouts(fanouts):
    """fanouts with integer tensors (deg.max() + 1) as Python ints, as save_model took them."""
    def plain(v):
        is_int = isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and v.dtype != torch.bool
        return int(v) if is_int else v

    if isinstance(fanouts, dict):
        return {k: [plain(v) for v in vals] if isinstance(vals, (list, tuple)) else vals for k, vals in fanouts.items()}
    return [plain(v) for v in fanouts] if isinstance(fanouts, (list, tuple)) else fanouts


def _fanouts_json(fanouts):
    if isinstance(fanouts, dict):
        return {edge_key(k) if isinstance(k, tuple) else str(k): [int(v) for v in vals] for k, vals in fanouts.items()}
    return [int(v) for v in fanouts]


def load_hetero_model(path: str | Path, config: dict, map_location="cpu", *, check: bool = True) -> HeteroGNN:
    """The HeteroGNN of a model directory whose config.json names it; CheckpointError (one
    line) when its weights do not fit or it does not reproduce its golden answers."""
    root = Path(path).expanduser()  # "~/models/x" from Python, as the CLI reads it
    state = load_tensors(root / WEIGHTS, map_location, mmap=True)  # mapped: refused unread when it does not fit
    try:
        # built on the meta device first: widths config.json gives are allocated only once
        # the weights are known to have them
        check_fits(lambda: HeteroGNN(**config["args"]), state, root)
        model = HeteroGNN(**config["args"])
    except CheckpointError as exc:
        raise CheckpointError(f"weights in {root / WEIGHTS} do not fit the HeteroGNN its config describes") from exc
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{root / CONFIG}: cannot build a HeteroGNN from its arguments: {exc}") from exc
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"weights in {root / WEIGHTS} do not fit the HeteroGNN its config describes") from exc
    model.eval()
    if check:
        saved = load_tensors(root / GOLDEN, "cpu", mmap=True)
        _check_golden_sizes(saved, model, root / GOLDEN)
        try:
            x = {t: saved[f"x/{i}"].float() for i, t in enumerate(model.node_types)}
            edges = {e: saved[f"edge_index/{j}"].long() for j, e in enumerate(model.edge_types)}
            expected = {t: saved[f"out/{i}"].float() for i, t in enumerate(model.node_types) if f"out/{i}" in saved}
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{root / GOLDEN} is not a heterogeneous golden-outputs file: {exc}") from exc
        _check_golden(x, edges, expected, root / GOLDEN)
        try:
            problems = mismatches(model, x, edges, expected)
        except RuntimeError as exc:  # inputs whose widths the layers do not take
            raise CheckpointError(f"{root / GOLDEN}: the model does not run on its golden graph: "
                                  f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
        if problems:
            raise CheckpointError(f"{root} does not reproduce its golden outputs (tolerance {GOLDEN_TOLERANCE:g}), so "
                                  "it is not served: " + "; ".join(problems))
    return model


def _check_golden_sizes(saved, model: HeteroGNN, path: Path) -> None:
    """CheckpointError unless each tensor of a golden file is no larger than a golden
    graph's: GOLDEN_SIZES nodes per type, rows no wider than the model's widest weight,
    one edge per pair of nodes. Its tensors were otherwise converted and evaluated
    whatever their size."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} is not a heterogeneous golden-outputs file: it holds a {type(saved).__name__}")
    nodes = max(GOLDEN_SIZES)
    widest = max((max(p.shape) for p in model.parameters() if p.ndim), default=1)
    for key, value in saved.items():
        limit = 2 * nodes * nodes if str(key).startswith("edge_index/") else nodes * widest
        if isinstance(value, torch.Tensor) and value.numel() > limit:
            raise CheckpointError(f"{path} holds {key} of shape {tuple(value.shape)}, more than a golden graph of "
                                  f"at most {nodes} nodes per type has")


def _check_golden(x: dict, edges: dict, expected: dict, path: Path) -> None:
    """CheckpointError unless the saved golden graph can be evaluated: 2-D inputs per node
    type, edges that are (source, target) pairs of their types' nodes, and outputs (at
    least one type's) with a row per node. A damaged file failed inside the forward with
    an IndexError (or a StopIteration with no outputs) traceback."""
    for t, v in x.items():
        if v.ndim != 2 or v.shape[0] == 0:
            raise CheckpointError(f"{path} has inputs of shape {tuple(v.shape)} for node type {t!r}, not [nodes, F]")
    for (s, _, t), ei in edges.items():
        if ei.ndim != 2 or ei.shape[0] != 2:
            raise CheckpointError(f"{path} has an edge_index of shape {tuple(ei.shape)}, not [2, edges]")
        if ei.numel() and (int(ei.min()) < 0 or int(ei[0].max()) >= x[s].shape[0] or int(ei[1].max()) >= x[t].shape[0]):
            raise CheckpointError(f"{path} has edges to nodes outside their types' golden nodes")
    if not expected:
        raise CheckpointError(f"{path} holds no golden outputs")
    for t, v in expected.items():
        if v.ndim != 2 or v.shape[0] != x[t].shape[0]:
            raise CheckpointError(f"{path} holds {tuple(v.shape)} outputs for node type {t!r} of "
                                  f"{x[t].shape[0]} golden nodes")


def open_hetero_model(path: str | Path, graph) -> tuple[HeteroGNN, dict]:
    """(model, config) of a heterogeneous model directory, checked (golden outputs) and
    checked to fit `graph` (a HeteroGraphStore: its types and layer 0's feature widths);
    CheckpointError in one line otherwise."""
    root = Path(path).expanduser()  # "~/models/x" from Python, as the CLI reads it
    try:
        config = read_json(root / CONFIG, SMALL_JSON_BYTES)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"model directory {root}: cannot read {CONFIG}: {exc}") from None
    if not isinstance(config, dict) or config.get("class") != HETERO_CLASS:
        raise CheckpointError(f"dataset {graph.root} is heterogeneous but model {root} is not (save a to_hetero or "
                              "HeteroConv model with hybridgnn.save_model(..., metadata=data.metadata()))")
    model = load_hetero_model(root, config)
    missing = [list(e) for e in model.edge_types if e not in graph.edges]
    if missing or set(model.node_types) - set(graph.node_types):
        raise CheckpointError(f"model {root} was saved for node types {model.node_types} and edge types "
                              f"{[list(e) for e in model.edge_types]}; dataset {graph.root} lacks "
                              f"{missing or sorted(set(model.node_types) - set(graph.node_types))}")
    widths = input_widths(model)
    for e in model.layer_edges[0]:
        for t in (e[0], e[2]):
            if widths[t] != graph.nodes[t].feature_dim:
                raise CheckpointError(f"model {root} reads {widths[t]}-wide features of node type {t!r} but dataset "
                                      f"{graph.root} has {graph.nodes[t].feature_dim}")
    return model, config
