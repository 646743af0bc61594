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


@pytest.mark.gpu
def test_a_model_trained_on_a_gpu_is_saved_as_it_is(tmp_path):
    # save_model's golden check ran the model on the CPU graph: 'tensors on different devices'.
    from torch_geometric.nn.models import GAT

    from hybridgnn.models.checkpoint import load_model, save_model

    torch.manual_seed(0)
    model = GAT(4, 8, 2, 3, heads=2, norm="batch").cuda().eval()
    save_model(model, tmp_path / "m")
    assert next(model.parameters()).is_cuda  # the caller's model is left where it was
    stack, _ = load_model(tmp_path / "m")
    x, ei = torch.randn(30, 4), torch.randint(0, 30, (2, 90))
    with torch.inference_mode():
        want = model(x.cuda(), ei.cuda()).cpu()
        got = stack(x, ei)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_precompute_ranks_on_cuda_exchange_through_nccl(skewed_graph, tmp_path):
    # one NCCL rank under torchrun (every exchange on the GPU; GCN's degrees too): the
    # ranks' edge totals were all-reduced from a host tensor, which an NCCL group has no
    # backend for
    import json
    import subprocess
    import sys

    from hybridgnn.embeddings.store import EmbeddingStore
    from hybridgnn.models.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = GNN(ModelSpec("gcn", skewed_graph.feature_dim, 8, 3, num_layers=2)).eval()
    save_checkpoint(model, tmp_path / "single")
    save_checkpoint(model, tmp_path / "ranks")
    cpu = precompute(skewed_graph, load_checkpoint(tmp_path / "single")[0], tmp_path / "single", progress=False)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          "-m", "hybridgnn.cli.main", "precompute", "--dataset", str(skewed_graph.root),
                          "--model", str(tmp_path / "ranks"), "--device", "cuda", "--partition", "ranges",
                          "--timeout-s", "60"],  # a hung collective fails in a minute, within gpu_all's stage
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["ranks"] == 1
    got = EmbeddingStore.open(tmp_path / "ranks", skewed_graph.fingerprint)
    np.testing.assert_allclose(np.asarray(got.final), np.asarray(cpu.final), rtol=1e-4, atol=1e-5)
