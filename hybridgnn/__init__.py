"""hybridgnn: workload-aware GPU/CPU hybrid scheduling for GNN inference serving."""

__version__ = "0.1.0"
