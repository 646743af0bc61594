"""Decisions, never execution: which pipeline runs a batch (router), whether a request is
admitted (admission), which policy a profile and an SLO give and how --adapt moves it
(policy, curves, queueing, control). Nothing here touches tensors or sockets."""

from hybridgnn.scheduler.router import Router

__all__ = ["Router"]
