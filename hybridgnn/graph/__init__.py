"""On-disk graph store (CSR + features as .npy, mmap), generators and importers."""

from hybridgnn.graph.store import DatasetError, GraphStore, write_dataset

__all__ = ["DatasetError", "GraphStore", "write_dataset"]
