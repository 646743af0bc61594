"""LoopHistogram: the same exposition as prometheus_client's Histogram for the same observations."""

import math

import hypothesis
import hypothesis.strategies as st
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hybridgnn.telemetry.histogram import LoopHistogram
from hybridgnn.telemetry.metrics import LATENCY_BUCKETS


def _samples(registry: CollectorRegistry) -> dict:
    """(sample name, labels) -> value, without the _created series."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(values=st.lists(st.one_of(st.floats(0, 20, allow_nan=False), st.sampled_from(LATENCY_BUCKETS)),
                                  max_size=50),
                  stages=st.lists(st.sampled_from(["total", "respond"]), min_size=50, max_size=50))
def test_the_exposition_is_a_histograms(values, stages):
    """Buckets (le bounds, cumulative counts, +Inf included), counts and sums match what
    prometheus_client's Histogram gives, values on a bucket's bound included."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("x_seconds", "doc", ["stage"], LATENCY_BUCKETS, ours)
    ref = Histogram("x_seconds", "doc", ["stage"], buckets=LATENCY_BUCKETS, registry=theirs)
    for stage in ("total", "respond"):
        mine.labels(stage)
        ref.labels(stage)
    for value, stage in zip(values, stages, strict=False):
        mine.labels(stage).observe(value)
        ref.labels(stage).observe(value)
    a, b = _samples(ours), _samples(theirs)
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert math.isclose(a[key], value, rel_tol=1e-9, abs_tol=1e-12), key


def test_labels_are_checked_and_nan_is_not_counted():
    registry = CollectorRegistry()
    h = LoopHistogram("y_seconds", "doc", ["stage", "pipeline"], (0.1, 1.0), registry)
    with pytest.raises(ValueError, match="takes labels"):
        h.labels("total")
    series = h.labels("total", "cpu")
    series.observe(float("nan"))
    series.observe(0.5)
    got = _samples(registry)
    assert got["y_seconds_count", (("pipeline", "cpu"), ("stage", "total"))] == 1
    assert got["y_seconds_bucket", (("le", "+Inf"), ("pipeline", "cpu"), ("stage", "total"))] == 1
    assert got["y_seconds_bucket", (("le", "0.1"), ("pipeline", "cpu"), ("stage", "total"))] == 0


def test_a_loop_counter_exposes_what_a_counter_does():
    from prometheus_client import Counter

    from hybridgnn.telemetry.histogram import LoopCounter

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopCounter("z_requests", "doc", ["code"], ours)
    ref = Counter("z_requests", "doc", ["code"], registry=theirs)
    for code, n in (("200", 3), ("429", 1)):
        for _ in range(n):
            mine.labels(code).inc()
            ref.labels(code).inc()
    mine.labels("200").inc(2.5)
    ref.labels("200").inc(2.5)
    assert _samples(ours) == _samples(theirs)
    with pytest.raises(ValueError, match="only goes up"):
        mine.labels("200").inc(-1)


def test_label_values_are_shown_as_text():
    """A label value given as a number is exposed as its text, as prometheus_client does."""
    from hybridgnn.telemetry.histogram import LoopCounter

    registry = CollectorRegistry()
    LoopCounter("w_requests", "doc", ["code"], registry).labels(200).inc()
    LoopHistogram("w_seconds", "doc", ["code"], (1.0,), registry).labels(200).observe(0.5)
    got = _samples(registry)
    assert got["w_requests_total", (("code", "200"),)] == 1
    assert got["w_seconds_count", (("code", "200"),)] == 1


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(values=st.lists(st.one_of(st.floats(0, 20), st.sampled_from(LATENCY_BUCKETS)), max_size=60))
def test_observe_many_counts_as_observing_each(values):
    """A batch of observations (lookups a front end answered, counted at once) lands in
    the same buckets, count and sum as observing them one by one; NaN in neither."""
    registry = CollectorRegistry()
    one, many = (LoopHistogram(f"{n}_seconds", "doc", ["stage"], LATENCY_BUCKETS, registry) for n in ("one", "many"))
    for value in values:
        one.labels("s").observe(value)
    many.labels("s").observe_many(values)
    a, b = one.labels("s"), many.labels("s")
    assert a.counts == b.counts and a.total == pytest.approx(b.total)
