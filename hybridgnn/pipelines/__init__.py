"""Pipelines execute batches: sample → gather features → model on one device, with
worker threads sharing one queue."""

from hybridgnn.pipelines.executor import BatchExecutor
from hybridgnn.pipelines.pool import Pipeline

__all__ = ["BatchExecutor", "Pipeline"]
