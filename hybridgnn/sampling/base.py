"""The sampler contract every pipeline relies on."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hybridgnn.types import SampledSubgraph


class Sampler(Protocol):
    """Uniform K-hop sampling without replacement around `seeds` (global ids, duplicates
    allowed). One instance per worker: instances keep scratch state and are not shared
    between threads; the graph they read is shared."""

    fanouts: tuple[int, ...]

    def sample(self, seeds: np.ndarray) -> SampledSubgraph: ...
