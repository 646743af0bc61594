"""Stage timing without waits (pipelines/stage_clock.py) and the deferred tier counts of
a gather (features/store.gather_pending), on CPU tensors; tests/gpu runs the CUDA side."""

import time

import numpy as np
import torch

from hybridgnn.features.store import (
    CachedFeatureStore,
    HostFeatureStore,
    SwappableFeatureStore,
    gather_pending,
)
from hybridgnn.pipelines.stage_clock import StageClock


def test_a_cpu_clock_times_the_span_between_start_and_stop():
    clock = StageClock(torch.device("cpu"))
    clock.start()
    deadline = time.perf_counter() + 0.02
    while time.perf_counter() < deadline:  # busy, not asleep: the span is what was spent
        pass
    clock.stop()
    time.sleep(0.01)  # after stop: not counted
    assert 0.02 <= clock.seconds() < 0.03 + 0.01


def test_pending_gathers_count_what_gather_counted_counts():
    rng = np.random.default_rng(0)
    features = rng.standard_normal((100, 5)).astype(np.float32)
    ids = rng.integers(0, 100, 40)
    for store in (CachedFeatureStore(features, "cpu", cache_bytes=30 * 5 * 4), HostFeatureStore(features)):
        for wrapped in (store, SwappableFeatureStore(store)):
            rows, tiers = gather_pending(wrapped, ids)
            want_rows, want_tiers = wrapped.gather_counted(ids)
            assert torch.equal(rows, want_rows) and tiers() == want_tiers
            assert sum(want_tiers.values()) == 40
