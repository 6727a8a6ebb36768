"""Prometheus metrics of the aggregator (prefix ``kvevents_``).

Metrics are objects bound to a registry passed in, never import-time globals (two
aggregators in one process must not collide). Counters that mirror live state (the
subscriber's and the index's) are built from a :class:`~kvevents.service.view.FleetView`
at scrape time, for the engines followed *now*: an engine removed is gone from the
next scrape. Only what has no state elsewhere (latency and lag distributions, lookup
totals) is observed as it happens; a removed engine's lag series is removed with it.

Labels: ``engine`` is the followed engine's name (the name given to ``serve
--endpoint`` / ``POST /v1/engines``). No metric uses a label that Kubernetes service
discovery or the Prometheus operator attach to scraped series themselves (``pod``,
``namespace``, ``service``, ``container``, ``endpoint``, ``instance``, ``job``): a clash
would rename ours ``exported_*``. Hence ``api`` (lookup | route), not ``endpoint``, on
the lookup metrics. ``model_name`` is the engine's model as configured ("" when
unset), as vLLM labels its own metrics; on lookup metrics it is the lookup's model
when some followed engine serves it, else "" (no label values from request input).

Exported:

==========================================  ==============================================
kvevents_events_applied_total               events applied {engine, model_name, tier, type}
kvevents_block_events_applied_total         block entries in them {engine, model_name, tier, type}
kvevents_resident_blocks                    blocks resident now {engine, model_name, tier}
kvevents_batches_total                      batches received {engine, model_name}
kvevents_gaps_total                         seq gaps detected {engine, model_name}
kvevents_replayed_batches_total             batches recovered by replay {engine, model_name}
kvevents_lost_batches_total                 batches neither received nor replayed {engine, ...}
kvevents_publisher_restarts_total           publisher restarts detected {engine, model_name}
kvevents_decode_errors_total                undecodable frames/payloads {engine, model_name, kind}
kvevents_unknown_removals_total             removals of blocks never seen stored {engine, ...}
kvevents_orphan_blocks_total                stored blocks with an unknown parent {engine, ...}
kvevents_engine_up                          1 when connected to the publisher {engine, ...}
kvevents_engine_last_seq                    last seq delivered {engine, model_name}
kvevents_engine_lag_seconds                 now minus the last batch's timestamp {engine, ...}
kvevents_index_entries                      resident (engine, tier, block) entries
kvevents_index_distinct_blocks              distinct content blocks
=======
kvevents_event_lag_seconds                  histogram: apply time minus batch ts {engine, ...}
kvevents_lookups_total                      lookups served {api, model_name}
kvevents_lookup_latency_seconds             histogram: index lookup time {api, model_name}
kvevents_lookup_prompt_tokens_total         prompt tokens looked up {api, model_name}
kvevents_lookup_matched_tokens_total        best engine's matched tokens {api, model_name}
kvevents_lookup_tier_tokens_total           best engine's leading run per tier {api, ..., tier}
kvevents_refused_events_total               events the index refused {engine, model_name, reason}
kvevents_apply_errors_total                 exceptions while applying {engine, model_name, kind}
kvevents_ingest_heartbeat_timestamp_seconds wall time of the ingest loop's last iteration
kvevents_ingest_restarts_total              ingest thread restarts by the watchdog
kvevents_ingest_loop_errors_total           ingest loop iterations that raised (retried)
kvevents_ingest_max_engines                 engines the socket/file budget allows
kvevents_socket_errors_total                failed socket operations, retried {engine, ...}
kvevents_seq_jumps_total                    seqs beyond the believable window {engine, ...}
kvevents_continuity_mismatches_total        replays that showed a restarted publisher {engine, ...}
kvevents_replay_timeouts_total              replays ended by their deadline {engine, ...}
kvevents_held_back_dropped_total            held-back live messages over the byte bound {engine, ...}
kvevents_held_back_bytes                    live bytes held back during a replay {engine, ...}
kvevents_engine_replaying                   1 while a replay is outstanding {engine, ...}
==========================================  ==============================================
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from kvevents.service.view import FleetView

if TYPE_CHECKING:
    from kvevents.index import LookupResult
    from kvevents.wire.schema import KVEventBatch

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LATENCY_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1
)
ENGINE_LABELS = ["engine", "model_name"]


class AggregatorMetrics:
    """Creates and registers the aggregator's metrics on ``registry``; reads live
    state through ``view`` at scrape time."""

    def __init__(self, view: FleetView, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._view = view
        self.event_lag = _LagHistogram()
        registry.register(self.event_lag)
        lookup_labels = ["api", "model_name"]
        self.lookups = Counter("kvevents_lookups", "Lookups served", lookup_labels,
                               registry=registry)
        self.lookup_latency = Histogram(
            "kvevents_lookup_latency_seconds", "Index lookup time", lookup_labels,
            buckets=_LATENCY_BUCKETS, registry=registry,
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
        registry.register(_StateCollector(view))
        # Children are cached per engine so the hot path skips the label lookup; the
        # label values are kept to remove the series when the engine goes.
        self._lag_children: dict[str, tuple[tuple[str, str], object]] = {}
        self._models: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        # Lookup metric children by (api, model) and by ((api, model), tier).
        self._lookup_children: dict[tuple[str, str], tuple] = {}
        self._tier_children: dict[tuple[tuple[str, str], str], Any] = {}

    def _model_of(self, engine: str) -> str:
        for spec in self._view.engine_specs():
            if spec.name == engine:
                return spec.model or ""
        return ""

    def _lookup_model(self, model: str | None) -> str:
        """The model label of a lookup: only models some engine serves (a client's
        typo must not mint a new series)."""
        if not model:
            return ""
        if model not in self._models:
            self._models = frozenset(s.model for s in self._view.engine_specs() if s.model)
        return model if model in self._models else ""

    def observe_batches(self, engine: str, batches: list[KVEventBatch]) -> None:
        """The lag of each of ``batches`` (applied just now), in one call."""
        self.event_lag.observe(engine, self._model_of, time.time(), batches)

    def observe_lookup(self, api: str, seconds: float, result: LookupResult,
                       model: str | None = None) -> None:
        labels = (api, self._lookup_model(model))
        children = self._lookup_children.get(labels)
        if children is None:
            # .labels() costs microseconds per call (a lock and a dict per metric): keep
            # the children; labels are few (two APIs, the served models).
            children = self._lookup_children[labels] = (
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

    def forget_engine(self, engine: str) -> None:
        """Drop a removed engine's histogram series (the state families drop it by
        themselves: they are built from the engines followed now)."""
        self.event_lag.forget(engine)


class _LagHistogram(Collector):
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
                                            [0] * (len(_LAG_BUCKETS) + 1), 0.0]
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
            counts[bisect_left(_LAG_BUCKETS, lag)] += 1
            total += lag
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
            for bound, n in zip((*_LAG_BUCKETS, float("inf")), list(counts)):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            fam.add_metric(list(labels), buckets, total)
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield self._family()


class _StateCollector(Collector):
    """Builds the state-mirroring families from the view at scrape time."""

    def __init__(self, view: FleetView) -> None:
        self._view = view

    def describe(self) -> list[Metric]:
        return []  # families depend on live state; nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        view = self._view
        specs = view.engine_specs()
        model = {s.name: s.model or "" for s in specs}
        counters = view.index.counters()
        applied = CounterMetricFamily(
            "kvevents_events_applied", "Events applied to the index",
            labels=[*ENGINE_LABELS, "tier", "type"])
        blocks = CounterMetricFamily(
            "kvevents_block_events_applied", "Block entries in applied events",
            labels=[*ENGINE_LABELS, "tier", "type"])
        for row in counters.applied:
            if row.engine in model:  # the index keeps counts of removed engines; we do not
                applied.add_metric([row.engine, model[row.engine], row.tier, row.type], row.events)
                blocks.add_metric([row.engine, model[row.engine], row.tier, row.type], row.blocks)
        yield applied
        yield blocks

        # Every followed engine gets a series, 0 until it happens, so dashboards show 0
        # rather than "no data" for the healthy case.
        unknown = CounterMetricFamily(
            "kvevents_unknown_removals", "Removals of blocks never seen stored",
            labels=ENGINE_LABELS)
        orphans = CounterMetricFamily(
            "kvevents_orphan_blocks", "Stored blocks whose parent was unknown",
            labels=ENGINE_LABELS)
        for name, m in model.items():
            unknown.add_metric([name, m], counters.unknown_removals.get(name, 0))
            orphans.add_metric([name, m], counters.orphan_blocks.get(name, 0))
        yield unknown
        yield orphans

        resident = GaugeMetricFamily(
            "kvevents_resident_blocks", "Blocks resident now", labels=[*ENGINE_LABELS, "tier"])
        up = GaugeMetricFamily("kvevents_engine_up", "1 when connected to the engine's publisher",
                               labels=ENGINE_LABELS)
        last_seq = GaugeMetricFamily("kvevents_engine_last_seq", "Last seq delivered",
                                     labels=ENGINE_LABELS)
        lag = GaugeMetricFamily(
            "kvevents_engine_lag_seconds", "Now minus the last batch's timestamp",
            labels=ENGINE_LABELS)
        per_engine = {
            "batches": CounterMetricFamily("kvevents_batches", "Batches received",
                                           labels=ENGINE_LABELS),
            "gaps": CounterMetricFamily("kvevents_gaps", "Seq gaps detected", labels=ENGINE_LABELS),
            "replayed_batches": CounterMetricFamily(
                "kvevents_replayed_batches", "Batches recovered by replay", labels=ENGINE_LABELS),
            "lost_batches": CounterMetricFamily(
                "kvevents_lost_batches", "Batches neither received nor replayed",
                labels=ENGINE_LABELS),
            "restarts": CounterMetricFamily(
                "kvevents_publisher_restarts", "Publisher restarts detected", labels=ENGINE_LABELS),
        }
        errors = CounterMetricFamily(
            "kvevents_decode_errors", "Malformed frames and undecodable payloads or events",
            labels=[*ENGINE_LABELS, "kind"])
        stats = view.source_stats()
        now = time.time()
        for name, m in model.items():
            st = stats.get(name)
            if st is None:
                continue
            for tier, n in view.index.engine_block_counts(name).items():
                resident.add_metric([name, m, tier], n)
            up.add_metric([name, m], 1.0 if st.connected > 0 else 0.0)
            if st.last_seq is not None:
                last_seq.add_metric([name, m], st.last_seq)
            if st.last_batch_ts is not None:
                lag.add_metric([name, m], max(0.0, now - st.last_batch_ts))
            for attr, fam in per_engine.items():
                fam.add_metric([name, m], getattr(st, attr))
            errors.add_metric([name, m, "frame"], st.malformed_frames)
            errors.add_metric([name, m, "payload"], st.decode_errors)
            errors.add_metric([name, m, "event"], st.skipped_events)
        ingest = {
            "socket_errors": CounterMetricFamily(
                "kvevents_socket_errors", "Failed socket operations (retried)", labels=ENGINE_LABELS),
            "seq_jumps": CounterMetricFamily(
                "kvevents_seq_jumps", "Seqs beyond the believable window", labels=ENGINE_LABELS),
            "continuity_mismatches": CounterMetricFamily(
                "kvevents_continuity_mismatches", "Replays that showed a restarted publisher",
                labels=ENGINE_LABELS),
            "replay_timeouts": CounterMetricFamily(
                "kvevents_replay_timeouts", "Replays ended by their deadline", labels=ENGINE_LABELS),
            "pending_dropped": CounterMetricFamily(
                "kvevents_held_back_dropped", "Held-back live messages dropped over the byte bound",
                labels=ENGINE_LABELS),
        }
        held = GaugeMetricFamily("kvevents_held_back_bytes", "Live bytes held back during a replay",
                                 labels=ENGINE_LABELS)
        replaying = GaugeMetricFamily("kvevents_engine_replaying",
                                      "1 while a replay is outstanding", labels=ENGINE_LABELS)
        for name, m in model.items():
            st = stats.get(name)
            if st is None:
                continue
            for attr, fam in ingest.items():
                fam.add_metric([name, m], getattr(st, attr))
            held.add_metric([name, m], st.pending_bytes)
            replaying.add_metric([name, m], 1.0 if st.replaying else 0.0)
        yield from ingest.values()
        yield held
        yield replaying
        apply_errors = CounterMetricFamily(
            "kvevents_apply_errors", "Exceptions while applying batches or events",
            labels=[*ENGINE_LABELS, "kind"])
        for (engine, kind), n in list(view.apply_errors.items()):
            if engine in model:
                apply_errors.add_metric([engine, model[engine], kind], n)
        yield apply_errors
        refused = CounterMetricFamily(
            "kvevents_refused_events", "Events the index refused (bad hashes or tokens, a "
            "namespace or tier cap reached), by reason", labels=[*ENGINE_LABELS, "reason"])
        for engine, reasons in counters.refused_events.items():
            if engine in model:
                for reason, n in reasons.items():
                    refused.add_metric([engine, model[engine], reason], n)
        yield refused
        health = view.ingest_health()
        beat = GaugeMetricFamily("kvevents_ingest_heartbeat_timestamp_seconds",
                                 "Wall time of the ingest loop's last iteration")
        beat.add_metric([], view.ingest_heartbeat_wall())
        yield beat
        restarts = CounterMetricFamily("kvevents_ingest_restarts",
                                       "Ingest thread restarts by the watchdog")
        restarts.add_metric([], health["thread_restarts"])
        yield restarts
        loop_errors = CounterMetricFamily("kvevents_ingest_loop_errors",
                                          "Ingest loop iterations that raised (retried)")
        loop_errors.add_metric([], health["loop_errors"])
        yield loop_errors
        max_engines = GaugeMetricFamily("kvevents_ingest_max_engines",
                                        "Engines the socket/file budget allows")
        max_engines.add_metric([], view.budget.max_engines)
        yield max_engines
        yield resident
        yield up
        yield last_seq
        yield lag
        yield from per_engine.values()
        yield errors

        entries = GaugeMetricFamily("kvevents_index_entries",
                                    "Resident (engine, tier, block) entries")
        entries.add_metric([], counters.resident_entries)
        yield entries
        distinct = GaugeMetricFamily("kvevents_index_distinct_blocks", "Distinct content blocks")
        distinct.add_metric([], counters.distinct_blocks)
        yield distinct
