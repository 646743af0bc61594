"""hybridgnn: workload-aware GPU/CPU hybrid scheduling for GNN inference serving.

`hybridgnn.save_model(model, "models/mine")` writes a model directory `hybridgnn serve`
can serve (imported on first use, so the CLI starts without loading torch)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("save_model", "load_model"):
        from hybridgnn.models import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'hybridgnn' has no attribute {name!r}")
