"""Metrics for code on the event loop's thread: :class:`LoopCounter` and :class:`LoopHistogram`.

Plain adds on the event loop's thread, exposed at scrape time through prometheus_client's own
metric families (the same text as its ``Counter`` / ``Histogram``, pinned by a test).
prometheus_client's metrics take a lock and make three Python calls per update; a proxied
call makes about ten updates. Not for use from other threads: anything updated from another
thread stays on prometheus_client's locked metrics. Used by :mod:`router.metrics`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

LAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount
        self.sum += amount


class _LoopMetric:
    """A metric whose children are plain objects updated on the event loop's thread, exposed
    at scrape time through prometheus_client's own families (so the text is the library's)."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str],
                 registry: CollectorRegistry | None):  # fmt: skip
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        if registry is not None:
            registry.register(self)

    def _child(self) -> Any:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            child = self._children[values] = self._child()
        return child


class LoopCounter(_LoopMetric):
    """A labelled counter for code on the event loop's thread: ``labels(...).inc(n)`` adds to a
    float. prometheus_client's ``Counter`` takes a lock and makes three Python calls per
    ``inc``; a proxied call makes about ten such updates (~6% of the router's instructions per
    call, bench_instructions). Not for use from other threads."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None):  # fmt: skip
        super().__init__(name, doc, labelnames, registry)

    def _child(self) -> _Count:
        return _Count()

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, c in list(self._children.items()):
            fam.add_metric(values, c.value)
        yield fam


class LoopHistogram(_LoopMetric):
    """A labelled histogram for code on the event loop's thread (see :class:`LoopCounter`):
    ``observe`` is one bisect and two adds."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str] = (),
                 buckets: Iterable[float] = LAT_BUCKETS,
                 registry: CollectorRegistry | None = None):  # fmt: skip
        self.bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        super().__init__(name, doc, labelnames, registry)

    def _child(self) -> _Buckets:
        return _Buckets(self.bounds)

    def observe(self, amount: float) -> None:
        self.labels().observe(amount)

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, h in list(self._children.items()):
            fam.add_metric(values, list(zip(self._les, accumulate(h.counts), strict=True)), h.sum)
        yield fam
