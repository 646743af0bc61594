"""PSGS and FAP tables: expected sampled-subgraph size and feature access probability."""

from hybridgnn.workload.tables import (
    WorkloadTables,
    compute_fap,
    compute_psgs,
    seed_distribution,
)

__all__ = ["WorkloadTables", "compute_fap", "compute_psgs", "seed_distribution"]
