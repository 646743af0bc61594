"""Feature stores and gathers: host, FAP-ordered device cache, tiered placement plans (GPU, peer GPU, pinned host, disk)."""

from hybridgnn.features.store import FeatureStore, HostFeatureStore

__all__ = ["FeatureStore", "HostFeatureStore"]
