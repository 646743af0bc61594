"""Model directories that are damaged or tampered with are refused in one line when
loaded (load_model: what `hybridgnn model check`, serve, precompute and every worker
run), and what save_model cannot check is never written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_geometric.nn.models import GraphSAGE

from hybridgnn.errors import ConfigError
from hybridgnn.models.checkpoint import CheckpointError, load_model, save_model
from hybridgnn.models.zoo import UnsupportedModel

F = 4


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    return save_model(GraphSAGE(F, 8, 2, 3).eval(), tmp_path / "m")


def _refused(path, match):
    with pytest.raises(CheckpointError, match=match) as info:
        load_model(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_do_not_pass_the_golden_check(model_dir, value):
    # NaN compares false with any tolerance: a NaN weight used to load and serve NaN.
    state = torch.load(model_dir / "model.pt", weights_only=True)
    state["convs.0.lin_l.weight"][0, 0] = value
    torch.save(state, model_dir / "model.pt")
    _refused(model_dir, "does not reproduce its golden outputs")


def test_golden_outputs_overwritten_with_nan_check_nothing(model_dir):
    # Golden answers of NaN made every weights file pass, another architecture's included.
    saved = torch.load(model_dir / "golden.pt", weights_only=True)
    saved["out"][:] = float("nan")
    torch.save(saved, model_dir / "golden.pt")
    _refused(model_dir, "golden")


def test_a_model_with_non_finite_outputs_is_not_saved(tmp_path):
    model = GraphSAGE(F, 8, 2, 3).eval()
    with torch.no_grad():
        model.convs[1].lin_l.weight[0, 0] = float("nan")
    with pytest.raises(UnsupportedModel, match="non-finite outputs"):
        save_model(model, tmp_path / "m")
    assert not (tmp_path / "m" / "config.json").exists()


def _edit_golden(path, **changes):
    saved = torch.load(path / "golden.pt", weights_only=True)
    torch.save({**saved, **{k: v(saved) for k, v in changes.items()}}, path / "golden.pt")


@pytest.mark.parametrize("changes, match", [
    ({"x": lambda g: g["x"][:10], "out": lambda g: g["out"][:10],
      "edge_index": lambda g: g["edge_index"][:, (g["edge_index"] < 10).all(0)]}, "graph of 10 nodes"),
    ({"edge_index": lambda g: g["edge_index"] + 1000}, "edges to nodes outside"),
    ({"edge_index": lambda g: g["edge_index"][0]}, r"edge_index of shape \(\d+,\)"),
])
def test_a_damaged_golden_graph_is_refused_in_one_line(model_dir, changes, match):
    # These failed inside the model's forward (IndexError) with a traceback.
    _edit_golden(model_dir, **changes)
    _refused(model_dir, match)


@pytest.mark.parametrize("changes, match", [
    ({"out": lambda g: g["out"][:3]}, r"holds \(3, 3\) outputs for a graph of 40 nodes"),  # IndexError
    ({"out": lambda g: g["out"][:, 0]}, r"holds \(40,\) outputs"),
])
def test_golden_outputs_without_a_row_per_golden_node_are_refused_in_one_line(model_dir, changes, match):
    _edit_golden(model_dir, **changes)
    _refused(model_dir, match)


@pytest.mark.parametrize("key, value, match", [
    # a million layers were built (minutes, gigabytes of modules) before the weights were read
    ("num_layers", 10**6, "gives 1000000 layers but .* holds only 6 tensors"),
    # widths were allocated as config.json said (here 400 GB) before the weights were compared
    ("hidden_channels", 10**10, "do not fit GraphSAGE: tensor shapes differ"),
    ("in_channels", 10**10, "do not fit GraphSAGE: tensor shapes differ"),
])
def test_config_widths_and_depth_the_weights_do_not_have_are_refused_before_anything_is_allocated(
        model_dir, key, value, match):
    import json
    import time

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["args"][key] = value
    (model_dir / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    _refused(model_dir, match)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("key, value", [("jk", "bogus"), ("hidden_channels", -3)])
def test_constructor_arguments_the_class_rejects_are_one_line(model_dir, key, value):
    # PyG asserts on an unknown jk and torch raises RuntimeError on a negative width:
    # both escaped as tracebacks from `hybridgnn model check` and serve.
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["args"][key] = value
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="cannot build torch_geometric.GraphSAGE") as info:
        load_model(model_dir)
    assert "\n" not in str(info.value)


def _golden_forward_matches(model, path):
    from hybridgnn.models import golden

    stack, cfg = load_model(path)
    graph = golden.golden_graph(F)
    with torch.inference_mode():
        want = model(graph.x, graph.edge_index)
        assert golden.max_relative_error(golden.layerwise_outputs(stack, graph), want) <= 1e-5
    return cfg


def test_an_identity_activation_module_is_saved_as_no_activation(tmp_path):
    # nn.Identity() was written as act="identity", which PyG cannot resolve: save_model
    # failed with a ValueError listing every torch activation.
    torch.manual_seed(0)
    model = GraphSAGE(F, 8, 2, 3, act=torch.nn.Identity()).eval()
    save_model(model, tmp_path / "m")
    assert _golden_forward_matches(model, tmp_path / "m")["args"]["act"] is None


@pytest.mark.parametrize("make", [
    lambda: GraphSAGE(-1, 8, 2, 3),
    lambda: __import__("torch_geometric.nn.models", fromlist=["GAT"]).GAT(-1, 8, 2, 3, heads=2, residual=True),
    lambda: __import__("torch_geometric.nn.models", fromlist=["GIN"]).GIN(-1, 8, 2, 3),
    lambda: __import__("torch_geometric.nn.models", fromlist=["GCN"]).GCN(-1, 8, 2, 3),
])
def test_a_lazy_model_that_has_run_is_saved_with_the_width_it_took(make, tmp_path):
    # in_channels=-1 was written down as -1: save_model failed with numpy's "negative
    # dimensions are not allowed" (and before a forward, the same).
    torch.manual_seed(0)
    model = make().eval()
    with pytest.raises(UnsupportedModel, match="lazy in_channels=-1 .* run one forward pass first"):
        save_model(model, tmp_path / "early")
    with torch.no_grad():
        model(torch.zeros(2, F), torch.zeros(2, 0, dtype=torch.long))
    save_model(model, tmp_path / "m")
    cfg = _golden_forward_matches(model, tmp_path / "m")
    assert cfg["args"]["in_channels"] == cfg["in_dim"] == F


@pytest.mark.parametrize("cls, aggr", [("GIN", "max"), ("GIN", "mean"), ("GAT", "mean")])
def test_the_aggregation_of_gin_and_gat_is_written_down(cls, aggr, tmp_path):
    # GINConv and GATConv take aggr through BasicGNN's kwargs; it was not written down, so
    # the rebuilt model summed and save_model refused with "the model's own forward differs".
    import torch_geometric.nn.models as pyg

    torch.manual_seed(0)
    model = getattr(pyg, cls)(F, 8, 2, 3, aggr=aggr).eval()
    save_model(model, tmp_path / "m")
    assert _golden_forward_matches(model, tmp_path / "m")["args"]["aggr"] == aggr


def test_gcn_with_another_aggregation_is_refused_naming_it(tmp_path):
    from torch_geometric.nn.models import GCN

    with pytest.raises(UnsupportedModel, match="GCN with aggr='mean' is not supported"):
        save_model(GCN(F, 8, 2, 3, aggr="mean"), tmp_path / "m")


class _Payload:
    def __reduce__(self):
        return (print, ("payload ran",))


def test_a_pickle_payload_is_refused_naming_what_it_holds_not_advising_weights_only_false(model_dir, capsys):
    # torch's first line advised re-running torch.load with weights_only=False, and the
    # refused global was dropped.
    torch.save({"convs.0.lin_l.weight": _Payload()}, model_dir / "model.pt")
    with pytest.raises(CheckpointError, match=r"objects other than tensors.*GLOBAL .*print") as info:
        load_model(model_dir)
    assert "weights_only` set to `False`" not in str(info.value) and "\n" not in str(info.value)
    assert "payload ran" not in capsys.readouterr().out


def test_weights_that_are_not_a_torch_file_say_so(model_dir):
    """A text file or a truncated download in place of model.pt: the message says it is
    not a torch.save file (it said it held objects other than tensors)."""
    (model_dir / "model.pt").write_text("1 2 3\n")
    _refused(model_dir, r"it is not a file torch.save wrote")
    (model_dir / "model.pt").write_bytes(b"\x80\x02" + b"1 2 3\n")  # a pickle's header, then not one
    _refused(model_dir, r"it is not a file torch.save wrote \(Unsupported operand")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_model_of_another_float_dtype_is_refused_in_one_line(dtype, tmp_path):
    # It failed inside the golden forward with torch's 'mat1 and mat2 must have the same dtype'.
    with pytest.raises(UnsupportedModel, match=f"holds {str(dtype)[6:]} weights; hybridgnn serves float32"):
        save_model(GraphSAGE(F, 8, 2, 3).to(dtype), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_heterogeneous_model_or_decoder_of_another_float_dtype_is_refused_in_one_line(tmp_path):
    from torch_geometric.nn import to_hetero

    meta = (["user", "item"], [("user", "rates", "item"), ("item", "rev_rates", "user")])
    model = to_hetero(GraphSAGE((F, F), 8, num_layers=2, out_channels=3), meta, aggr="sum")
    with pytest.raises(UnsupportedModel, match="holds float64 weights"):
        save_model(model.double().eval(), tmp_path / "m", metadata=meta)
    with pytest.raises(UnsupportedModel, match="a NoneType is not a heterogeneous model"):  # an AttributeError
        save_model(None, tmp_path / "m", metadata=meta)


def test_a_heterogeneous_model_with_nan_weights_says_so(tmp_path):
    # It said the model "cannot be served exactly: the whole-graph forward differs by inf".
    from torch_geometric.nn import to_hetero

    meta = (["user", "item"], [("user", "rates", "item"), ("item", "rev_rates", "user")])
    model = to_hetero(GraphSAGE((F, F), 8, num_layers=2, out_channels=3), meta, aggr="sum")
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(UnsupportedModel, match="non-finite outputs .* look for NaN or inf weights"):
        save_model(model.eval(), tmp_path / "m", metadata=meta)
    with pytest.raises(UnsupportedModel, match="Bilinear holds float64 weights"):
        save_model(model.float().eval(), tmp_path / "m", metadata=meta,
                   link_decoder=torch.nn.Bilinear(3, 3, 1).double())


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_weights_file_with_a_huge_stray_tensor_is_refused_without_reading_it(model_dir):
    # A gigabyte tensor beside the weights was read whole into the (serving) process before
    # the keys were compared. skip_data writes it sparse: nothing is allocated to make it.
    from torch.serialization import skip_data

    state = torch.load(model_dir / "model.pt", weights_only=True)
    with skip_data():
        torch.save({**state, "stray": torch.empty(256 << 20)}, model_dir / "model.pt")  # 1 GiB
    before = _peak_rss_mb()
    _refused(model_dir, r"unexpected \['stray'\]")
    assert _peak_rss_mb() - before < 256


def test_a_golden_file_larger_than_a_golden_graph_is_refused_before_it_is_evaluated(model_dir, monkeypatch):
    from hybridgnn.models import golden

    def evaluated(*args):
        raise AssertionError("a golden graph of 4,000 nodes was evaluated")

    monkeypatch.setattr(golden, "mismatches", evaluated)
    _edit_golden(model_dir, x=lambda g: g["x"].repeat(100, 1), out=lambda g: g["out"].repeat(100, 1))
    _refused(model_dir, r"holds x of shape \(4000, 4\), more than a golden graph of 40 nodes has")


@pytest.mark.parametrize("name", ["config.json", "model.pt", "golden.pt"])
@pytest.mark.parametrize("make, match", [
    (lambda p: p.mkdir(), "is a directory, not a file"),
    (lambda p: p.symlink_to(p.name), "is a link that does not lead to a file"),  # a loop
    (lambda p: p.symlink_to("gone"), "is a link that does not lead to a file"),
])
def test_a_model_file_that_is_not_a_file_says_what_it_is(model_dir, name, make, match):
    # Each was said to be missing from the directory ('lacks model.pt'), which it was not.
    (model_dir / name).unlink()
    make(model_dir / name)
    _refused(model_dir, match)


@pytest.mark.parametrize("fanouts", [[0, 5], [-1, 2], [2.7, 3], [True, 3], ["a", 2]])
def test_fanouts_serve_would_refuse_are_refused_at_save(fanouts, tmp_path):
    # 0, -1 and True were written as given and 2.7 as 2: serve then refused the saved model.
    with pytest.raises(ConfigError, match="save_model fanouts") as info:
        save_model(GraphSAGE(F, 8, 2, 3), tmp_path / "m", fanouts=fanouts)
    assert "\n" not in str(info.value) and not (tmp_path / "m" / "config.json").exists()


def test_fanouts_may_be_given_as_the_flag_writes_them(tmp_path):
    import json

    save_model(GraphSAGE(F, 8, 2, 3), tmp_path / "m", fanouts="10,5")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["fanouts"] == [10, 5]


@pytest.mark.parametrize("extra, match", [
    ({"num_layers": 3}, r"names \['num_layers'\], which save_model writes itself"),
    ({"fanouts": [0]}, r"give fanouts="),
    ({"metrics": {"acc": np.float32(0.9)}}, "extra is not JSON: Object of type float32"),
    ([("a", 1)], "extra must be a dict"),
])
def test_extra_that_would_spoil_config_json_is_refused_before_anything_is_written(extra, match, model_dir):
    # json.dumps failed after model.pt and golden.pt were replaced, leaving the previous
    # model's config.json over the new weights; reserved keys overwrote save_model's.
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    with pytest.raises(ConfigError, match=match):
        save_model(GraphSAGE(F, 8, 2, 3), model_dir, extra=extra)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before


def test_a_model_on_a_filesystem_that_cannot_map_files_is_read(model_dir, monkeypatch):
    real = torch.load

    def no_mmap(*args, mmap=None, **kwargs):
        if mmap:
            raise OSError(19, "No such device")  # mmap on a mount without it
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", no_mmap)
    assert load_model(model_dir)[1]["golden_check_s"] >= 0


def test_a_huge_config_json_is_refused_unread(model_dir):
    # It was read whole (twice: bytes and text) before json said it was not JSON; in a
    # repository the poll reads every model's config.json.
    with open(model_dir / "config.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: nothing is written to make it
    before = _peak_rss_mb()
    _refused(model_dir, r"config.json is 1,073,741,824 bytes, more than such a file holds")
    assert _peak_rss_mb() - before < 256



def _weight_norm(model):
    torch.nn.utils.parametrizations.weight_norm(model.convs[0].lin_l)
    return model


def _extra_parameter(model):
    model.scale = torch.nn.Parameter(torch.ones(3))
    return model


@pytest.mark.parametrize("change, match", [(_weight_norm, "unexpected .*parametrizations"),
                                           (_extra_parameter, r"unexpected \['scale'\]")])
def test_a_model_changed_after_it_was_built_is_refused_as_such(change, match, tmp_path):
    # It was refused as "weights in .../model.pt do not fit", a file save_model had not written.
    with pytest.raises(UnsupportedModel, match=f"holds tensors other than those its options make .*{match}") as info:
        save_model(change(GraphSAGE(F, 8, 2, 3)), tmp_path / "m")
    assert "model.pt" not in str(info.value)


def test_a_model_directory_under_home_is_written_and_read_from_python(tmp_path, monkeypatch):
    # "~/models/x" made a directory named "~" in the working directory (the CLI expanded it)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    save_model(GraphSAGE(F, 8, 2, 3).eval(), "~/models/x")
    assert (tmp_path / "home" / "models" / "x" / "config.json").is_file() and not (tmp_path / "~").exists()
    assert load_model("~/models/x")[1]["in_dim"] == F


# What mutation testing showed unpinned: each test below failed with one small change to
# models/checkpoint.py that the tests above let pass.

def _edit_config(path, **changes):
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del cfg[key]
    (path / "config.json").write_text(json.dumps(cfg))


def test_fanouts_one_short_of_the_layers_are_refused_at_save(tmp_path):
    with pytest.raises(ConfigError, match=r"fanouts \[5\] give 1 hop but the model has 2 layers; give one fanout "
                                          r"per layer$"):
        save_model(GraphSAGE(F, 8, 2, 3), tmp_path / "m", fanouts=[5])
    assert not (tmp_path / "m" / "config.json").exists()


def test_fanouts_past_the_layers_are_cut_at_save_with_a_warning(tmp_path, caplog):
    """They were written as given: config.json said 3 hops for a 2-layer model, and every
    serve of it then cut them again with a warning of its own."""
    import json

    with caplog.at_level("WARNING", logger="hybridgnn.models.checkpoint"):
        save_model(GraphSAGE(F, 8, 2, 3), tmp_path / "m", fanouts="5,4,3")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["fanouts"] == [5, 4]
    assert "fanouts [5, 4, 3] give 3 hops but the model has 2 layers; writing the first 2" in caplog.text
    caplog.clear()
    save_model(GraphSAGE(F, 8, 2, 3), tmp_path / "m2", fanouts=[5, 4])
    assert caplog.text == ""


@pytest.mark.parametrize("training", [False, True])
def test_saving_leaves_the_models_mode_as_it_was(training, tmp_path):
    model = GraphSAGE(F, 8, 2, 3, dropout=0.5).train(training)
    save_model(model, tmp_path / "m")
    assert model.training is training and all(m.training is training for m in model.modules())


def test_a_config_that_is_not_a_json_object_is_refused_in_one_line(model_dir):
    (model_dir / "config.json").write_text("[1, 2]")
    _refused(model_dir, "is not a JSON object")


@pytest.mark.parametrize("key, value", [("num_layers", None), ("out_dim", None), ("in_dim", "4"), ("args", [1])])
def test_a_config_without_a_field_every_reader_needs_is_refused_naming_it(model_dir, key, value):
    _edit_config(model_dir, **{key: value})
    _refused(model_dir, f"lacks '{key}'")


@pytest.mark.parametrize("key", ["in_dim", "out_dim", "num_layers"])
def test_a_config_whose_sizes_differ_from_its_class_arguments_is_refused(model_dir, key):
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    _edit_config(model_dir, **{key: cfg[key] + 1})
    _refused(model_dir, "in_dim/out_dim/num_layers do not match its class arguments")


def test_golden_inputs_narrower_than_the_model_reads_are_refused_in_one_line(model_dir):
    _edit_golden(model_dir, x=lambda g: g["x"][:, :F - 1])
    _refused(model_dir, rf"has \(40, {F - 1}\) inputs for a {F}-feature model")


@pytest.mark.parametrize("key, limit", [("x", 40 * F), ("edge_index", 2 * 40 * 40), ("out", 40 * 3)])
def test_a_golden_tensor_one_element_past_a_golden_graphs_is_refused_by_its_size(model_dir, key, limit):
    _edit_golden(model_dir, **{key: lambda g: torch.zeros(limit + 1, dtype=g[key].dtype)})
    _refused(model_dir, rf"holds {key} of shape \({limit + 1},\), more than a golden graph")


@pytest.mark.parametrize("changes, match", [
    ({"x": lambda g: g["x"][:39], "out": lambda g: g["out"][:39],
      "edge_index": lambda g: g["edge_index"][:, (g["edge_index"] < 39).all(0)]}, "graph of 39 nodes"),  # seed 39
    ({"edge_index": lambda g: torch.cat([g["edge_index"], g["edge_index"][:1]])}, r"edge_index of shape \(3, \d+\)"),
    ({"out": lambda g: 3}, "its 'out' is not a tensor"),
])
def test_a_golden_graph_without_its_seeds_or_pairs_is_refused_in_one_line(model_dir, changes, match):
    _edit_golden(model_dir, **changes)
    _refused(model_dir, match)


@pytest.mark.parametrize("node", [40, -1])  # one past the last golden node, and one before the first
def test_a_golden_edge_to_a_node_just_outside_the_graph_is_refused_in_one_line(model_dir, node):
    def edit(g):
        ei = g["edge_index"].clone()
        ei[0, 0] = node
        return ei

    _edit_golden(model_dir, edge_index=edit)
    _refused(model_dir, "edges to nodes outside its 40")


def test_a_pickle_payload_is_refused_on_a_filesystem_that_cannot_map_files_too(model_dir, monkeypatch, capsys):
    # the read that replaces a refused mmap must unpickle tensors only, as the mapped one does
    real = torch.load

    def no_mmap(*args, mmap=None, **kwargs):
        if mmap:
            raise OSError(19, "No such device")
        return real(*args, **kwargs)

    torch.save({"convs.0.lin_l.weight": _Payload()}, model_dir / "model.pt")
    monkeypatch.setattr(torch, "load", no_mmap)
    _refused(model_dir, r"objects other than tensors.*GLOBAL .*print")
    assert "payload ran" not in capsys.readouterr().out


def test_an_empty_weights_file_says_it_is_not_a_torch_file(model_dir):
    (model_dir / "model.pt").write_bytes(b"")  # a download that wrote nothing
    _refused(model_dir, r"it is not a file torch.save wrote \(a text file, or a truncated download\?\)")


def test_a_config_deeper_than_its_weights_by_one_layer_is_refused_before_it_is_built(model_dir):
    import json

    state = torch.load(model_dir / "model.pt", weights_only=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    _edit_config(model_dir, args={**cfg["args"], "num_layers": len(state) + 1})
    _refused(model_dir, rf"gives {len(state) + 1} layers but .*model.pt holds only {len(state)} tensors")


def test_a_weights_file_holding_one_tensor_is_refused_in_one_line(model_dir):
    torch.save(torch.tensor(1.0), model_dir / "model.pt")
    _refused(model_dir, "holds a Tensor, not a state_dict")


def test_a_models_kind_is_its_short_name():
    from hybridgnn.models.checkpoint import model_kind

    assert model_kind({"class": "torch_geometric.GraphSAGE", "args": {"num_layers": 2}}) == "GraphSAGE"
    assert model_kind({"class": "hybridgnn.GNN", "args": {"kind": "gat"}}) == "gat"
