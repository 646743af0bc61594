"""Model directories: config.json (the class, its constructor arguments, serving hints),
model.pt (the state_dict) and golden.pt (the model's answers on the golden graph).

`save_model` writes one from a live model; `load_model` rebuilds the model from the
allowlist (hybridgnn.models.zoo), loads the weights with torch.load(weights_only=True)
and strict keys, and refuses to serve unless every evaluation path reproduces the golden
answers (hybridgnn.models.golden). A weights file from another architecture, a wrong
option or a changed library therefore never serves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from hybridgnn.capabilities import write_replacing
from hybridgnn.config import (
    SMALL_JSON_BYTES,
    fanouts_served,
    fewer_hops,
    parse_fanouts,
    read_json,
)
from hybridgnn.errors import ConfigError
from hybridgnn.graph.store import written_by_torch_save
from hybridgnn.models import golden, zoo
from hybridgnn.models.decompose import decompose

FORMAT = 2
CONFIG, WEIGHTS, GOLDEN = "config.json", "model.pt", "golden.pt"


class CheckpointError(ConfigError):
    """A model directory is missing files, does not match its config, or fails its golden check."""


def save_model(model: nn.Module, path: str | Path, *, fanouts=None, extra: dict | None = None,
               metadata=None, link_decoder=None) -> Path:
    """Write `model` as a model directory hybridgnn can serve; UnsupportedModel (one line)
    when it is off the allowlist or uses an option some serving path cannot run exactly.

    fanouts: the serving default (one per layer; for a heterogeneous model also a dict of
    lists per edge type); extra: more JSON kept in config.json; metadata: the graph's
    (node types, edge types), as HeteroData.metadata() gives them, for a model made with
    to_hetero or HeteroConv (models/hetero_checkpoint.py); link_decoder: with metadata,
    "dot" or a module that scores (z_src, z_dst) pairs of node outputs (models/link.py)."""
    if metadata is not None:
        from hybridgnn.models.hetero_checkpoint import save_hetero_model

        return save_hetero_model(model, path, metadata, fanouts=fanouts, extra=extra, link_decoder=link_decoder)
    if link_decoder is not None:
        raise zoo.UnsupportedModel("link_decoder is for heterogeneous models (give metadata=data.metadata())")
    root = Path(path).expanduser()  # "~/models/x" from Python, as the CLI reads it
    check_extra(extra, {"format", "class", "args", "in_dim", "out_dim", "num_layers", "fanouts"})
    name, args = zoo.describe(model)
    model = zoo.servable_copy(model)
    was_training = model.training
    model.eval()
    try:
        stack = decompose(model)
        graph = golden.golden_graph(stack.in_dim)
        expected = golden.reference_outputs(model, graph)
        if not bool(torch.isfinite(expected).all()):
            raise zoo.UnsupportedModel(f"{type(model).__name__} gives non-finite outputs (NaN or inf) on the golden "
                                       "graph, so its answers cannot be checked; look for NaN or inf weights")
        # What load_model will do, done now: rebuild from the description, load the weights
        # strictly and run every path, so a model that would be refused is never written.
        rebuilt = zoo.build(name, args)
        try:
            _load_state(rebuilt, model.state_dict(), root)
        except CheckpointError as exc:  # it named a model.pt not yet written
            detail = str(exc).partition(": ")[2]
            raise zoo.UnsupportedModel(f"{type(model).__name__} holds tensors other than those its options make "
                                       f"({detail}): a module changed or added after it was built (a weight norm, "
                                       "an extra parameter) cannot be written down") from None
        problems = golden.mismatches(rebuilt, decompose(rebuilt), graph, expected)
    finally:
        model.train(was_training)
    if problems:
        raise zoo.UnsupportedModel(f"{type(model).__name__} cannot be served exactly: " + "; ".join(problems))
    if fanouts:  # as serve takes them: fewer hops than layers refused, more cut (a warning says so)
        fanouts = _fanouts(fanouts)
        refusal = fewer_hops(fanouts, stack.num_layers)
        if refusal:
            raise ConfigError(refusal)
        fanouts = fanouts_served(fanouts, stack.num_layers, doing="writing", logger=__name__)
    config = {"format": FORMAT, "class": name, "args": args, "in_dim": stack.in_dim, "out_dim": stack.out_dim,
              "num_layers": stack.num_layers, **({"fanouts": list(fanouts)} if fanouts else {}),
              **(extra or {})}
    root.mkdir(parents=True, exist_ok=True)
    # Weights and golden answers first, config last: a directory with a config.json is complete.
    write_replacing(root / WEIGHTS, lambda p: torch.save(model.state_dict(), p))
    write_replacing(root / GOLDEN, lambda p: torch.save({"x": graph.x, "edge_index": graph.edge_index,
                                                      "out": expected}, p))
    write_replacing(root / CONFIG, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    return root


def check_extra(extra, reserved: set[str]) -> None:
    """ConfigError (one line) unless `extra` is a JSON object whose keys save_model does not
    write itself. A reserved key overwrote save_model's (extra={"num_layers": 3} made a
    directory load refuses; {"fanouts": ..} passed unchecked), and a value JSON cannot hold
    (a numpy float32, a tensor) failed json.dumps after the weights were written."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise ConfigError(f"save_model extra must be a dict, got {type(extra).__name__}")
    clash = sorted(set(map(str, extra)) & reserved)
    if clash:
        raise ConfigError(f"save_model extra names {clash}, which save_model writes itself"
                          + (" (give fanouts=)" if "fanouts" in clash else ""))
    try:
        json.dumps(extra, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"save_model extra is not JSON: {exc}") from None


def _fanouts(fanouts) -> tuple[int, ...]:
    """fanouts as serve reads them (config.parse_fanouts: positive whole numbers, or "10,5"),
    or ConfigError. int() wrote 0, -1 and True as they were and 2.7 as 2, and serve then
    refused the model it had saved (or sampled other fanouts than given)."""
    try:
        return parse_fanouts(fanouts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"save_model fanouts: {exc}") from None


def save_checkpoint(model: nn.Module, path: str | Path, *, extra: dict | None = None) -> Path:
    """save_model with serving hints given as one dict (fanouts, dataset fingerprint, metrics)."""
    extra = dict(extra or {})
    return save_model(model, path, fanouts=extra.pop("fanouts", None), extra=extra)


def read_config(path: str | Path) -> dict:
    """config.json of a model directory, checked for the fields every reader needs."""
    root = Path(path).expanduser()  # "~/models/x" from Python, as the CLI reads it
    cfg_path = root / CONFIG
    if not cfg_path.is_file():
        if not root.exists() and not root.is_symlink():  # a mistyped path, more often than a directory without one
            raise CheckpointError(f"model directory {root} does not exist")
        if root.is_file():  # a weights file (model.pt, a state_dict) where its directory goes
            raise CheckpointError(f"{root} is a file, not a model directory (write one with hybridgnn.save_model "
                                  "or `hybridgnn model export`)")
        raise CheckpointError(not_a_file(cfg_path) or f"model directory {root} lacks {CONFIG} (write one with "
                              "hybridgnn.save_model or `hybridgnn model export`)")
    try:
        config = read_json(cfg_path, SMALL_JSON_BYTES)
    except ValueError as exc:
        raise CheckpointError(f"{cfg_path} is {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path} is not a JSON object")
    if config.get("class") == "hybridgnn.HeteroGNN":
        # read_config is the homogeneous readers' door (a homogeneous dataset, profile, place):
        # a heterogeneous model is served and precomputed over a heterogeneous dataset
        raise CheckpointError(f"{root} holds a heterogeneous model, which is served (from one --model "
                              "directory, not a model repository) and precomputed over a heterogeneous dataset "
                              "only (`hybridgnn dataset import` of its HeteroData), not profiled")
    if "spec" in config and "class" not in config:
        raise CheckpointError(f"{root} was written by an older hybridgnn (no golden outputs to check it "
                              "against); save it again with hybridgnn.save_model")
    for key, kind in (("class", str), ("args", dict), ("num_layers", int), ("in_dim", int), ("out_dim", int)):
        if not isinstance(config.get(key), kind):
            raise CheckpointError(f"{cfg_path} lacks {key!r} ({kind.__name__}); write it with hybridgnn.save_model")
    return config


def model_kind(config: dict) -> str:
    """A short label: the built-in GNN's kind (sage, gcn, gat), else the class name."""
    return config["args"].get("kind", "") if config["class"] == "hybridgnn.GNN" else config["class"].split(".")[-1]


def load_model(path: str | Path, map_location: str | torch.device = "cpu", *, check: bool = True):
    """(layer stack ready to serve, config) from a model directory; CheckpointError or
    UnsupportedModel (one line each) when it cannot be served exactly."""
    root = Path(path).expanduser()  # "~/models/x" from Python, as the CLI reads it
    config = read_config(root)
    state = load_tensors(root / WEIGHTS, map_location, mmap=True)
    check_fits(lambda: zoo.build(config["class"], config["args"]), state, root, config["args"].get("num_layers"))
    model = zoo.build(config["class"], config["args"])
    _load_state(model, state, root)
    model.eval()
    stack = decompose(model)
    if (stack.in_dim, stack.out_dim, stack.num_layers) != (config["in_dim"], config["out_dim"], config["num_layers"]):
        raise CheckpointError(f"{root / CONFIG}: in_dim/out_dim/num_layers do not match its class arguments")
    if check:
        t0 = time.perf_counter()
        saved = load_tensors(root / GOLDEN, "cpu", mmap=True)
        try:
            _check_golden_sizes(saved, stack, root / GOLDEN)
            graph = golden.GoldenGraph(saved["x"].float(), saved["edge_index"].long())
            expected = saved["out"].float()
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{root / GOLDEN} is not a golden-outputs file: {exc}") from exc
        if graph.x.ndim != 2 or graph.x.shape[1] != stack.in_dim:
            raise CheckpointError(f"{root / GOLDEN} has {tuple(graph.x.shape)} inputs for a "
                                  f"{stack.in_dim}-feature model")
        _check_golden_graph(graph, root / GOLDEN)
        if expected.ndim != 2 or expected.shape[0] != graph.x.shape[0]:  # the seeds' rows are read from it
            raise CheckpointError(f"{root / GOLDEN} holds {tuple(expected.shape)} outputs for a graph of "
                                  f"{graph.x.shape[0]} nodes")
        problems = golden.mismatches(model, stack, graph, expected)
        if problems:
            raise CheckpointError(f"{root} does not reproduce its golden outputs (tolerance "
                                  f"{golden.GOLDEN_TOLERANCE:g}), so it is not served: " + "; ".join(problems)
                                  + "; the weights, an option or the library version differ from what was saved")
        config = {**config, "golden_check_s": time.perf_counter() - t0}
    return stack, config


def _check_golden_sizes(saved, stack, path: Path) -> None:
    """CheckpointError unless a golden file holds tensors no larger than a golden graph's:
    GOLDEN_NODES nodes' inputs and outputs, one edge per pair of them. Its tensors were
    otherwise converted and evaluated whatever their size (a golden.pt of a million nodes
    ran the model on them)."""
    n = golden.GOLDEN_NODES
    limits = {"x": n * stack.in_dim, "edge_index": 2 * n * n, "out": n * stack.out_dim}
    for key, limit in limits.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path} is not a golden-outputs file: its {key!r} is not a tensor "
                                  f"({type(value).__name__})")
        if value.numel() > limit:
            raise CheckpointError(f"{path} holds {key} of shape {tuple(value.shape)}, more than a golden graph of "
                                  f"{n} nodes has")


def _check_golden_graph(graph: golden.GoldenGraph, path: Path) -> None:
    """CheckpointError unless the saved golden graph can be evaluated: it holds the golden
    seeds and its edges are (source, target) pairs of its nodes. A damaged file otherwise
    failed inside the model's forward with a traceback."""
    n, ei = graph.x.shape[0], graph.edge_index
    if n <= max(golden.GOLDEN_SEEDS):
        raise CheckpointError(f"{path} holds a graph of {n} nodes; golden graphs have {golden.GOLDEN_NODES}")
    if ei.ndim != 2 or ei.shape[0] != 2:
        raise CheckpointError(f"{path} has an edge_index of shape {tuple(ei.shape)}, not [2, edges]")
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
        raise CheckpointError(f"{path} has edges to nodes outside its {n}")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu"):
    """load_model, golden check included."""
    return load_model(path, map_location)


def weights_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 prefix of a model directory's weights: each state_dict entry's name, dtype,
    shape and bytes, in name order (nested containers entry by entry). What profiles and
    precomputed embeddings were made with. The file's own bytes would not do: torch.save
    writes a random serialization id, so the same weights saved twice would differ.
    Cached per file (path, size, modification and change times, inode): servers check it
    several times. Size and mtime alone kept the old fingerprint for other weights renamed
    over the file with the old mtime (rsync -t, images with fixed mtimes)."""
    path = Path(model_dir) / WEIGHTS
    try:
        st = path.stat()
    except OSError:
        raise CheckpointError(f"model directory {path.parent} lacks {path.name}") from None
    return _values_fingerprint(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def weights_match(stored: str | None, model_dir: str | Path) -> bool:
    """Whether a fingerprint recorded with some artefact names this directory's weights:
    today's (weights_fingerprint) or, for what was made before it, the weights file's
    SHA-256 prefix."""
    # the file is hashed only when today's fingerprint does not match
    return stored is not None and (stored == weights_fingerprint(model_dir) or stored == _file_fingerprint(model_dir))


def _file_fingerprint(model_dir: str | Path) -> str:
    return hash_file(hashlib.sha256(), Path(model_dir) / WEIGHTS).hexdigest()[:16]


def hash_file(h, path: Path):
    """h (a hashlib object) updated with the file's bytes, read in 1 MiB chunks."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h


@functools.lru_cache(maxsize=16)
def _values_fingerprint(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> str:
    try:  # mapped, not read: a large model is hashed without a second copy in memory
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old-format file cannot be mapped; load_tensors explains what cannot load
        state = load_tensors(Path(path), "cpu")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state_dict")
    h = hashlib.sha256()
    try:
        _hash_value(h, "", state)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot fingerprint {path}: {exc}") from exc
    return h.hexdigest()[:16]


def _hash_value(h, name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().resolve_conj().resolve_neg().contiguous()
        h.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    elif isinstance(value, dict):
        h.update(f"{name}\0dict{len(value)}\0".encode())
        for key in sorted(value, key=str):
            _hash_value(h, f"{name}.{key}", value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{name}\0{type(value).__name__}{len(value)}\0".encode())
        for i, item in enumerate(value):
            _hash_value(h, f"{name}[{i}]", item)
    else:  # weights_only admits plain values beside tensors (numbers, strings, None)
        h.update(f"{name}\0{value!r}\0".encode())


def load_tensors(path: Path, map_location="cpu", *, missing: str | None = None, mmap: bool = False):
    """torch.load(weights_only=True) of a file, or a CheckpointError in one line: `missing`
    (default: the model directory lacks the file), not a torch.save file, or what the
    unpickler refused (load_failure). mmap: tensors mapped from the file, not read (a
    zip-format file; older ones are read), so a file holding more than its checks accept
    is refused without reading it: a weights file with a stray gigabyte tensor was read
    whole into the serving process before its keys were compared."""
    if not path.is_file():
        raise CheckpointError(not_a_file(path) or missing or f"model directory {path.parent} lacks {path.name}")
    if not written_by_torch_save(path):
        raise CheckpointError(f"cannot load {path}: it is not a file torch.save wrote (a text file, or a truncated "
                              "download?)")
    if mmap:
        with open(path, "rb") as f:
            mmap = f.read(2) == b"PK"  # the zip format; a pre-1.6 pickle cannot be mapped
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except OSError:
            if not mmap:
                raise
            # a filesystem that cannot map files (some FUSE mounts): read it
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # unpickling errors come in several types; say only the cause
        raise CheckpointError(f"cannot load {path} (tensors only, weights_only=True): {load_failure(exc)}") from exc


def not_a_file(path: Path) -> str | None:
    """Why a path that is there is not a regular file (a directory, a link that does not
    resolve, a fifo), or None when nothing is there. Such paths were said to be missing."""
    if path.is_symlink() and not path.exists():  # exists() follows the link: a loop or a dangling target
        return f"{path} is a link that does not lead to a file (it loops, or its target is gone)"
    if path.is_dir():
        return f"{path} is a directory, not a file"
    if path.exists():
        return f"{path} is not a regular file"
    return None


def load_failure(exc: BaseException) -> str:
    """One line saying why torch.load(weights_only=True) failed. For a file holding more
    than tensors, torch's first line advises loading it with weights_only=False (running
    its code); say what it holds instead (the line naming the refused global)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].startswith("Weights only load failed"):
        # "WeightsUnpickler error: Unsupported global: GLOBAL x ..." or "Trying to load unsupported GLOBAL x ..."
        cause = next((line for line in lines[1:] if "GLOBAL" in line), "")
        cause = cause.removeprefix("WeightsUnpickler error:").strip().split(". ")[0].rstrip(".")
        if not cause:
            operand = next((line for line in lines[1:] if line.startswith("Unsupported operand")), "")
            if operand:  # a pickle's header, then not a pickle (a truncated or damaged file)
                return f"it is not a file torch.save wrote ({operand})"
        return "it holds objects other than tensors, which are never unpickled" + (f" ({cause})" if cause else "")
    return lines[0]


def check_fits(build, state, root: Path, num_layers=None) -> None:
    """CheckpointError unless the module build() makes holds exactly the tensors (names and
    shapes) of state, found with it built on the meta device, where nothing is allocated:
    config.json's widths and depth were otherwise allocated as it said before the weights
    were compared (a width of 10**9 asked for gigabytes, a million layers took minutes and
    gigabytes of modules). num_layers: the depth config.json gives, refused before any
    build when state holds fewer tensors (every layer has weights of its own)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{root / WEIGHTS} holds a {type(state).__name__}, not a state_dict")
    if isinstance(num_layers, int) and num_layers > len(state):
        raise CheckpointError(f"{root / CONFIG} gives {num_layers} layers but {root / WEIGHTS} holds only "
                              f"{len(state)} tensors")
    with torch.device("meta"):
        probe = build()
    with warnings.catch_warnings():  # copying into a meta parameter is a no-op, and says so
        warnings.simplefilter("ignore")
        _load_state(probe, state, root)


def _load_state(model: nn.Module, state, root: Path) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"{root / WEIGHTS} holds a {type(state).__name__}, not a state_dict")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        missing = sorted(set(model.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(model.state_dict()))
        detail = (f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                  f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
                  if missing or unexpected else "tensor shapes differ from the architecture's")
        raise CheckpointError(f"weights in {root / WEIGHTS} do not fit {type(model).__name__}: {detail}") from exc


