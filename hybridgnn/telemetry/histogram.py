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

import abc
import bisect
import math
from collections.abc import Iterator, Sequence

import numpy as np
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

    def observe_many(self, values) -> None:
        """observe() of each value, at once (an array of many)."""
        values = np.asarray(values, dtype=np.float64)
        values = values[~np.isnan(values)]
        if len(values):
            buckets = np.bincount(np.searchsorted(self._bounds, values, side="left"), minlength=len(self.counts))
            counts = self.counts
            for i in np.flatnonzero(buckets).tolist():
                counts[i] += int(buckets[i])
            self.total += float(values.sum())


class _Count:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up, got {amount}")
        self.value += amount


class _LoopMetric(abc.ABC):
    """Series by label values, registered as a collector; subclasses say what a series is
    (_new_series) and how one is exposed in the family (family_type, _add)."""

    family_type: type = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple, object] = {}
        registry.register(self)

    def labels(self, *values):
        """The series of these label values (created, at zero, on first use)."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            series = self._series[values] = self._new_series()
        return series

    def remove_matching(self, **match: str) -> list[tuple]:
        """Drop the series whose labels take these values (a model version unloaded: its
        series would otherwise be exposed, and kept, for the life of the process); the
        label values of those dropped."""
        where = [(self.labelnames.index(k), v) for k, v in match.items()]
        gone = [values for values in self._series if all(values[i] == v for i, v in where)]
        for values in gone:
            del self._series[values]
        return gone

    def describe(self) -> list:
        return [self.family_type(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator:
        family = self.family_type(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):  # one copy: the loop may add a series meanwhile
            self._add(family, [str(v) for v in values], series)
        yield family

    @abc.abstractmethod
    def _new_series(self):
        """A new series at zero."""

    @abc.abstractmethod
    def _add(self, family, values: list[str], series) -> None:
        """Add one series, with its label values, to the family being collected."""


class LoopHistogram(_LoopMetric):
    """Histogram with labels (buckets as for prometheus_client's Histogram; +Inf added)."""

    family_type = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry):
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = bounds
        self._le = [floatToGoString(b) for b in bounds]
        super().__init__(name, documentation, labelnames, registry)

    def _new_series(self) -> _Series:
        return _Series(self._bounds)

    def _add(self, family, values: list[str], series: _Series) -> None:
        counts, total = series.counts[:], series.total
        cumulative, running = [], 0
        for le, count in zip(self._le, counts, strict=True):
            running += count
            cumulative.append((le, running))
        family.add_metric(values, cumulative, total)


class LoopCounter(_LoopMetric):
    """Counter with labels (exposed as <name>_total)."""

    family_type = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry):
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_series(self) -> _Count:
        return _Count()

    def _add(self, family, values: list[str], series: _Count) -> None:
        family.add_metric(values, series.value)
