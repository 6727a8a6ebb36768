"""``kvevents_event_lag_seconds``: the per-engine apply-lag histogram, observed on the
ingest thread."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvevents.service.metrics.collector import ENGINE_LABELS

if TYPE_CHECKING:
    from kvevents.wire.schema import KVEventBatch

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class LagHistogram(Collector):
    """``kvevents_event_lag_seconds`` {engine, model_name}: a histogram observed once
    per batch on the ingest thread, at a few hundred ns each (prometheus_client's
    Histogram takes a lock per bucket and per sum, microseconds per observation at tens
    of thousands of batches a second). Counts are kept per bucket, not cumulative, and
    summed at scrape; ``_count`` is the sum of the buckets, so a scrape that races an
    observation is still a consistent histogram. Written by one thread (the ingest
    loop); read by scrapes."""

    def __init__(self) -> None:
        # engine -> [labels, per-bucket counts (last: +Inf), sum of observations]
        self._series: dict[str, list] = {}

    def _entry(self, engine: str, model_of: Callable[[str], str]) -> list:
        entry = self._series.get(engine)
        if entry is None:
            entry = self._series[engine] = [(engine, model_of(engine)),
                                            [0] * (len(LAG_BUCKETS) + 1), 0.0]
        return entry

    def observe(self, engine: str, model_of: Callable[[str], str], now: float,
                batches: list[KVEventBatch]) -> None:
        """Each of ``batches``' lag: ``now`` minus its timestamp."""
        entry = self._entry(engine, model_of)
        counts = entry[1]
        total = 0.0
        for b in batches:
            lag = now - b.ts
            if lag < 0.0 or lag != lag:  # clock skew, or a publisher's NaN timestamp
                lag = 0.0
            counts[bisect_left(LAG_BUCKETS, lag)] += 1
            total += lag
        entry[2] += total

    def merge(self, engine: str, model_of: Callable[[str], str], counts: list[int],
              total: float) -> None:
        """Observations made elsewhere (a sink's, per bucket of :data:`LAG_BUCKETS`, the
        last +Inf), added in."""
        entry = self._entry(engine, model_of)
        mine = entry[1]
        for i, n in enumerate(counts):
            mine[i] += n
        entry[2] += total

    def forget(self, engine: str) -> None:
        self._series.pop(engine, None)

    @staticmethod
    def _family() -> HistogramMetricFamily:
        return HistogramMetricFamily("kvevents_event_lag_seconds",
                                     "Time from a batch's timestamp to its application",
                                     labels=ENGINE_LABELS)

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        for labels, counts, total in list(self._series.values()):
            cumulative, buckets = 0, []
            for bound, n in zip((*LAG_BUCKETS, float("inf")), list(counts)):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            fam.add_metric(list(labels), buckets, total)
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield self._family()
