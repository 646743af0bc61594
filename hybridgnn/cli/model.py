"""`hybridgnn model`: write a model directory from a script's model (export) and check one
(check) before serving it."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path
from hybridgnn.cli.outputs import check_out, staged_directory
from hybridgnn.config import SMALL_JSON_BYTES, read_json

FORCE_HELP = "replace --out when it already holds something (once the new model directory is whole)"


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="export a PyTorch Geometric model for serving, or check a model directory")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    e = actions.add_parser(
        "export", formatter_class=DefaultsHelpFormatter,
        help="build a model with your factory function, load its weights and write a model directory",
        description="Calls FACTORY (module:function, imported from the current directory or PYTHONPATH) with no "
                    "arguments to build the model, loads WEIGHTS (a state_dict saved with torch.save; tensors "
                    "only) into it strictly, and writes OUT as hybridgnn.save_model does: config.json, model.pt "
                    "and golden outputs. A model hybridgnn cannot serve exactly is refused with the reason.")
    e.add_argument("--factory", required=True, help="module:function returning the model, e.g. train:build_model")
    e.add_argument("--weights", type=user_path, required=True, help="state_dict file (torch.save(model.state_dict()))")
    e.add_argument("--out", type=user_path, required=True, help="model directory to write")
    e.add_argument("--fanouts", default=None, help="serving default, one per layer, e.g. 10,5 (default: 10 per layer)")
    e.add_argument("--force", action="store_true", help=FORCE_HELP)
    e.set_defaults(run=run_export)

    c = actions.add_parser("check", help="rebuild a model directory's model and verify its golden outputs",
                           description="Prints what the directory holds and whether it can be served; exits 2 "
                                       "with the reason when it cannot.")
    c.add_argument("model_dir", type=user_path, help="model directory to check")
    c.set_defaults(run=run_check)


def _factory(spec: str):
    from hybridgnn.errors import ConfigError

    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"--factory must be module:function, got {spec!r}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: the user's own module
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for --factory: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{module_name} has no function {func_name!r}")
    return func


def run_export(args) -> int:
    import torch

    from hybridgnn.config import parse_fanouts
    from hybridgnn.errors import ConfigError
    from hybridgnn.models.checkpoint import load_tensors, save_model

    check_out(args.out, directory=True, staged=True, force=args.force)  # before the model is built, not after
    model = _factory(args.factory)()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{args.factory} returned a {type(model).__name__}, not a torch.nn.Module")
    state = load_tensors(args.weights, missing=f"weights file {args.weights} does not exist", mmap=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a training checkpoint that wraps it
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise ConfigError(f"weights in {args.weights} do not fit the model {args.factory} builds: "
                          f"{' '.join(str(exc).split())[:300]}") from exc
    fanouts = parse_fanouts(args.fanouts) if args.fanouts else None
    with staged_directory(args.out, "exporting") as staging:  # moved in whole: never half a model at --out
        save_model(model, staging, fanouts=fanouts)
    return _print_summary(args.out)


def run_check(args) -> int:
    return _print_summary(args.model_dir)


def _print_summary(model_dir: Path) -> int:
    import time

    from hybridgnn.models.checkpoint import CONFIG, load_model

    try:
        saved = read_json(Path(model_dir) / CONFIG, SMALL_JSON_BYTES)
    except (OSError, ValueError):
        saved = {}  # load_model names what is wrong
    if isinstance(saved, dict) and saved.get("class") == "hybridgnn.HeteroGNN":
        from hybridgnn.models.hetero_checkpoint import load_hetero_model

        t0 = time.perf_counter()
        model = load_hetero_model(model_dir, saved)
        print(json.dumps({"model": str(model_dir), "class": saved["class"], "node_types": model.node_types,
                          "edge_types": [list(e) for e in model.edge_types], "in_dims": saved.get("in_dims"),
                          "out_dims": saved.get("out_dims"), "num_layers": model.num_layers,
                          "fanouts": saved.get("fanouts"), "golden_check": "passed",
                          "golden_check_ms": round(1000 * (time.perf_counter() - t0), 1)}, indent=2))
        return 0
    stack, config = load_model(model_dir)
    print(json.dumps({"model": str(model_dir), "class": config["class"], "args": config["args"],
                      "in_dim": stack.in_dim, "out_dim": stack.out_dim, "num_layers": stack.num_layers,
                      "fanouts": config.get("fanouts"), "golden_check": "passed",
                      "golden_check_ms": round(1000 * config["golden_check_s"], 1)}, indent=2))
    return 0
