"""The lookup metrics (``kvevents_lookup*``) {api, model_name}, observed per lookup on
the HTTP threads and the gateway's event loop, and their totals over every series (the
live page's)."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvevents.service.metrics.labels import ModelLabels
from kvevents.service.view import ServiceView

if TYPE_CHECKING:
    from kvevents.index import LookupResult

LATENCY_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1
)
LOOKUP_LABELS = ["api", "model_name"]

# A series' figures: lookups, seconds, prompt tokens, matched tokens, then the latency
# histogram's per-bucket counts (the last: +Inf).
_LOOKUPS, _SECONDS, _PROMPT, _MATCHED, _BUCKETS = 0, 1, 2, 3, 4


class LookupMetrics(Collector):
    """The lookup counters and latency histogram, registered on ``registry`` as one
    collector (scrape order: lookups, latency, prompt tokens, matched tokens, tier
    tokens). A lookup adds to plain numbers under one lock, about 1 us; scrapes build
    the families (prometheus_client's own metrics took a lock per counter and per
    histogram bucket: over 10 us per routed request). Histogram counts are kept per
    bucket and summed at scrape, so a scrape that races a lookup is still consistent."""

    def __init__(self, view: ServiceView, registry: CollectorRegistry) -> None:
        self._view = view
        self._models = ModelLabels(view)  # (a client's model name mints no series)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], list] = {}  # (api, model) -> figures
        self._tiers: dict[tuple[str, str, str], float] = {}  # (api, model, tier) -> tokens
        registry.register(self)

    def observe(self, api: str, seconds: float, result: LookupResult,
                model: str | None = None) -> None:
        labels = (api, self._models.label(model))
        bucket = _BUCKETS + bisect_left(LATENCY_BUCKETS, seconds)
        best = result.engines[0] if result.engines else None
        with self._lock:  # lookups run on several HTTP threads
            figures = self._series.get(labels)
            if figures is None:
                figures = self._series[labels] = [0, 0.0, 0, 0] + [0] * (len(LATENCY_BUCKETS) + 1)
            figures[_LOOKUPS] += 1
            figures[_SECONDS] += seconds
            figures[_PROMPT] += result.prompt_tokens
            figures[bucket] += 1
            if best is not None:
                figures[_MATCHED] += best.tokens
                for tier, n in best.tiers.items():
                    key = (*labels, tier)
                    self._tiers[key] = self._tiers.get(key, 0) + n

    @property
    def totals(self) -> dict[str, float]:
        """Lookups, prompt and matched tokens over every series (the live page's)."""
        with self._lock:
            series = [list(f[:_BUCKETS]) for f in self._series.values()]
        return {"lookups": sum(f[_LOOKUPS] for f in series),
                "prompt_tokens": sum(f[_PROMPT] for f in series),
                "matched_tokens": sum(f[_MATCHED] for f in series)}

    @property
    def tier_totals(self) -> dict[str, float]:
        """Matched tokens per tier over every series."""
        out: dict[str, float] = {}
        with self._lock:
            for (_, _, tier), n in self._tiers.items():
                out[tier] = out.get(tier, 0) + n
        return out

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        return (CounterMetricFamily("kvevents_lookups", "Lookups served", labels=LOOKUP_LABELS),
                HistogramMetricFamily("kvevents_lookup_latency_seconds", "Index lookup time",
                                      labels=LOOKUP_LABELS),
                CounterMetricFamily("kvevents_lookup_prompt_tokens", "Prompt tokens looked up",
                                    labels=LOOKUP_LABELS),
                CounterMetricFamily("kvevents_lookup_matched_tokens",
                                    "Leading tokens cached on the best engine", labels=LOOKUP_LABELS),
                CounterMetricFamily("kvevents_lookup_tier_tokens",
                                    "Best engine's leading cached run per tier",
                                    labels=[*LOOKUP_LABELS, "tier"]))

    def collect(self) -> Iterator[Metric]:
        lookups, latency, prompt, matched, tiers = self._families()
        with self._lock:
            series = [(labels, list(figures)) for labels, figures in self._series.items()]
            tier_tokens = list(self._tiers.items())
        for labels, figures in series:
            lookups.add_metric(labels, figures[_LOOKUPS])
            cumulative, buckets = 0, []
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), figures[_BUCKETS:]):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            latency.add_metric(labels, buckets, figures[_SECONDS])
            prompt.add_metric(labels, figures[_PROMPT])
            matched.add_metric(labels, figures[_MATCHED])
        for labels, n in tier_tokens:
            tiers.add_metric(labels, n)
        yield from (lookups, latency, prompt, matched, tiers)

    def describe(self) -> Iterator[Metric]:
        yield from self._families()
