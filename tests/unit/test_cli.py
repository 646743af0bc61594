import json

import numpy as np
import pytest

from hybridgnn.cli.main import build_parser, main
from hybridgnn.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_demo(monkeypatch):
    """No test here generates the demo (~30 s, into the user's cache): a flag mistake
    with no --dataset must be answered before the demo is made."""
    import hybridgnn.demo

    def no_demo(*_args, **_kwargs):
        raise AssertionError("the demo was generated before the flags were checked")

    monkeypatch.setattr(hybridgnn.demo, "ensure_demo", no_demo)


def test_every_command_has_help(capsys):
    for cmd in (["serve"], ["dataset", "generate", "powerlaw"], ["dataset", "generate", "csbm"], ["dataset", "generate", "hetero"],
                ["dataset", "import"], ["dataset", "info"], ["workload", "build"], ["train"], ["precompute"],
                ["bench"], ["model", "export"], ["model", "check"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(cmd + ["--help"])
        assert info.value.code == 0
        assert "usage: hybridgnn" in capsys.readouterr().out


def test_generate_build_train_info(tmp_path, capsys):
    data = tmp_path / "g"
    assert main(["dataset", "generate", "csbm", "--out", str(data), "--num-nodes", "600", "--num-classes", "3",
                 "--feature-dim", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["num_nodes"] == 600
    assert main(["workload", "build", "--dataset", str(data), "--fanouts", "4,2", "--seeds", "degree"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fap"].endswith("fap_4-2_degree.npy") and out["psgs_mean"] > 1
    assert main(["train", "--dataset", str(data), "--out", str(tmp_path / "m"), "--epochs", "1",
                 "--fanouts", "4,2", "--hidden-dim", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(tmp_path / "m")
    assert main(["precompute", "--dataset", str(data), "--model", str(tmp_path / "m"), "--order", "rcm"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layers"] == [[600, 8], [600, 3]] and out["computed_unix_s"] > 0
    assert main(["dataset", "info", str(data), "--full"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["labelled"] is True and info["validated"] == "sizes, meta.json and every index"
    (tmp_path / "seeds.txt").write_text("1 5 600 7 -2\n")
    assert main(["workload", "build", "--dataset", str(data), "--fanouts", "4,2", "--seeds",
                 str(tmp_path / "seeds.txt")]) == 2
    assert "has 2 ids outside the graph's [0, 600), the first 600" in capsys.readouterr().err


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["dataset", "info", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "does not exist" in err
    assert main(["workload", "build", "--dataset", str(tmp_path), "--fanouts", "0"]) == 2
    assert main(["serve", "--dataset", str(tmp_path)]) == 2
    assert "give both --dataset and --model" in capsys.readouterr().err


def test_import_command(tmp_path, capsys):
    np.savez(tmp_path / "e.npz", edge_index=np.array([[0, 1, 2], [1, 2, 0]]))
    assert main(["dataset", "import", str(tmp_path / "e.npz"), "--out", str(tmp_path / "d"), "--undirected"]) == 0
    assert json.loads(capsys.readouterr().out)["num_edges"] == 6


def test_a_config_error_from_the_engine_is_one_line_and_exit_2(tmp_path, tiny_model, capsys):
    from hybridgnn.graph.generate import generate_csbm

    generate_csbm(tmp_path / "other", num_nodes=200, feature_dim=7, seed=0)
    capsys.readouterr()
    assert main(["serve", "--dataset", str(tmp_path / "other"), "--model", str(tiny_model), "--port", "0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("hybridgnn serve: error:") and "16-dim features" in lines[0]


FACTORY = """
from torch_geometric.nn.models import GraphSAGE


def build():
    return GraphSAGE(8, 16, 2, 3, aggr="max", act="tanh", norm="batch")
"""


def _factory_module(tmp_path, monkeypatch):
    """FACTORY as the module my_factory_mod in tmp_path, the working directory (imported
    afresh), as `model export --factory my_factory_mod:build` finds it."""
    import importlib
    import sys

    (tmp_path / "my_factory_mod.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_factory_mod", raising=False)
    return importlib.import_module("my_factory_mod")


def test_model_export_and_check(tmp_path, capsys, monkeypatch):
    import torch

    my_factory_mod = _factory_module(tmp_path, monkeypatch)
    torch.save({"state_dict": my_factory_mod.build().state_dict()}, tmp_path / "w.pt")
    assert main(["model", "export", "--factory", "my_factory_mod:build", "--weights", "w.pt", "--out", "m",
                 "--fanouts", "4,3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["class"] == "torch_geometric.GraphSAGE" and out["args"]["aggr"] == "max"
    assert out["fanouts"] == [4, 3] and out["golden_check"] == "passed"
    assert main(["model", "check", "m"]) == 0
    assert json.loads(capsys.readouterr().out)["args"]["norm"] == "batch"
    # Weights of another model: one line, exit 2, nothing written.
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "bad.pt")
    assert main(["model", "export", "--factory", "my_factory_mod:build", "--weights", "bad.pt", "--out", "m2"]) == 2
    err = capsys.readouterr().err
    assert "do not fit the model my_factory_mod:build" in err and err.count("\n") == 1
    assert not (tmp_path / "m2").exists()
    assert main(["model", "export", "--factory", "nomodule_here:build", "--weights", "w.pt", "--out", "m3"]) == 2
    assert "cannot import 'nomodule_here'" in capsys.readouterr().err
    # weights that are missing or not a torch file: the loader's own one line
    (tmp_path / "text.pt").write_text("hello\n")
    for weights, said in (("none.pt", "weights file none.pt does not exist"),
                          ("text.pt", "it is not a file torch.save wrote")):
        assert main(["model", "export", "--factory", "my_factory_mod:build", "--weights", weights, "--out", "m4"]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err


def test_model_export_takes_fanouts_as_serve_does(tmp_path, capsys, monkeypatch, caplog):
    """More hops than layers were written as given (config.json said 3 hops for a 2-layer
    model) without a word; fewer were refused in other words than serve's."""
    import torch

    torch.save(_factory_module(tmp_path, monkeypatch).build().state_dict(), tmp_path / "w.pt")
    export = ["model", "export", "--factory", "my_factory_mod:build", "--weights", "w.pt", "--out"]
    with caplog.at_level("WARNING"):
        assert main(export + ["m", "--fanouts", "4,3,2"]) == 0
    assert json.loads(capsys.readouterr().out)["fanouts"] == [4, 3]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["fanouts"] == [4, 3]
    assert "fanouts [4, 3, 2] give 3 hops but the model has 2 layers; writing the first 2" in caplog.text
    assert main(export + ["m2", "--fanouts", "4"]) == 2
    err = capsys.readouterr().err
    assert "fanouts [4] give 1 hop but the model has 2 layers; give one fanout per layer" in err
    assert err.count("\n") == 1 and not (tmp_path / "m2").exists()


def test_a_policy_without_a_profile_is_refused_in_one_line(capsys):
    assert main(["serve", "--policy", "slo:20"]) == 2
    err = capsys.readouterr().err
    assert "--policy slo:20 needs --profile" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["serve", "--update-token", "short"], ["serve", "--workers", "0"], ["serve", "--max-batch-seeds", "0"],
    # tokens no Authorization header carries as they are: every update was then a 401
    ["serve", "--update-token", "token-123\n"], ["serve", "--update-token", " token-123"],
    ["serve", "--update-token", "tökén-123"], ["serve", "--update-token", "token\t123"],
    ["serve", "--device", "cpu", "--cpu-lane", "split"], ["profile", "--fanouts", "x,y"], ["profile", "--workers", "0"],
    # arrays of these sizes: a MemoryError traceback; NaN profiled nothing
    ["profile", "--bins", "1000000000"], ["profile", "--max-batch", "1000000000000"], ["profile", "--budget-s", "nan"],
    ["profile", "--budget-s", "inf"],
])
def test_flag_mistakes_with_the_demo_are_refused_before_it_is_made(argv, capsys):
    """(_no_demo fails any test that makes the demo.)"""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err


def test_first_hour_mistakes_get_one_line_or_the_subcommand_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["dataset", "import", "x.txt", "--out", "y", "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: hybridgnn dataset import" in err and "unrecognized arguments: --bogus" in err
    assert main(["serve", "--max-wait-ms", "-1"]) == 2
    assert "--max-wait-ms must be within [0, 10000] milliseconds, got -1" in capsys.readouterr().err
    for delay in ("0", "nan", "60001"):  # it said "max_queue_delay_s must be within (0, 60] seconds, got 0.0"
        assert main(["serve", "--max-queue-delay-ms", delay]) == 2
        assert f"--max-queue-delay-ms must be within (0, 60000] milliseconds, got {delay}" in capsys.readouterr().err
    (tmp_path / "e.txt").write_text("0 1\n1 2\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--force"]) == 0


def test_precompute_warns_about_a_model_trained_on_another_dataset(tmp_path, caplog, capsys):
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m", extra={"dataset_fingerprint": "elsewhere"})
    with caplog.at_level("WARNING"):
        assert main(["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m")]) == 0
    assert any("trained on dataset elsewhere" in r.getMessage() for r in caplog.records)


def test_serving_a_model_trained_on_another_dataset_warns_once_naming_both(tmp_path, caplog):
    """serve said "model was trained on dataset X, serving dataset Y" once, then once more,
    without a timestamp, from each CPU worker process (which opens the same resources
    again): three lines on 2 cores, nine with 8 workers. Now the server says it once, with
    the paths; a worker process says nothing."""
    from hybridgnn.config import ServeConfig
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec
    from hybridgnn.runtime.resources import Resources

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m", extra={"dataset_fingerprint": "elsewhere"})
    cfg = ServeConfig(dataset_dir=tmp_path / "d", model_dir=tmp_path / "m")

    def warnings(in_worker: bool) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING"):
            Resources.open(cfg, in_worker=in_worker).close()
        return [r.getMessage() for r in caplog.records if "trained on another dataset" in r.getMessage()]

    (said,) = warnings(in_worker=False)
    assert str(tmp_path / "m") in said and str(tmp_path / "d") in said and "elsewhere" in said
    assert warnings(in_worker=True) == []


def test_serve_flags_come_from_the_config_fields_with_their_defaults():
    """One default per setting: parsing no flags gives back each config's own defaults,
    and a flag in another unit converts both ways."""
    from hybridgnn.cli.flags import config_values, settings
    from hybridgnn.config import (
        AdmissionConfig,
        BatcherConfig,
        DeviceMemoryConfig,
        NewNodeConfig,
        PolicyConfig,
        SamplingConfig,
        ServerConfig,
        UpdateConfig,
    )

    classes = (ServerConfig, BatcherConfig, AdmissionConfig, SamplingConfig, PolicyConfig, NewNodeConfig,
               UpdateConfig, DeviceMemoryConfig)
    args = build_parser().parse_args(["serve"])
    for cls in classes:
        assert settings(cls), cls
        assert config_values(args, cls) == {f.name: f.default for f in settings(cls)}, cls
    args = build_parser().parse_args(["serve", "--max-wait-ms", "5", "--max-pending", "7", "--port", "9001",
                                      "--gpu-cache-bytes", "512M", "--max-queue-delay-ms", "40"])
    assert config_values(args, BatcherConfig)["max_wait_s"] == 0.005
    assert config_values(args, BatcherConfig)["max_pending_requests"] == 7
    assert config_values(args, ServerConfig)["port"] == 9001
    assert config_values(args, DeviceMemoryConfig)["cache_bytes"] == 512 << 20
    assert config_values(args, AdmissionConfig)["max_queue_delay_s"] == 0.04


def test_worker_cpus_resolve_or_are_refused_in_one_line(monkeypatch, capsys):
    import os

    from hybridgnn.cli import serve as serve_cli

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(serve_cli, "CPU_COUNT", 4)
    assert serve_cli.chosen_worker_cpus("2-3", processes=True) == (2, 3)
    assert serve_cli.chosen_worker_cpus("", processes=False) == ()
    with pytest.raises(ConfigError, match=r"may not run on core\(s\) \[7\] \(it may use \[0, 1, 2, 3\]\)"):
        serve_cli.chosen_worker_cpus("3,7", processes=True)
    with pytest.raises(ConfigError, match="pins worker processes, which are off"):
        serve_cli.chosen_worker_cpus("1", processes=False)
    with pytest.raises(ConfigError, match="--worker-cpus: cores must be"):
        serve_cli.chosen_worker_cpus("x", processes=True)
    args = build_parser().parse_args(["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5",
                                      "--worker-cpus", "1-2"])
    cfg = serve_cli.build_config(args)
    assert cfg.cpu_pipeline.cpus == (1, 2) and cfg.cpu_pipeline.processes
    assert cfg.cpu_pipeline.workers == 2  # one worker per given core unless --workers says otherwise
    args = build_parser().parse_args(["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5",
                                      "--worker-cpus", "1-2", "--workers", "3"])
    assert serve_cli.build_config(args).cpu_pipeline.workers == 3
    args = build_parser().parse_args(["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5"])
    cfg = serve_cli.build_config(args)
    assert cfg.cpu_pipeline.cpus == () and cfg.cpu_pipeline.workers == 4
    assert main(["serve", "--worker-cpus", "1", "--worker-processes", "off"]) == 2
    err = capsys.readouterr().err
    assert "--worker-cpus pins worker processes" in err and err.count("\n") == 1


def test_keep_off_cores_changes_nothing_it_cannot_honour(monkeypatch):
    import os

    from hybridgnn.capabilities import keep_off_cores

    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: calls.append((pid, set(cores))))
    assert keep_off_cores(()) is None and keep_off_cores((0, 1)) is None and calls == []
    assert keep_off_cores((1,)) == {0}
    assert calls and all(cores == {0} for _, cores in calls)  # every thread of the process


def test_heterogeneous_generate_tables_model_check_and_serve_refusals(tmp_path, capsys):
    import torch
    from torch_geometric.nn import GraphSAGE, to_hetero

    import hybridgnn
    from hybridgnn.graph.hetero import HeteroGraphStore

    data = tmp_path / "rec"
    assert main(["dataset", "generate", "hetero", "--out", str(data), "--schema", "recsys", "--num-nodes", "80",
                 "--avg-degree", "4"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "hetero" and set(info["node_types"]) == {"user", "item"}
    assert main(["workload", "build", "--dataset", str(data), "--fanouts", '{"rates": [3, 2], "rev_rates": [2, 2]}']) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["psgs_mean"]) == {"user", "item"} and out["psgs_mean"]["user"] > 1
    assert main(["workload", "build", "--dataset", str(data), "--fanouts", '{"rates": [3]}']) == 2
    assert "missing ['item__rev_rates__user']" in capsys.readouterr().err
    graph = HeteroGraphStore.open(data)
    x = {t: torch.from_numpy(np.array(n.features)) for t, n in graph.nodes.items()}
    ei = {e: torch.from_numpy(np.stack([np.asarray(d.indices, np.int64),
                                        np.repeat(np.arange(d.indptr.shape[0] - 1), np.diff(d.indptr))]))
          for e, d in graph.edges.items()}
    model = to_hetero(GraphSAGE((-1, -1), 8, num_layers=2, out_channels=2), graph.metadata())
    with torch.no_grad():
        model(x, ei)
    hybridgnn.save_model(model, tmp_path / "m", metadata=graph.metadata(), fanouts=[3, 2])
    assert main(["model", "check", str(tmp_path / "m")]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["golden_check"] == "passed" and checked["in_dims"] == {"user": 16, "item": 24}
    # what is not served for heterogeneous graphs is refused at start, in one line
    assert main(["serve", "--dataset", str(data), "--model", str(tmp_path / "m"), "--port", "0",
                 "--update-token", "long-enough-token"]) == 2
    err = capsys.readouterr().err
    assert "graph updates are not served for heterogeneous graphs" in err and len(err.strip().splitlines()) == 1
    hybridgnn.save_model(GraphSAGE(16, 8, num_layers=2, out_channels=2), tmp_path / "homo")
    assert main(["serve", "--dataset", str(data), "--model", str(tmp_path / "homo"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "is heterogeneous but model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("env, said", [
    ({"HYBRIDGNN_DEVICE": "gpu"}, "argument --device: invalid choice 'gpu' (from HYBRIDGNN_DEVICE"),
    ({"HYBRIDGNN_PORT": "abc"}, "HYBRIDGNN_PORT='abc' is not a valid int"),
    ({"HYBRIDGNN_SPILL": "maybe"}, "HYBRIDGNN_SPILL='maybe' is not a valid boolean"),
    ({"HYBRIDGNN_LOG_LEVEL": "loud"}, "argument --log-level: invalid choice 'LOUD' (from HYBRIDGNN_LOG_LEVEL"),
])
def test_settings_from_the_environment_are_checked_as_flags_are(env, said, monkeypatch, capsys):
    """Each refused in one line, without the usage (no flag on the command line was
    wrong): HYBRIDGNN_DEVICE=gpu printed serve's ~60-line usage first."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and err.count("\n") == 1 and "usage:" not in err, err


@pytest.mark.parametrize("flags", [["--simulate", "-2"], ["--simulate", "3", "--batch-size", "0"]])
def test_place_refuses_a_bad_simulation_before_any_work(flags, tmp_path, capsys):
    assert main(["place", "--dataset", str(tmp_path / "not-opened"), *flags]) == 2
    assert "--simulate must be >= 0 and --batch-size >= 1" in capsys.readouterr().err


def test_every_flag_and_argument_says_what_it_is():
    import argparse

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif not action.help:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), ["hybridgnn"])
    assert not missing, missing


def test_rank_outside_torchrun_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["rank", "--dataset", "d", "--model", "m"]) == 2
    assert "RANK and WORLD_SIZE not set: start ranks with torchrun" in capsys.readouterr().err


def test_precompute_device_mistakes_are_one_line(tmp_path, capsys, monkeypatch):
    """--device cuda on a machine without CUDA, or a name torch does not parse, is one
    line with exit 2 before anything runs (it was a traceback from model.to)."""
    import torch

    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m")
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m")]
    assert main(argv + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: no CUDA device is visible" in err
    assert main(argv + ["--device", "gpu0"]) == 2
    assert "--device must be cpu or cuda[:i], got 'gpu0'" in capsys.readouterr().err
    assert not (tmp_path / "m" / "embeddings").exists()


def test_precompute_batch_size_is_checked_by_its_flag(tmp_path, capsys):
    """--batch-size 0 said 'need 1 <= batch_size <= max_batch_size' (no such flag as
    max_batch_size), and an initial batch past 1,048,576 targets was refused for it: the
    flag has no upper bound, and the batches then grow up to it."""
    from hybridgnn.embeddings.store import EmbeddingStore
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m")
    capsys.readouterr()
    argv = ["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m")]
    for bad in ("0", "-3"):
        assert main(argv + ["--batch-size", bad]) == 2
        assert capsys.readouterr().err == f"hybridgnn precompute: error: --batch-size must be >= 1, got {bad}\n"
    assert main(argv + ["--batch-size", "2000000"]) == 0
    assert EmbeddingStore.for_graph(tmp_path / "m", GraphStore.open(tmp_path / "d")) is not None


def test_cpu_compute_device_cuda_without_cuda_is_one_line(tmp_path, capsys, monkeypatch):
    """serve and profile refuse --cpu-compute-device cuda without a CUDA device before
    anything starts (the first worker's model.to raised a traceback)."""
    import hybridgnn.capabilities

    monkeypatch.setattr(hybridgnn.capabilities, "HAS_CUDA", False, raising=False)
    for command in ("serve", "profile"):
        assert main([command, "--cpu-compute-device", "cuda", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--cpu-compute-device cuda: no CUDA device is visible" in err, err


def test_help_says_each_default_once_and_never_none(capsys):
    """A flag whose help already says its default gets no second "(default: None)", and
    switches get no "(default: True)" (--no-spill read as if spilling were off)."""
    import re

    for cmd in (["serve"], ["profile"], ["cluster"], ["precompute"], ["place"], ["bench"], ["train"], ["rank"],
                ["dataset", "import"], ["dataset", "generate", "powerlaw"], ["model", "export"], ["workload", "build"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(cmd + ["--help"])
        text = capsys.readouterr().out
        for option in re.split(r"\n  (?=-)", text):
            flat = " ".join(option.split())
            assert flat.count("(default") <= 1, (cmd, flat)
            for bad in ("(default: None)", "(default: True)", "(default: False)", "(default: )"):
                assert bad not in flat, (cmd, flat)


def test_a_bad_environment_value_is_refused_only_by_the_command_that_reads_it(tmp_path, capsys, monkeypatch):
    """HYBRIDGNN_PORT=abc (meant for serve) once broke every command, --help included; now
    `serve` and `cluster` refuse it in one line, a --port flag overrides it, and other
    commands run."""
    monkeypatch.setenv("HYBRIDGNN_PORT", "abc")
    monkeypatch.setenv("HYBRIDGNN_MAX_WAIT_MS", "soon")
    (tmp_path / "e.txt").write_text("0 1\n1 2\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    for argv, variable in ((["serve"], "HYBRIDGNN_"), (["cluster"], "HYBRIDGNN_PORT='abc' is not a valid int")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"hybridgnn {argv[0]}: error: {variable}"), err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "18100"])  # the flag wins over the variable; the other bad one still refuses
    assert "HYBRIDGNN_MAX_WAIT_MS='soon' is not a valid float" in capsys.readouterr().err


def test_log_level_is_taken_after_the_command_too_in_any_case():
    """`hybridgnn serve --log-level DEBUG` was refused as an unrecognized argument, and
    `debug` as an invalid choice."""
    parser = build_parser()
    assert parser.parse_args(["dataset", "info", "d", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "warning", "serve"]).log_level == "WARNING"
    assert parser.parse_args(["serve", "--log-level=ERROR"]).log_level == "ERROR"
    assert parser.parse_args(["--log-level", "ERROR", "serve"]).log_level == "ERROR"  # not reset by serve's
    assert parser.parse_args(["serve"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--log-level", "LOUD"])


def test_log_level_is_taken_from_the_environment_as_every_serve_flag_is(monkeypatch, capsys):
    """`serve --help` lists --log-level and says every flag can be set as HYBRIDGNN_<FLAG>;
    HYBRIDGNN_LOG_LEVEL was ignored. A value off the choices is refused in one line (it
    was passed to logging unchecked)."""
    monkeypatch.setenv("HYBRIDGNN_LOG_LEVEL", "debug")
    parser = build_parser()
    assert parser.parse_args(["serve"]).log_level == "DEBUG"
    assert parser.parse_args(["serve", "--log-level", "error"]).log_level == "ERROR"  # the flag wins
    monkeypatch.setenv("HYBRIDGNN_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit) as info:
        main(["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice 'LOUD' (from HYBRIDGNN_LOG_LEVEL" in err, err


def test_a_flag_value_its_parser_refuses_says_why(capsys):
    """argparse said "invalid <lambda> value: '1X'" and "invalid parse_frontends value: '0'"."""
    for argv, why in ((["serve", "--gpu-cache-bytes", "1X"], "expected a byte count such as 512M or 4G, got '1X'"),
                      (["serve", "--frontends", "0"], "--frontends must be >= 1 (or auto), got 0"),
                      (["profile", "--gpu-cache-bytes", "1X"], "expected a byte count")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert why in err and "<lambda>" not in err and "parse_frontends" not in err, err


def test_a_setting_the_config_refuses_is_named_by_its_flag(capsys):
    """The config's checks name fields: `--max-pending 0` said 'max_pending_requests must
    be >= 1', a name the user never typed."""
    for argv, said in ((["serve", "--max-pending", "0"], "--max-pending must be >= 1, got 0"),
                       (["serve", "--srpe-gamma", "2"], "--srpe-gamma must be within [0, 1], got 2.0"),
                       (["serve", "--update-token", "12345678", "--update-batch", "0"],
                        "--update-batch must be >= 1, got 0")):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"hybridgnn serve: error: {said}\n"
    from hybridgnn.cli.flags import in_flag_words

    # a lone word that names a setting is left alone unless it is the subject
    assert in_flag_words("the update log must be reachable") == "the update log must be reachable"
    assert in_flag_words("gamma must be within [0, 1]") == "--srpe-gamma must be within [0, 1]"


def test_a_setting_s_name_in_the_user_s_own_text_is_left_as_given(capsys):
    """Paths, file names and quoted values are the user's: `--seed-log /data/seed_log.npy`
    was echoed back as /data/--seed-log.npy."""
    from hybridgnn.cli.flags import in_flag_words

    assert main(["serve", "--seed-log", "/data/seed_log.npy"]) == 2
    assert capsys.readouterr().err.endswith("got /data/seed_log.npy\n")
    for text in ("cannot read /srv/snapshot_dir/x", "got 'max_connections'", "C:\\runs\\seed_log.npy"):
        assert in_flag_words(text) == text
    assert (in_flag_words("request_seeds >= 1, frontend_cpu_us >= 0 (max_batch_seeds).")
            == "--request-seeds >= 1, --frontend-cpu-us >= 0 (--max-batch-seeds).")


def test_a_repository_with_nothing_to_serve_says_why_per_model(tmp_path, capsys):
    (tmp_path / "repo" / "x" / "one").mkdir(parents=True)  # a version directory must be a number
    (tmp_path / "repo" / "y" / "3").mkdir(parents=True)  # a number, but no model in it
    assert main(["serve", "--dataset", str(tmp_path), "--model-repository", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "x/ has no version directory (1/, 2/, ...), only one/" in err
    assert "y/: version 3 holds no hybridgnn model (config.json)" in err and err.count("\n") == 1


def test_a_repository_whose_version_cannot_be_served_says_why_not_that_it_lacks_config_json(tmp_path, capsys):
    version = tmp_path / "repo" / "rec" / "1"
    version.mkdir(parents=True)
    (version / "config.json").write_text(json.dumps({"format": 2, "class": "hybridgnn.HeteroGNN", "args": {}}))
    assert main(["serve", "--dataset", str(tmp_path), "--model-repository", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "holds a heterogeneous model" in err and "not a model repository" in err and err.count("\n") == 1
    assert "holds no hybridgnn model" not in err


def test_the_store_lock_is_held_once_per_distributed_run(tmp_path, capsys, monkeypatch):
    """The --nprocs launcher held the store's lock for its ranks, but ranks under torchrun
    took none (beside a server precomputing the same store on a shared volume); and the
    launcher made a mistyped --model into a model directory (embeddings/ and the lock)."""
    import errno
    import fcntl
    import os

    import hybridgnn.distributed.driver
    import hybridgnn.distributed.launch
    from hybridgnn.embeddings.store import embeddings_dir, store_lock
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec
    from hybridgnn.runtime.ranks import ERROR_FILE_ENV

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m")
    lock = store_lock(embeddings_dir(tmp_path / "m", GraphStore.open(tmp_path / "d").fingerprint))
    held = []

    def locked() -> bool:
        if not lock.exists():
            return False
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError as exc:
            assert exc.errno in (errno.EAGAIN, errno.EACCES)
            return True
        finally:
            os.close(fd)

    monkeypatch.setattr(hybridgnn.distributed.driver, "run_rank", lambda *a, **k: held.append(locked()))
    monkeypatch.setattr(hybridgnn.distributed.launch, "launch", lambda *a, **k: held.append(locked()) or 0)
    argv = ["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m")]
    capsys.readouterr()
    assert main(argv + ["--nprocs", "2"]) == 0  # the launcher holds it while its ranks run
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, started_by_launcher, holds in (("0", False, True), ("1", False, False), ("0", True, False)):
        monkeypatch.setenv("RANK", rank)
        if started_by_launcher:  # the launcher holds it: its rank 0 taking it too would wait for ever
            monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "error.txt"))
        assert main(argv) == 0
        assert held[-1] is holds, (rank, started_by_launcher)
    assert held == [True, True, False, False]
    # a launcher that waited for another writer finds the store it made and starts no rank
    import threading

    import torch

    from hybridgnn.capabilities import exclusive
    from hybridgnn.embeddings.precompute import PrecomputeConfig, _precompute_locked
    from hybridgnn.models.checkpoint import load_checkpoint

    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    codes = []
    with exclusive(lock, "held by the test"):
        launcher = threading.Thread(target=lambda: codes.append(main(argv + ["--nprocs", "2"])))
        launcher.start()
        launcher.join(0.5)
        assert launcher.is_alive()
        _precompute_locked(GraphStore.open(tmp_path / "d"), load_checkpoint(tmp_path / "m")[0], tmp_path / "m",
                           lock.parent / lock.name[1:-len(".lock")], PrecomputeConfig(dtype="float16"),
                           torch.device("cpu"), False)
    launcher.join(60)
    assert codes == [0] and len(held) == 4 and '"already_complete": true' in capsys.readouterr().out
    capsys.readouterr()
    assert main(["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "typo" / "m"),
                 "--nprocs", "2"]) == 2
    assert "model directory" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_precompute_distributed_flag_mistakes_are_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """--chunk-mb 0, NaN or inf, a negative --threads-per-rank, a --timeout-s that is not
    a positive number, and more ranks than the graph has nodes (or than this machine can
    run) are one line with exit 2, and no rank is started: each was found by the ranks
    only after all of them had started (NaN as "cannot convert float NaN to integer",
    inf with exit 1 and advice to resume), or not at all (--chunk-mb 0 sent one row per
    message, a negative thread count was ignored)."""
    import hybridgnn.distributed.launch
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m")
    capsys.readouterr()

    def no_launch(*_args, **_kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(hybridgnn.distributed.launch, "launch", no_launch)
    argv = ["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m"), "--nprocs", "2"]
    for flags, said in ((["--nprocs", "0"], "--nprocs must be >= 1"),
                        (["--chunk-mb", "0"], "--chunk-mb must be a number > 0"),
                        (["--chunk-mb", "nan"], "--chunk-mb must be a number > 0"),
                        (["--chunk-mb", "inf"], "--chunk-mb must be a number > 0"),
                        (["--threads-per-rank", "-2"], "--threads-per-rank must be >= 0"),
                        (["--timeout-s", "nan"], "--timeout-s must be a number > 0"),
                        (["--timeout-s", "-1"], "--timeout-s must be a number > 0"),
                        (["--timeout-s", "1e20"], "at most 604800 (a week)"),
                        (["--nprocs", "4"], "--nprocs 4: the graph has 3 nodes"),
                        (["--nprocs", "1000000"], "--nprocs 1000000"),
                        (["--order", "rcm"], "--order rcm orders one process's batches")):
        assert main(argv + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (flags, err)
    import torch

    # more CUDA ranks than GPUs: the ranks past the last GPU failed at start in torch's words
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(argv + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nprocs 2 --device cuda: each rank needs a GPU of its own; this machine has 1" in err
    assert not (tmp_path / "m" / "embeddings").exists()


def test_a_path_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys):
    """A file where --out's directory should be was a FileExistsError traceback (after
    training, for `train`)."""
    taken = tmp_path / "a_file"
    taken.write_text("")
    for argv in (["dataset", "generate", "csbm", "--out", str(taken), "--num-nodes", "50"],
                 ["dataset", "generate", "csbm", "--out", str(taken / "sub"), "--num-nodes", "50"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridgnn dataset: error: cannot use ") and str(taken) in err and err.count("\n") == 1


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    import hybridgnn.cli.dataset as dataset_cli

    def interrupted(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(dataset_cli, "run_info", interrupted)
    assert main(["dataset", "info", "anywhere"]) == 130
    assert capsys.readouterr().err == "hybridgnn dataset: interrupted\n"


def test_import_never_removes_its_source_nor_the_old_dataset_before_a_new_one_is_whole(tmp_path, capsys):
    """--force removed --out first: an --out holding the source took the user's edge list
    with it, and a source that failed to import left no dataset at all."""
    edges = tmp_path / "src" / "edges.txt"
    edges.parent.mkdir()
    edges.write_text("0 1\n1 2\n2 0\n")
    for out in (edges.parent, edges, tmp_path):
        assert main(["dataset", "import", str(edges), "--out", str(out), "--force"]) == 2
        assert "overlap" in capsys.readouterr().err and edges.read_text() == "0 1\n1 2\n2 0\n"
    out = tmp_path / "dataset"
    assert main(["dataset", "import", str(edges), "--out", str(out)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in out.iterdir())
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))  # no edges
    assert main(["dataset", "import", str(bad), "--out", str(out), "--force"]) == 2
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(["dataset", "info", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "dataset", "src"]  # no staging left


@pytest.mark.parametrize("kind", ["powerlaw", "csbm", "hetero"])
@pytest.mark.parametrize("degree", ["1e12", "100", "nan"])
def test_generate_refuses_more_edges_per_node_than_there_are_nodes(kind, degree, tmp_path, capsys):
    """100 nodes at --avg-degree 1e12 drew 5e13 pairs into memory, for a target no simple
    graph reaches (it ran until killed)."""
    argv = ["dataset", "generate", kind, "--out", str(tmp_path / "d"), "--num-nodes", "100", "--avg-degree", degree]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "avg_degree" in err and err.count("\n") == 1, err
    assert not (tmp_path / "d").exists()


def test_hetero_generate_refuses_no_groups_in_words(tmp_path, capsys):
    assert main(["dataset", "generate", "hetero", "--out", str(tmp_path / "d"), "--num-groups", "0"]) == 2
    assert "num_groups >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["powerlaw", "csbm"])
def test_generate_refuses_features_of_no_width(kind, tmp_path, capsys):
    # A dataset of 0-wide features was written, which no model can take.
    argv = ["dataset", "generate", kind, "--out", str(tmp_path / "d"), "--num-nodes", "100", "--feature-dim", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "feature_dim must be >= 1" in err and err.count("\n") == 1, err
    assert not (tmp_path / "d").exists()


def test_pipeline_workers_are_bounded_as_a_served_profile_is(tmp_path, capsys):
    # profile --workers 5000 ran, then wrote a profile serve refuses (more than 1,024 workers)
    from hybridgnn.config import MAX_WORKERS, PipelineConfig
    from hybridgnn.scheduler.policy import MAX_PROFILE_WORKERS

    assert MAX_PROFILE_WORKERS == MAX_WORKERS == 1024
    with pytest.raises(ValueError, match=r"workers must be within \[1, 1024\], got 5000"):
        PipelineConfig(workers=5000)
    assert main(["profile", "--workers", "5000", "--out", str(tmp_path / "p.json")]) == 2
    assert "within [1, 1024]" in capsys.readouterr().err


def test_path_flags_expand_a_leading_tilde(monkeypatch, tmp_path):
    from hybridgnn.cli.main import build_parser
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["dataset", "generate", "csbm", "--out=~/graph"])
    assert args.out == tmp_path / "graph"
    args = build_parser().parse_args(["serve", "--placement", "~/plan", "--seed-log=~/seeds"])
    from hybridgnn.cli.flags import flag_value
    from hybridgnn.config import DeviceMemoryConfig, ServerConfig
    assert flag_value(args, DeviceMemoryConfig, "placement_plan") == tmp_path / "plan"
    assert flag_value(args, ServerConfig, "seed_log") == tmp_path / "seeds"


def test_path_variables_and_path_values_expand_a_leading_tilde(monkeypatch, tmp_path):
    """cli.md: a path flag expands a leading ~ where the shell does not. HYBRIDGNN_DATASET=~/g
    (and MODEL, MODEL_REPOSITORY, PROFILE, CACHE_DIR) stayed "~/g", --seeds=~/log was "no
    such file", and --update-log=~/u.sqlite logged into a folder named ~ in the working directory."""
    from hybridgnn.config import default_cache_dir
    from hybridgnn.updates.log import parse_log_url

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("DATASET", "MODEL", "MODEL_REPOSITORY", "PROFILE", "CACHE_DIR"):
        monkeypatch.setenv(f"HYBRIDGNN_{name}", f"~/{name.lower()}")
    serve = build_parser().parse_args(["serve"])
    assert (serve.dataset, serve.model) == (tmp_path / "dataset", tmp_path / "model")
    assert (serve.model_repository, serve.profile) == (tmp_path / "model_repository", tmp_path / "profile")
    profile = build_parser().parse_args(["profile"])
    assert (profile.dataset, profile.model) == (tmp_path / "dataset", tmp_path / "model")
    assert default_cache_dir() == tmp_path / "cache_dir"
    workload = build_parser().parse_args(["workload", "build", "--dataset", "d", "--fanouts", "2", "--seeds=~/r.txt"])
    place = build_parser().parse_args(["place", "--dataset", "d", "--seeds", "~/r.txt"])
    assert workload.seeds == place.seeds == str(tmp_path / "r.txt")
    assert build_parser().parse_args(["place", "--dataset", "d", "--seeds", "degree"]).seeds == "degree"
    assert parse_log_url("~/u.sqlite", tmp_path / "d") == f"sqlite://{tmp_path / 'u.sqlite'}"


@pytest.mark.parametrize("flags, said", [
    (["--slo-ms", "nan"], "--slo-ms must be a positive, finite number, got nan"),
    (["--slo-ms", "0"], "--slo-ms must be a positive"),
    (["--slo-ms", "-5"], "--slo-ms must be a positive"),
    (["--slo-ms", "inf"], "--slo-ms must be a positive"),
    (["--rate", "nan"], "--rate must be a positive"),
    (["--rate", "inf"], "--rate must be a positive"),
    (["--duration-s", "0"], "--duration-s must be a positive"),
    (["--rate", "1e12"], "schedules more than 100,000,000 requests"),
    (["--nodes-per-request", "0"], "--nodes-per-request must be at least 1"),
    # no scheme was "NonHttpUrlClientError: 127.0.0.1:8000/v2/models/hybridgnn"
    (["--url", "127.0.0.1:8000"], "--url must be a plain http:// URL such as http://127.0.0.1:8000, got "
                                  "'127.0.0.1:8000'"),
    (["--url", "https://127.0.0.1:8000"], "--url must be a plain http:// URL"),
])
def test_bench_flags_that_cannot_work_are_refused_before_any_request(flags, said, capsys):
    """--slo-ms nan searched for minutes and printed NaN; --rate inf was a traceback."""
    assert main(["bench", "--url", "http://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, said", [
    (["serve", "--workers", "0"], "--workers must be within [1, 1024], got 0"),
    (["serve", "--device", "emulate", "--gpu-workers", "0"], "--gpu-workers must be within [1, 1024], got 0"),
    (["profile", "--device", "emulate", "--gpu-workers", "0"], "--gpu-workers must be within [1, 1024], got 0"),
    (["profile", "--workers", "2000"], "--workers must be within [1, 1024], got 2000"),
    (["profile", "--min-samples", "0"], "--min-samples must be at least 1, got 0"),
    (["profile", "--bins", "1"], "--bins must be within [2, 1000], got 1"),
    (["profile", "--max-batch", "0"], "--max-batch must be within [1, 1048576], got 0"),
    (["profile", "--budget-s", "nan"], "--budget-s must be a positive, finite number of seconds, got nan"),
])
def test_worker_and_profile_ranges_are_refused_in_the_flags_words(argv, said, capsys):
    """Both worker flags said "workers must be within [1, 1024], got 0"; profile's ranges
    named fields and printed a ProfileConfig."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, said", [
    (["--grpc-port", "99999"], "--grpc-port must be within [0, 65535], got 99999"),
    (["--port", "8497", "--grpc-port", "8497"],
     "--grpc-port 8497 is the HTTP port too: gRPC needs a port of its own (8001 is the usual one)"),
])
def test_a_grpc_port_that_cannot_be_served_is_refused_before_anything_loads(flags, said, capsys, tmp_path):
    """--grpc-port 99999 served gRPC on 34463 (the port modulo 65536) without a word, and
    --grpc-port equal to --port failed only once the workers had started, as "address
    already in use"."""
    argv = ["serve", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"hybridgnn serve: error: {said}\n", err


def test_serve_refuses_more_local_partition_ranks_than_the_machine_can_run(capsys):
    """--partitions 1000 started a thousand torch processes here; ranks started elsewhere
    (--ranks) are not counted against this machine."""
    from hybridgnn.capabilities import RANKS_PER_CORE, usable_cores
    from hybridgnn.cli.serve import check_partition_ranks
    from hybridgnn.config import PartitionConfig

    too_many = RANKS_PER_CORE * usable_cores() + 1
    assert main(["serve", "--partitions", str(too_many)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--partitions {too_many}: more ranks than this machine's" in err
    check_partition_ranks(PartitionConfig(partitions=too_many, ranks="10.0.0.1:29400"))


def test_place_simulates_the_baselines_that_fit_and_names_one_that_does_not(skewed_graph, tmp_path, capsys):
    # degree replicates its memory rows on both servers, so its disk share is larger than the
    # FAP plan's: it was this run's error ("40 rows do not fit"), after the plan had been saved
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps({"servers": 2, "network": "infiniband", "gpus_per_server": 2, "nvlink_cliques": 1,
                                    "gpu_memory_bytes": 10 * 16, "host_memory_bytes": 10 * 16,
                                    "disk_bytes": 12 * 16}))  # rows of 4 float32
    code = main(["place", "--dataset", str(skewed_graph.root), "--fanouts", "4,3", "--topology", str(topology),
                 "--simulate", "5", "--batch-size", "4", "--out", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    assert code == 0
    assert "degree      does not fit this topology" in out
    assert all(f"  {m:<11} p50" in out for m in ("fap", "hash", "importance"))
    assert (tmp_path / "plan" / "plan.json").is_file()


def test_profile_takes_its_pipeline_defaults_from_the_config_serve_uses(monkeypatch):
    """One default per setting: profile's --gpu-workers, --gpu-cache-bytes and
    --graph-placement repeated serve's defaults as literals (2, 1G, uva), which a change of
    the config's would have left behind, profiling other pipelines than are served."""
    from hybridgnn.config import DeviceMemoryConfig, PipelineConfig

    monkeypatch.setattr(PipelineConfig, "workers", 3)
    monkeypatch.setattr(DeviceMemoryConfig, "cache_bytes", 12345)
    monkeypatch.setattr(DeviceMemoryConfig, "graph_placement", "gpu")
    args = build_parser().parse_args(["profile"])
    assert (args.gpu_workers, args.gpu_cache_bytes, args.graph_placement) == (3, 12345, "gpu")


def test_profile_reads_the_environment_serve_reads_for_the_flags_they_share(monkeypatch, tmp_path):
    """profile drives the server you would run: a server configured by HYBRIDGNN_<FLAG>
    variables (the fanouts, dataset, model, workers) was profiled with the flags' defaults
    instead (only HYBRIDGNN_CPU_LANE was read), and `serve --profile` then refused the
    profile as made for other fanouts or warned that other pipelines were measured."""
    env = {"DATASET": str(tmp_path / "d"), "MODEL": str(tmp_path / "m"), "FANOUTS": "7,3", "DEVICE": "emulate",
           "WORKERS": "3", "WORKER_PROCESSES": "off", "GPU_WORKERS": "5", "GPU_CACHE_BYTES": "2M",
           "GRAPH_PLACEMENT": "gpu", "CPU_COMPUTE_DEVICE": "cuda"}
    for name, value in env.items():
        monkeypatch.setenv(f"HYBRIDGNN_{name}", value)
    args = build_parser().parse_args(["profile"])
    assert (args.dataset, args.model, args.fanouts, args.device) == (tmp_path / "d", tmp_path / "m", "7,3", "emulate")
    assert (args.workers, args.worker_processes, args.gpu_workers) == (3, "off", 5)
    assert (args.gpu_cache_bytes, args.graph_placement, args.cpu_compute_device) == (2 << 20, "gpu", "cuda")
    assert build_parser().parse_args(["profile", "--fanouts", "2,2"]).fanouts == "2,2"  # a flag wins


def test_a_mistyped_dataset_or_model_path_is_said_not_to_exist(tmp_path, capsys):
    """A path that is not there was "model directory X lacks config.json (write one with
    hybridgnn.save_model ...)" or "X is not a hybridgnn dataset: X/meta.json is missing",
    as if the directory were there but incomplete; a directory without them still says so."""
    from torch_geometric.nn.models import GraphSAGE

    import hybridgnn
    from hybridgnn.graph.generate import generate_csbm

    generate_csbm(tmp_path / "d", num_nodes=40, num_classes=2, feature_dim=4, seed=0)
    hybridgnn.save_model(GraphSAGE(4, 8, num_layers=2, out_channels=2), tmp_path / "m")
    (tmp_path / "g.pt").write_bytes(b"not a dataset")
    capsys.readouterr()
    for argv, said in (
            (["model", "check", str(tmp_path / "nope")], f"model directory {tmp_path / 'nope'} does not exist"),
            (["serve", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "nope")],
             f"model directory {tmp_path / 'nope'} does not exist"),
            (["serve", "--dataset", str(tmp_path / "nope"), "--model", str(tmp_path / "m")],
             f"dataset directory {tmp_path / 'nope'} does not exist"),
            (["precompute", "--dataset", str(tmp_path / "nope"), "--model", str(tmp_path / "m")],
             f"dataset directory {tmp_path / 'nope'} does not exist"),
            (["model", "check", str(tmp_path / "d")], "lacks config.json"),
            (["serve", "--dataset", str(tmp_path / "m"), "--model", str(tmp_path / "m")],
             "is not a hybridgnn dataset"),
            # a file where a directory goes: was "X is not a hybridgnn dataset: X/meta.json
            # is missing" and "model directory X lacks config.json"
            (["dataset", "info", str(tmp_path / "g.pt")],
             f"{tmp_path / 'g.pt'} is a file, not a dataset directory: make one from it with `hybridgnn dataset "
             f"import {tmp_path / 'g.pt'} --out DIR`"),
            (["serve", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m" / "model.pt")],
             f"{tmp_path / 'm' / 'model.pt'} is a file, not a model directory")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_wait_when_idle_and_access_log_reach_the_config(monkeypatch):
    from hybridgnn.cli import serve as serve_cli

    base = ["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5"]
    cfg = serve_cli.build_config(build_parser().parse_args(base))
    assert cfg.batcher.wait_when_idle is False and cfg.server.access_log is False  # the defaults
    cfg = serve_cli.build_config(build_parser().parse_args([*base, "--wait-when-idle", "--access-log"]))
    assert cfg.batcher.wait_when_idle is True and cfg.server.access_log is True
    monkeypatch.setenv("HYBRIDGNN_WAIT_WHEN_IDLE", "yes")
    assert serve_cli.build_config(build_parser().parse_args(base)).batcher.wait_when_idle is True


def test_the_seed_log_interval_is_a_flag_and_a_setting_checked_in_its_words(monkeypatch, capsys):
    """seed_log_interval_s (60 s) had no flag nor HYBRIDGNN_* variable: a log could only
    be written every minute."""
    from hybridgnn.cli import serve as serve_cli

    base = ["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5", "--seed-log", "s.counts.npy"]
    assert serve_cli.build_config(build_parser().parse_args(base)).server.seed_log_interval_s == 60.0
    cfg = serve_cli.build_config(build_parser().parse_args([*base, "--seed-log-interval-s", "0.5"]))
    assert cfg.server.seed_log_interval_s == 0.5
    monkeypatch.setenv("HYBRIDGNN_SEED_LOG_INTERVAL_S", "5")
    assert serve_cli.build_config(build_parser().parse_args(base)).server.seed_log_interval_s == 5.0
    monkeypatch.delenv("HYBRIDGNN_SEED_LOG_INTERVAL_S")
    for value, said in (("0", "got 0.0"), ("-1", "got -1.0"), ("inf", "got inf"), ("nan", "must be a number, got NaN")):
        assert main([*base, f"--seed-log-interval-s={value}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridgnn serve: error: --seed-log-interval-s must be a") and said in err, err
        assert len(err.strip().splitlines()) == 1


def test_no_spill_is_set_as_hybridgnn_no_spill_as_every_flag_is(monkeypatch, capsys):
    """Every serve flag is HYBRIDGNN_<FLAG>; --no-spill read only HYBRIDGNN_SPILL, so
    HYBRIDGNN_NO_SPILL=1 was silently ignored and the server spilled. HYBRIDGNN_SPILL=0
    still works (the name it had)."""
    from hybridgnn.cli import serve as serve_cli

    base = ["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5"]
    assert serve_cli.build_config(build_parser().parse_args(base)).router.spill is True
    monkeypatch.setenv("HYBRIDGNN_NO_SPILL", "1")
    assert serve_cli.build_config(build_parser().parse_args(base)).router.spill is False
    monkeypatch.setenv("HYBRIDGNN_NO_SPILL", "off")
    assert serve_cli.build_config(build_parser().parse_args(base)).router.spill is True
    monkeypatch.delenv("HYBRIDGNN_NO_SPILL")
    monkeypatch.setenv("HYBRIDGNN_SPILL", "0")
    assert serve_cli.build_config(build_parser().parse_args(base)).router.spill is False
    monkeypatch.setenv("HYBRIDGNN_NO_SPILL", "maybe")
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    assert exit_.value.code == 2
    assert "HYBRIDGNN_NO_SPILL='maybe' is not a valid boolean" in capsys.readouterr().err


def test_max_wait_help_says_a_request_on_a_quiet_server_does_not_wait(capsys):
    """`--max-wait-ms` said only "longest a request waits for its batch to fill", as if a
    lone request always waited that long; it waits only while a batch is under way
    (cli.md), unless --wait-when-idle."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index("--max-wait-ms MAX_WAIT_MS", text.index("options:"))
    assert "while a batch is under way" in text[start:text.index("--max-pending MAX_PENDING", start)]


def test_bench_seed_help_says_it_draws_the_arrivals_too(capsys):
    """bench's --seed said "random seed of the node ids sent"; it also draws the Poisson
    arrival times (cli.md: "arrival and id seed")."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "random seed of the arrival times and the node ids sent" in " ".join(capsys.readouterr().out.split())


def _serving_metadata(monkeypatch, metadata: dict) -> None:
    """bench reads this as the server's GET /v2/models/{m} (no server: nothing is sent
    before it is read, and each test here ends at a refusal)."""
    import hybridgnn.bench.metadata

    async def fetch_metadata(url, model):
        return metadata

    monkeypatch.setattr(hybridgnn.bench.metadata, "fetch_metadata", fetch_metadata)


def test_bench_against_a_heterogeneous_model_asks_for_a_node_type_in_one_line(monkeypatch, capsys):
    """Its metadata has no num_nodes: bench ended in a KeyError traceback."""
    _serving_metadata(monkeypatch, {"name": "hybridgnn", "parameters": {"graph": "heterogeneous", "node_types": [
        {"name": "user", "num_nodes": 30, "output_dim": 4, "node_ids": "dense"}]}})
    for flags in ([], ["--slo-ms", "50"]):
        assert main(["bench", "--url", "http://127.0.0.1:9", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is heterogeneous" in err and "give --node-type (one of ['user'])" in err, err


def test_bench_against_nodes_named_by_strings_refuses_before_sending_in_one_line(monkeypatch, capsys):
    """A dataset imported from an edge list of names (parameters.node_ids 'string'): bench
    sent INT64 ids 0..n-1, every request failed, and it printed "ok": 0 with exit 0."""
    _serving_metadata(monkeypatch, {"name": "hybridgnn", "parameters": {"num_nodes": 3, "node_ids": "string"}})
    assert main(["bench", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names its nodes by strings" in err, err


def test_bench_prints_null_not_nan_for_the_latencies_of_a_run_where_nothing_succeeded(monkeypatch, capsys):
    """"p50_ms": NaN is not JSON: strict parsers refused bench's report."""
    import math

    import hybridgnn.bench.loadgen as loadgen

    async def failing(*_args, rate, duration_s, **_kwargs):
        statuses = np.full(5, 500)
        return loadgen._result(rate, duration_s, duration_s, 1, np.ones(5), statuses, False, np.zeros(5))

    monkeypatch.setattr(loadgen, "run_load", failing)
    assert main(["bench", "--url", "http://127.0.0.1:9", "--duration-s", "1"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in {out}"))
    assert report["errors"] == 5 and report["p50_ms"] is None and report["max_ms"] is None
    assert report["error_statuses"] == {"500": 5}  # how they failed, not only how many
    assert math.isnan(loadgen._result(1, 1, 1, 1, np.ones(1), np.full(1, 500), False, np.zeros(1)).p99_ms)
    mixed = loadgen._result(1, 1, 1, 1, np.ones(6), np.array([200, 400, 400, 429, -2, 0]), False, np.zeros(6))
    assert mixed.error_statuses == {"-2": 1, "-1": 1, "400": 2} and mixed.errors == 4 and mixed.rejected == 1


def _search_against(monkeypatch, calls: list) -> None:
    """bench --slo-ms against a fake load: rates up to 800/s meet any SLO, above it none
    do; calls gets each run_load's keyword arguments."""
    import hybridgnn.bench.loadgen as loadgen

    async def load(*_args, rate, duration_s, **kwargs):
        calls.append(kwargs)
        statuses = np.full(4, 200 if rate <= 800 else 503)
        said = loadgen.ErrorSamples()
        if rate > 800:
            said.add_body(503, b'{"error": "the partition ranks are down"}')
        return loadgen._result(rate, duration_s, duration_s, 1, np.full(4, 0.001), statuses, False, np.zeros(4),
                               said)

    _serving_metadata(monkeypatch, {"name": "hybridgnn", "parameters": {"num_nodes": 3, "node_ids": "dense"}})
    monkeypatch.setattr(loadgen, "run_load", load)


def test_bench_slo_search_reports_progress_on_stderr_and_only_json_on_stdout(monkeypatch, capsys):
    """The `rate ... req/s -> ok ...` lines went to stdout before the JSON (other commands
    put progress on stderr), so `bench --slo-ms 50 > report.json` was not JSON."""
    _search_against(monkeypatch, [])
    assert main(["bench", "--url", "http://127.0.0.1:9", "--slo-ms", "50", "--rate", "200"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["max_rate_within_slo"] == 800
    assert "rate     400.0 req/s -> ok" in captured.err
    # what the refused answers said, on the line of each trial that had some
    assert "rate    1600.0 req/s -> ok       0.0 req/s" in captured.err
    assert "rejected 4, errors 0 [503: the partition ranks are down]" in captured.err
    assert captured.err.count("[503: the partition ranks are down]") == captured.err.count("rejected 4")


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_bench_stopped_by_a_signal_prints_its_partial_report_and_exits_128_plus_it(sig, code, monkeypatch, capsys):
    """Ctrl-C printed "interrupted" and no report; SIGTERM ended it without a word."""
    import asyncio
    import signal

    import hybridgnn.bench.loadgen as loadgen

    async def stopped_load(*_args, rate, duration_s, stop, **_kwargs):
        signal.raise_signal(signal.Signals[sig])
        await asyncio.wait_for(stop, 5)
        return loadgen._result(rate, duration_s, 1.5, 1, np.full(3, 0.01), np.array([200, 200, 0]), False,
                               np.zeros(3), sent=3, interrupted=stop.result())

    _serving_metadata(monkeypatch, {"name": "hybridgnn", "parameters": {"num_nodes": 3, "node_ids": "dense"}})
    monkeypatch.setattr(loadgen, "run_load", stopped_load)
    assert main(["bench", "--url", "http://127.0.0.1:9", "--duration-s", "60"]) == code
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["interrupted"] == sig and (report["sent"], report["ok"], report["unanswered"]) == (3, 2, 1)
    assert captured.err.count("\n") == 1 and "a partial report of the 3 requests sent" in captured.err


def test_a_bench_slo_search_stopped_by_a_signal_reports_the_highest_rate_that_held(monkeypatch, capsys):
    import asyncio
    import signal

    import hybridgnn.bench.loadgen as loadgen

    rates = []

    async def load(*_args, rate, duration_s, stop, **_kwargs):
        rates.append(rate)
        if rate >= 800:  # the search's fourth trial: Ctrl-C
            signal.raise_signal(signal.SIGINT)
            await asyncio.wait_for(stop, 5)
            return loadgen._result(rate, duration_s, 0.5, 1, np.full(2, 0.001), np.array([200, 0]), False,
                                   np.zeros(2), sent=2, interrupted=stop.result())
        return loadgen._result(rate, duration_s, duration_s, 1, np.full(4, 0.001), np.full(4, 200), False,
                               np.zeros(4))

    _serving_metadata(monkeypatch, {"name": "hybridgnn", "parameters": {"num_nodes": 3, "node_ids": "dense"}})
    monkeypatch.setattr(loadgen, "run_load", load)
    assert main(["bench", "--url", "http://127.0.0.1:9", "--slo-ms", "50", "--rate", "200"]) == 130
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert rates == [200, 200, 400, 800]  # (the warm-up first) nothing after the signal
    assert report["interrupted"] == "SIGINT" and report["max_rate_within_slo"] == 400
    assert report["result"]["offered_rps"] == 400 and report["result"]["interrupted"] is None
    assert "rate     800.0 req/s -> SIGINT after 2 requests: the search ends here" in captured.err
    assert "the search ended early; max_rate_within_slo is the highest rate that held" in captured.err


def test_bench_slo_search_draws_every_trial_with_the_seed_given(monkeypatch, capsys):
    """--seed was dropped with --slo-ms: every trial drew with seed 0."""
    calls = []
    _search_against(monkeypatch, calls)
    assert main(["bench", "--url", "http://127.0.0.1:9", "--slo-ms", "50", "--seed", "7"]) == 0
    assert len(calls) > 2 and all(kw.get("seed") == 7 for kw in calls), calls


@pytest.mark.parametrize("on_write", [True, False], ids=["write", "flush-at-the-end"])
def test_output_into_a_reader_that_has_gone_ends_quietly_with_the_sigpipe_status(on_write, tmp_path, monkeypatch,
                                                                                 capsys):
    """`hybridgnn dataset info D | true` said "error: cannot use: Broken pipe", exit 2:
    a command whose reader closed the pipe ends as one SIGPIPE ended (141), silently,
    whether the pipe breaks as it writes or as its buffered output is flushed."""
    import io

    (tmp_path / "e.txt").write_text("0 1\n1 2\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()

    class ClosedPipe(io.StringIO):
        def write(self, text):
            if not on_write:
                return len(text)
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["dataset", "info", str(tmp_path / "d")]) == 141
    assert capsys.readouterr().err == ""


def test_a_bench_report_into_a_reader_that_has_gone_ends_quietly_too(monkeypatch, capsys):
    """`hybridgnn bench ... | head -5` said "error: cannot load http://... model
    'hybridgnn': BrokenPipeError: [Errno 32] Broken pipe", exit 2, after a run that had
    gone well: bench took any OSError for a server it could not reach."""
    import io

    import hybridgnn.bench.loadgen as loadgen

    async def answered(*_args, rate, duration_s, **_kwargs):
        return loadgen._result(rate, duration_s, duration_s, 1, np.ones(5), np.full(5, 200), False, np.zeros(5))

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(loadgen, "run_load", answered)
    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["bench", "--url", "http://127.0.0.1:9", "--duration-s", "1"]) == 141
    assert capsys.readouterr().err == ""


def test_nprocs_on_a_complete_store_reports_it_at_once_without_starting_ranks(tmp_path, capsys, monkeypatch):
    """The launcher looked for a complete store only after waiting for another writer:
    on one already finished it started every rank (10-20 s, silent) for them to find it
    complete. It starts none now, and prints what one process prints for that store;
    one made with another dtype is still computed again, as the ranks would."""
    import hybridgnn.distributed.launch
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m")
    argv = ["precompute", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m")]
    capsys.readouterr()
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    launched = []
    monkeypatch.setattr(hybridgnn.distributed.launch, "launch", lambda *a, **k: launched.append(a) or 0)
    assert main(argv + ["--nprocs", "2"]) == 0
    assert launched == [] and json.loads(capsys.readouterr().out) == {**single, "already_complete": True}
    assert main(argv + ["--nprocs", "2", "--dtype", "float16"]) == 0 and len(launched) == 1


def test_serve_with_fewer_fanouts_than_layers_counts_one_hop_in_words(tmp_path, capsys):
    """It said "fanouts (10,) give 1 hops"."""
    from hybridgnn.models.checkpoint import save_model
    from hybridgnn.models.gnn import GNN, ModelSpec

    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 0\n")
    assert main(["dataset", "import", str(tmp_path / "e.txt"), "--out", str(tmp_path / "d"), "--feature-dim", "4"]) == 0
    save_model(GNN(ModelSpec("sage", 4, 8, 3)), tmp_path / "m")
    capsys.readouterr()
    assert main(["serve", "--dataset", str(tmp_path / "d"), "--model", str(tmp_path / "m"), "--fanouts", "10",
                 "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "fanouts [10] give 1 hop but the model has 2 layers; give one fanout per layer" in err, err


def _serve_config(argv):
    from hybridgnn.cli.serve import build_config

    return build_config(build_parser().parse_args(["serve", "--dataset", "d", "--model", "m", "--fanouts", "5,5"]
                                                  + argv))


def test_graph_updates_on_a_gpu_machine_are_served_on_the_cpu_pipeline_by_default(monkeypatch, capsys):
    """--device auto is cuda on a GPU machine, and graph updates run on the CPU pipeline only:
    `serve --update-token T` there was refused ("drop the GPU pipeline"), though no flag asked
    for a GPU. auto now serves updates on the CPU; a GPU pipeline asked for is refused naming
    --device."""
    import hybridgnn.capabilities

    monkeypatch.setattr(hybridgnn.capabilities, "HAS_CUDA", True)
    token = ["--update-token", "token-123"]
    assert _serve_config([]).gpu_pipeline.device == "cuda"  # without updates auto is still cuda
    cfg = _serve_config(token)
    assert cfg.graph_updates and cfg.gpu_pipeline is None and not cfg.cpu_pipeline.processes
    assert not cfg.cpu_pipeline.split
    for device in ("cuda", "emulate"):
        with pytest.raises(ConfigError, match=f"--device {device} adds the GPU pipeline, and graph updates"):
            _serve_config(token + ["--device", device])


@pytest.mark.parametrize("argv, said, unsaid", [
    # each named flags that were not given (--cpu-compute-device, the update token) or a wrong reason
    (["--worker-processes", "on", "--update-token", "token-123"], "--worker-processes on serves a static graph, "
     "and the update token", "--cpu-compute-device"),
    (["--device", "emulate", "--cpu-lane", "split", "--update-token", "token-123"], "--device emulate adds the GPU "
     "pipeline", "--cpu-compute-device"),
    (["--cpu-lane", "split", "--update-token", "token-123"], "--cpu-lane split computes on the GPU pipeline's "
     "device, and graph updates", "--cpu-compute-device"),
    (["--device", "emulate", "--cpu-lane", "split", "--worker-cpus", "1"], "which are off here (--cpu-lane split "
     "runs its workers as threads)", "graph updates"),
    (["--update-token", "token-123", "--worker-cpus", "1"], "which are off here (the update token turns graph "
     "updates on", "--cpu-compute-device"),
    (["--worker-processes", "off", "--worker-cpus", "1"], "which are off here (--worker-processes off)",
     "graph updates"),
])
def test_a_pipeline_refusal_names_the_flags_given_and_no_other(argv, said, unsaid, monkeypatch, capsys):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(ConfigError) as refused:
        _serve_config(argv)
    assert said in str(refused.value) and unsaid not in str(refused.value), str(refused.value)
    assert main(["serve", "--dataset", "d", "--model", "m", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_servers_without_worker_processes_refuse_what_only_they_would_do(tmp_path, monkeypatch, capsys):
    """A heterogeneous graph's engine runs worker threads and a partitioned server computes on
    its ranks: --worker-cpus was taken there ("CPU worker processes on [1]") and kept every
    thread of the server off that core; --worker-processes on and --cpu-lane split did nothing.
    auto is off there, and those are refused in one line."""
    import os

    from hybridgnn.graph.hetero_generate import generate_hetero

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    hetero = generate_hetero(tmp_path / "h", num_nodes=30, avg_degree=2)
    for where, said in ((["--dataset", str(hetero), "--model", "m"], "the heterogeneous graph"),
                        (["--dataset", "d", "--model", "m", "--partitions", "2"], "with --partitions")):
        args = build_parser().parse_args(["serve", *where])
        from hybridgnn.cli.serve import build_config

        cfg = build_config(args)
        assert not cfg.cpu_pipeline.processes and not cfg.cpu_pipeline.split  # auto: none
        # (--device emulate is itself refused with --partitions: no GPU pipeline runs there)
        split = ["--cpu-lane", "split"] if "--partitions" in where else ["--device", "emulate", "--cpu-lane", "split"]
        for extra in (["--worker-cpus", "1"], ["--worker-processes", "on"], split):
            assert main(["serve", *where, *extra]) == 2, extra
            err = capsys.readouterr().err
            assert said in err and extra[-2] in err and len(err.strip().splitlines()) == 1, err


def test_a_profile_is_refused_where_no_engine_reads_it(tmp_path, monkeypatch, capsys):
    """A heterogeneous graph's server and a partitioned one never read --profile: one made for
    another dataset was taken with --policy slo:50 --adapt, and the server routed by its default
    threshold, its metadata's policy null."""
    from hybridgnn.graph.hetero_generate import generate_hetero

    hetero = generate_hetero(tmp_path / "h", num_nodes=30, avg_degree=2)
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    for where, said in ((["--dataset", str(hetero), "--model", "m"], "a heterogeneous graph's server"),
                        (["--dataset", "d", "--model", "m", "--partitions", "2"], "a partitioned server")):
        assert main(["serve", *where, "--profile", str(profile), "--policy", "slo:50"]) == 2
        err = capsys.readouterr().err
        assert f"--profile {profile}: {said} serves no profile's policy" in err and err.count("\n") == 1, err


def test_an_operating_point_given_on_a_cpu_only_server_is_not_called_the_default(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    assert main(["serve", "--dataset", "d", "--model", "m", "--device", "cpu", "--profile", str(profile),
                 "--policy", "latency"]) == 2
    err = capsys.readouterr().err
    assert "--policy latency picks a point between the CPU and GPU pipelines" in err and "(the default)" not in err
    assert err.count("\n") == 1, err


def test_a_cpu_compute_device_that_cannot_be_is_refused_naming_its_flag(monkeypatch, capsys):
    """--cpu-compute-device tpu was refused as "pipeline device must be ..." (no flag named), and
    cuda:x or a GPU the machine lacks passed the check, to fail in the first worker."""
    import torch

    import hybridgnn.capabilities

    for bad in ("tpu", "CUDA", "cuda:x", "cuda:"):
        assert main(["serve", "--dataset", "d", "--model", "m", "--cpu-compute-device", bad]) == 2
        err = capsys.readouterr().err
        assert f"--cpu-compute-device must be cpu, cuda or cuda:N, got {bad!r}" in err and err.count("\n") == 1, err
    monkeypatch.setattr(hybridgnn.capabilities, "HAS_CUDA", True, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["serve", "--dataset", "d", "--model", "m", "--cpu-compute-device", "cuda:1",
                 "--worker-processes", "off"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-compute-device cuda:1: this machine has 1 CUDA device(s)" in err and err.count("\n") == 1, err


def test_flags_the_server_would_never_read_are_refused_in_one_line(tmp_path, capsys):
    """--repository-poll-s without a repository, --model-name with one, and --device cuda with
    --partitions were taken in silence and did nothing."""
    repo = tmp_path / "repo"
    for flags, said in (
            (["--repository-poll-s", "5"], "--repository-poll-s polls a model repository, and none is served"),
            (["--dataset", "d", "--model-repository", str(repo), "--model-name", "m"],
             "--model-name m: a model repository names each model by its directory"),
            (["--dataset", "d", "--model", "m", "--partitions", "2", "--device", "cuda"],
             "--device cuda (or HYBRIDGNN_DEVICE): with --partitions"),
            (["--dataset", "d", "--model", "m", "--partitions", "2", "--device", "emulate"],
             "--device emulate (or HYBRIDGNN_DEVICE): with --partitions"),
            (["--update-log", "redis://r:6379/s"], "--update-log: graph updates are off without --update-token"),
            (["--snapshot-every", "5", "--max-catch-up-ms", "20"],
             "--snapshot-every, --max-catch-up-ms: graph updates are off"),
            (["--dataset", "d", "--model-repository", str(repo), "--update-token", "12345678", "--update-log", "x"],
             "--update-log: a model repository serves a static graph")):
        assert main(["serve", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    from hybridgnn.cli.serve import check_flags_read

    for fine in (["--repository-poll-s", "0"], ["--model-name", "hybridgnn", "--model-repository", str(repo)],
                 ["--partitions", "2", "--device", "cpu"], ["--partitions", "2"], ["--max-catch-up-ms", "1000"]):
        check_flags_read(build_parser().parse_args(["serve", *fine]), False)  # the default, or read
    check_flags_read(build_parser().parse_args(["serve", "--update-log", "off"]), True)
    # a server without updates over a dataset whose log holds some is told to pass it
    for fine in (["--update-log", "off"], ["--model-repository", str(repo), "--update-log", "off"]):
        check_flags_read(build_parser().parse_args(["serve", *fine]), False)
