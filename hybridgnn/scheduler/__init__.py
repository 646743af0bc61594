"""Routing decisions: which pipeline runs a batch. Decides only; never touches tensors."""

from hybridgnn.scheduler.router import Router

__all__ = ["Router"]
