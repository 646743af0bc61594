"""Assembly: the resources a server, a worker process or the profiler opens from a
configuration, and the executor factory."""

from hybridgnn.runtime.resources import Resources

__all__ = ["Resources"]
