"""Feature stores and gathers (host tier now; topology-aware tiers plug in here)."""

from hybridgnn.features.store import FeatureStore, HostFeatureStore

__all__ = ["FeatureStore", "HostFeatureStore"]
