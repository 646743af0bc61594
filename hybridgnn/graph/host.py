"""Torch views of host arrays."""

from __future__ import annotations

import warnings

import numpy as np
import torch


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a (possibly read-only, mmap'd) array without copying it."""
    with warnings.catch_warnings():
        # The mmap is read-only on purpose; nothing here writes through the tensor.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(array))
