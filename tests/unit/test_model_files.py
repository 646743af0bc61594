"""Model directories that are damaged or tampered with are refused in one line when
loaded (load_model: what `hybridgnn model check`, serve, precompute and every worker
run), and what save_model cannot check is never written."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn.models import GraphSAGE

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
