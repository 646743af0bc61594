"""A batch's answers on the host (pipelines/host_results.py), on CPU tensors: the unique
seeds' rows in the request's order, repeats and empty batches included, as the device
would index them; float16 rows come back as float32."""

import numpy as np
import torch

from hybridgnn.pipelines.host_results import HostResults


def test_answers_follow_the_request_order_as_device_indexing_does():
    rng = np.random.default_rng(0)
    results = HostResults(pinned=False)
    for dtype in (torch.float32, torch.float16):
        out = torch.from_numpy(rng.standard_normal((9, 4))).to(dtype)  # 3 unique seeds, then other nodes
        hidden = torch.from_numpy(rng.standard_normal((9, 6))).to(dtype)
        for seed_index in ([2, 0, 0, 1], [1], []):
            index = np.array(seed_index, dtype=np.int64)
            logits, emb, pred = results.answer(out, hidden, 3, index, lambda: None)
            want = out[torch.from_numpy(index)].float()
            assert logits.dtype == np.float32 and np.array_equal(logits, want.numpy())
            assert np.array_equal(emb, hidden[torch.from_numpy(index)].float().numpy())
            assert np.array_equal(pred, want.argmax(dim=1).numpy()) and pred.shape == (len(seed_index),)
            if dtype == torch.float32:  # arrays of their own, not views of the model's output
                assert not np.shares_memory(logits, out.numpy())
