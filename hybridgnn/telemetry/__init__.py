"""Prometheus metric definitions and the recorder that turns stage stats into metrics."""

from hybridgnn.telemetry.metrics import STAGES, Telemetry

__all__ = ["STAGES", "Telemetry"]
