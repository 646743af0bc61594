"""Link decoders: "dot" and the user's own module kept as an allowlisted fx graph, rebuilt
exactly, refused in one line when they cannot be, and checked again when loaded."""

import json

import pytest
import torch
from torch import nn
from torch_geometric.nn import Linear as PygLinear

from hybridgnn.models.link import GraphDecoder, dot, load_decoder, save_decoder
from hybridgnn.models.zoo import UnsupportedModel
from tests.support.hetero import MLPDecoder

WIDTHS = {"user": 8, "item": 8, "tag": 3}


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, a, b):
        return ((a @ self.w) * b).sum(dim=-1).sigmoid()


class Deep(nn.Module):
    """Submodules of several kinds, a PyG Linear traced through, dropout and a norm."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 12), nn.LayerNorm(12), nn.LeakyReLU(0.1), nn.Dropout(0.5),
                                 nn.Linear(12, 6), nn.GELU(approximate="tanh"))
        self.out = PygLinear(6, 1)

    def forward(self, a, b):
        return self.out(self.mlp(torch.cat([a, b], -1)))[:, 0]


@pytest.mark.parametrize("make", [lambda: MLPDecoder(8), Bilinear, Deep])
def test_user_decoders_are_rebuilt_exactly_and_checked_on_load(make, tmp_path):
    torch.manual_seed(0)
    module = make()
    entry = save_decoder(tmp_path, module, WIDTHS)
    assert entry["kind"] == "graph"
    # only the type pairs whose widths the module takes are scored
    assert sorted(map(tuple, entry["pairs"])) == [("item", "item"), ("item", "user"), ("user", "item"),
                                                  ("user", "user")]
    decoder, pairs = load_decoder(tmp_path, entry, WIDTHS)
    a, b = torch.randn(50, 8), torch.randn(50, 8)
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(decoder(a, b).reshape(-1), module(a, b).reshape(-1), atol=1e-6, rtol=1e-6)
    assert ("user", "item") in pairs
    graph = json.loads((tmp_path / "decoder.json").read_text())["nodes"]
    assert all(n["op"] in ("input", "output", "tensor", "call", "method") for n in graph)


def test_dot_scores_the_pairs_of_equal_width(tmp_path):
    entry = save_decoder(tmp_path, "dot", WIDTHS)
    assert ["tag", "tag"] in entry["pairs"] and ["user", "tag"] not in entry["pairs"]
    decoder, _ = load_decoder(tmp_path, entry, WIDTHS)
    assert decoder is dot


def test_decoders_that_cannot_be_kept_exactly_are_refused_in_one_line(tmp_path):
    class Branchy(nn.Module):
        def forward(self, a, b):
            if a.sum() > 0:
                return a.sum(-1)
            return b.sum(-1)

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv1d(1, 1, 1)

        def forward(self, a, b):
            return self.c(a.unsqueeze(1)).sum((1, 2))

    class Three(nn.Module):
        def forward(self, a, b, c):
            return (a * b * c).sum(-1)

    class Numpyish(nn.Module):
        def forward(self, a, b):
            return torch.fft.fft(a).real.sum(-1)

    for module, words in ((Branchy(), "traced"), (Conv(), "Conv1d"), (Three(), "exactly two"),
                          (Numpyish(), "cannot hold"), ("cosine", "'dot' or a torch.nn.Module")):
        with pytest.raises(UnsupportedModel, match=words) as err:
            save_decoder(tmp_path / "x", module, WIDTHS)
        assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedModel, match="scores no pair"):
        save_decoder(tmp_path / "y", MLPDecoder(5), WIDTHS)


def test_a_damaged_or_hostile_decoder_file_is_refused_on_load(tmp_path):
    entry = save_decoder(tmp_path, MLPDecoder(8), WIDTHS)
    path = tmp_path / "decoder.json"
    good = json.loads(path.read_text())
    hostile = json.loads(path.read_text())
    hostile["nodes"][2] = {"op": "call", "name": "x", "target": "os.system", "args": ["true"], "kwargs": {}}
    path.write_text(json.dumps(hostile))
    with pytest.raises(ValueError, match="not allowed"):
        load_decoder(tmp_path, entry, WIDTHS)
    path.write_text(json.dumps({"nodes": [{"op": "eval"}]}))
    with pytest.raises(ValueError, match="not a decoder-graph node"):
        load_decoder(tmp_path, entry, WIDTHS)
    # changed weights: the golden scores are not reproduced
    path.write_text(json.dumps(good))
    tensors = torch.load(tmp_path / "decoder.pt", weights_only=True)
    tensors["tensor/lin2.weight"] = tensors["tensor/lin2.weight"] + 1
    torch.save(tensors, tmp_path / "decoder.pt")
    with pytest.raises(ValueError, match="golden scores"):
        load_decoder(tmp_path, entry, WIDTHS)
    with pytest.raises(ValueError, match="link_decoder must be"):
        load_decoder(tmp_path, {"kind": "pickle"}, WIDTHS)


def test_graph_decoder_refuses_methods_on_non_tensors():
    nodes = [{"op": "input", "name": "a"}, {"op": "input", "name": "b"},
             {"op": "method", "name": "s", "target": "size", "args": [{"n": "a"}, 0], "kwargs": {}},
             {"op": "method", "name": "bad", "target": "sum", "args": [{"n": "s"}], "kwargs": {}},
             {"op": "output", "args": [{"n": "bad"}]}]
    with pytest.raises(ValueError, match="on a int"):
        GraphDecoder(nodes, {})(torch.ones(2, 3), torch.ones(2, 3))


def test_a_decoder_whose_scores_depend_on_the_other_pairs_is_refused(tmp_path):
    """Scores normalised over the rows scored together would change with the batch a
    request shares (or a top-k's chunk), so they cannot be served exactly."""
    class Softmax(nn.Module):
        def forward(self, a, b):
            return (a * b).sum(-1).softmax(0)

    class Centred(nn.Module):
        def forward(self, a, b):
            d = (a * b).sum(-1)
            return d - d.mean()

    for module in (Softmax(), Centred()):
        with pytest.raises(UnsupportedModel, match="depends on the other pairs") as err:
            save_decoder(tmp_path / "x", module, WIDTHS)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("target, args", [
    ("operator.mul", ["x", 10 ** 12]),  # a terabyte string
    ("operator.mul", [{"l": [1]}, 10 ** 12]),
    ("operator.pow", [7, 10 ** 9]),  # an integer of hundreds of megabytes, computed for minutes
])
def test_a_decoder_graph_doing_arithmetic_on_python_objects_without_bound_is_refused(target, args):
    nodes = [{"op": "input", "name": "a"}, {"op": "input", "name": "b"},
             {"op": "call", "name": "big", "target": target, "args": args, "kwargs": {}},
             {"op": "output", "args": [{"n": "a"}]}]
    with pytest.raises(ValueError, match="decoder graph"):
        GraphDecoder(nodes, {})(torch.ones(2, 3), torch.ones(2, 3))


def test_a_decoder_scaled_by_its_width_still_serves(tmp_path):
    class Scaled(nn.Module):
        def forward(self, a, b):
            return (a * b).sum(-1) / a.size(-1) ** 0.5 * 2

    entry = save_decoder(tmp_path, Scaled(), WIDTHS)
    decoder, pairs = load_decoder(tmp_path, entry, WIDTHS)
    assert pairs
