"""Neighbour samplers: one contract (SampledSubgraph), CPU and GPU implementations."""

from hybridgnn.sampling.base import Sampler
from hybridgnn.sampling.cpu import CPUSampler

__all__ = ["CPUSampler", "Sampler"]
