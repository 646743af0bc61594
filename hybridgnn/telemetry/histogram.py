"""Labelled Prometheus histograms and counters for what the event loop observes per request
or per batch.

Why not prometheus_client's Histogram: its observe() checks the metric, scans the buckets
in Python and takes a lock twice (about 1 µs, with a label lookup on top), and the
request path makes three or four observations per request; at thousands of requests a
second that is a visible share of the one event loop. Here an observation is a
bisection and two additions, and the buckets are made cumulative only when scraped.

What holds: observe() is called from one thread (the event loop); a scrape from any
thread reads each series' counts as one copy, so bucket counts never go down and the
+Inf bucket equals the count; the sum is read beside them and may lag one observation.
The exposition is the same as a Histogram's (_bucket with le, _count, _sum), without
the _created series. LoopCounter is the same for a Counter (_total).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString


class _Series:
    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: list[float]):
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative; the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (NaN is not counted: it fits no bucket)."""
        if value == value:
            self.counts[bisect.bisect_left(self._bounds, value)] += 1
            self.total += value


class LoopHistogram:
    """Histogram with labels, registered as a collector in `registry`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry):
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = bounds
        self._le = [floatToGoString(b) for b in bounds]
        self._series: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Series:
        """The series of these label values (created, at zero, on first use)."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            series = self._series[values] = _Series(self._bounds)
        return series

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            counts, total = series.counts[:], series.total
            cumulative, running = [], 0
            for le, count in zip(self._le, counts, strict=True):
                running += count
                cumulative.append((le, running))
            family.add_metric([str(v) for v in values], cumulative, total)
        yield family


class _Count:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up, got {amount}")
        self.value += amount


class LoopCounter:
    """Counter with labels, registered as a collector in `registry` (see the module docstring)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry):
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _Count] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Count:
        """The series of these label values (created, at zero, on first use)."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            series = self._series[values] = _Count()
        return series

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            family.add_metric([str(v) for v in values], series.value)
        yield family
