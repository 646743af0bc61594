"""CUDA-only checks (marker gpu; skipped without CUDA)."""

import numpy as np
import pytest
import torch

from hybridgnn.embeddings.precompute import PrecomputeConfig, precompute
from hybridgnn.models.gnn import GNN, ModelSpec


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
def test_precompute_on_cuda_matches_cpu(skewed_graph, tmp_path, kind):
    torch.manual_seed(0)
    model = GNN(ModelSpec(kind, skewed_graph.feature_dim, 8, 3, num_layers=2, heads=2)).eval()
    cpu = precompute(skewed_graph, model, tmp_path / "cpu", PrecomputeConfig(batch_size=16), progress=False)
    gpu = precompute(skewed_graph, model, tmp_path / "gpu", PrecomputeConfig(batch_size=16, device="cuda"),
                     progress=False)
    np.testing.assert_allclose(np.asarray(gpu.final), np.asarray(cpu.final), rtol=1e-4, atol=1e-5)
