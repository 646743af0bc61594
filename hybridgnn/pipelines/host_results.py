"""A batch's answers brought to the host, shared by the device executors (GPU lane and
the split lane's device stage).

The model's rows begin with the unique seeds' (the sampler puts them first), so only
those are copied back; they are put in the request's order, repeats included, and their
argmax taken on the host, where the seed index already is. On a GPU the copies go
through pinned buffers kept for reuse (no pinned allocation per batch), all waited for
at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class HostResults:
    """Reused host buffers (pinned on a GPU) for one thread's batches, one at a time."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._buffers: list[torch.Tensor] = []

    def answer(self, out: torch.Tensor, hidden: torch.Tensor, count: int, seed_index: np.ndarray,
               sync: Callable[[], None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logits, embeddings, predictions) in the request's order: rows seed_index of the
        first `count` rows of out and hidden, as float32 host arrays of their own."""
        unique_logits, unique_emb = self.copy((out[:count].float(), hidden[:count].float()), sync)
        logits, emb = unique_logits[seed_index], unique_emb[seed_index]
        return logits, emb, logits.argmax(axis=1)

    def copy(self, tensors, sync: Callable[[], None]) -> list[np.ndarray]:
        """Host arrays of these tensors: on a GPU through the kept pinned buffers with
        non-blocking copies and one sync(); the arrays are views of those buffers, valid
        until the next copy (answer() indexes them into arrays of their own)."""
        if tensors[0].device.type != "cuda":
            return [a.numpy() for a in tensors]
        while len(self._buffers) < len(tensors):
            self._buffers.append(torch.empty(0, dtype=torch.float32))
        host = []
        for i, a in enumerate(tensors):
            b = self._buffers[i]
            if b.dtype != a.dtype or b.numel() < a.numel():
                b = self._buffers[i] = torch.empty(max(a.numel(), 2 * b.numel()), dtype=a.dtype,
                                                   pin_memory=self.pinned)
            dst = b[:a.numel()].view(a.shape)
            dst.copy_(a, non_blocking=True)
            host.append(dst)
        sync()
        return [h.numpy() for h in host]
