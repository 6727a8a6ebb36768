"""The lookup metrics (``kvevents_lookup*``) {api, model_name}, observed per lookup on
the HTTP threads, and the running totals the live page reads."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvevents.service.view import ServiceView

if TYPE_CHECKING:
    from kvevents.index import LookupResult

LATENCY_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1
)
LOOKUP_LABELS = ["api", "model_name"]


class LookupMetrics:
    """Creates and registers the lookup counters and latency histogram on ``registry``
    (in this order: lookups, latency, prompt tokens, matched tokens, tier tokens)."""

    def __init__(self, view: ServiceView, registry: CollectorRegistry) -> None:
        self._view = view
        lookup_labels = LOOKUP_LABELS
        self.lookups = Counter("kvevents_lookups", "Lookups served", lookup_labels,
                               registry=registry)
        self.lookup_latency = Histogram(
            "kvevents_lookup_latency_seconds", "Index lookup time", lookup_labels,
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvevents_lookup_prompt_tokens", "Prompt tokens looked up", lookup_labels,
            registry=registry,
        )
        self.matched_tokens = Counter(
            "kvevents_lookup_matched_tokens", "Leading tokens cached on the best engine",
            lookup_labels, registry=registry,
        )
        self.tier_tokens = Counter(
            "kvevents_lookup_tier_tokens", "Best engine's leading cached run per tier",
            [*lookup_labels, "tier"], registry=registry,
        )
        # Running totals for the live page (a dict read is cheaper than a registry walk).
        self.totals: dict[str, float] = {"lookups": 0, "prompt_tokens": 0, "matched_tokens": 0}
        self.tier_totals: dict[str, float] = {}
        self._models: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        # Metric children by (api, model) and by ((api, model), tier).
        self._children: dict[tuple[str, str], tuple] = {}
        self._tier_children: dict[tuple[tuple[str, str], str], Any] = {}

    def _model_label(self, model: str | None) -> str:
        """The model label of a lookup: only models some engine serves (a client's
        typo must not mint a new series)."""
        if not model:
            return ""
        if model not in self._models:
            self._models = frozenset(s.model for s in self._view.engine_specs() if s.model)
        return model if model in self._models else ""

    def observe(self, api: str, seconds: float, result: LookupResult,
                model: str | None = None) -> None:
        labels = (api, self._model_label(model))
        children = self._children.get(labels)
        if children is None:
            # .labels() costs microseconds per call (a lock and a dict per metric): keep
            # the children; labels are few (two APIs, the served models).
            children = self._children[labels] = (
                self.lookups.labels(*labels), self.lookup_latency.labels(*labels),
                self.prompt_tokens.labels(*labels), self.matched_tokens.labels(*labels))
        lookups, latency, prompt_tokens, matched_tokens = children
        lookups.inc()
        latency.observe(seconds)
        prompt_tokens.inc(result.prompt_tokens)
        best = result.engines[0] if result.engines else None
        with self._lock:  # lookups run on several HTTP threads
            self.totals["lookups"] += 1
            self.totals["prompt_tokens"] += result.prompt_tokens
            if best is not None:
                self.totals["matched_tokens"] += best.tokens
                for tier, n in best.tiers.items():
                    self.tier_totals[tier] = self.tier_totals.get(tier, 0) + n
        if best is not None:
            matched_tokens.inc(best.tokens)
            for tier, n in best.tiers.items():
                child = self._tier_children.get((labels, tier))
                if child is None:
                    child = self._tier_children[(labels, tier)] = self.tier_tokens.labels(*labels, tier)
                child.inc(n)
