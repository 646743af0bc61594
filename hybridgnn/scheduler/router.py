"""Quiver's hybrid rule plus load awareness (docs/architecture.md).

A batch whose PSGS is below the threshold goes to the CPU pipeline, otherwise to the GPU
pipeline. When the chosen pipeline is saturated and the other has slack, the batch
spills to the other one (unless spilling is off), unless it is larger than the other may take (spill
limits, set by an SLO policy so that a spill never misses the SLO). With a single pipeline every batch goes there.

The GPU is one device for both lanes: a split CPU lane's batches that are on the device
(QueueLoad.on_device) count towards the GPU's load, so a batch never spills onto a GPU
that the CPU lane's own device work keeps busy.
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridgnn.config import RouterConfig
from hybridgnn.types import QueueLoad, RoutePlan

CPU, GPU = "cpu", "gpu"


class Router:
    def __init__(self, cfg: RouterConfig, pipelines: tuple[str, ...]):
        if not pipelines:
            raise ValueError("the router needs at least one pipeline")
        unknown = set(pipelines) - {CPU, GPU}
        if unknown:
            raise ValueError(f"unknown pipeline names {sorted(unknown)}; expected {CPU!r} and/or {GPU!r}")
        self.cfg = cfg
        self.pipelines = tuple(pipelines)
        given = cfg.psgs_threshold if cfg.psgs_threshold is not None else float("inf")
        self.threshold = given if len(pipelines) > 1 else float("inf")
        self.spill_limits: dict[str, float] = {}

    def set_threshold(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"psgs threshold must be >= 0, got {value}")
        self.threshold = value

    def apply_policy(self, policy) -> None:
        """Take a policy's threshold (a two-pipeline router only) and spill limits."""
        if len(self.pipelines) > 1:
            self.set_threshold(policy.psgs_threshold)
        self.spill_limits = dict(policy.pipeline_limits)

    def saturated(self, load: QueueLoad) -> bool:
        return load.depth >= self.cfg.saturation_batches_per_worker * load.workers

    def route(self, batch_psgs: float, loads: Mapping[str, QueueLoad]) -> RoutePlan:
        if len(self.pipelines) == 1:
            return RoutePlan(self.pipelines[0], batch_psgs, "only")
        chosen = CPU if batch_psgs < self.threshold else GPU
        other = GPU if chosen == CPU else CPU
        loads = {CPU: loads[CPU], GPU: self.device_load(loads)}
        if (self.cfg.spill and self.saturated(loads[chosen]) and not self.saturated(loads[other])
                and batch_psgs <= self.spill_limits.get(other, float("inf"))):
            return RoutePlan(other, batch_psgs, "spill")
        return RoutePlan(chosen, batch_psgs, "threshold")

    @staticmethod
    def device_load(loads: Mapping[str, QueueLoad]) -> QueueLoad:
        """The GPU's load: its own lane's batches and the split CPU lane's on the device."""
        gpu = loads[GPU]
        return QueueLoad(gpu.depth + loads[CPU].on_device, gpu.workers)

    def fallback(self, plan: RoutePlan) -> RoutePlan:
        """Where a batch goes after its pipeline failed on it (a CUDA error, say)."""
        if plan.pipeline == GPU and CPU in self.pipelines:
            return RoutePlan(CPU, plan.batch_psgs, "fallback")
        raise LookupError(f"no fallback pipeline for {plan.pipeline!r}")
