"""Prometheus metrics of the aggregator (prefix ``kvevents_``).

Metrics are objects bound to a registry passed in, never import-time globals (two
aggregators in one process must not collide). Counters that mirror live state (the
subscriber's and the index's) are read at scrape time by a custom collector; only what
has no state elsewhere (latency and lag distributions) is observed as it happens.

Exported:

==========================================  =====================================
kvevents_events_applied_total               events applied {pod, tier, type}
kvevents_block_events_applied_total         block entries in them {pod, tier, type}
kvevents_resident_blocks                    blocks resident now {pod, tier}
kvevents_batches_total                      batches received {pod}
kvevents_gaps_total                         seq gaps detected {pod}
kvevents_replayed_batches_total             batches recovered by replay {pod}
kvevents_lost_batches_total                 batches neither received nor replayed {pod}
kvevents_publisher_restarts_total           publisher restarts detected {pod}
kvevents_decode_errors_total                undecodable payloads and frames {pod, kind}
kvevents_unknown_removals_total             removals of blocks never seen stored {pod}
kvevents_orphan_blocks_total                stored blocks with an unknown parent {pod}
kvevents_pod_up                             1 when connected to the publisher {pod}
kvevents_pod_last_seq                       last seq delivered {pod}
kvevents_pod_lag_seconds                    now minus the last batch's timestamp {pod}
kvevents_index_entries                      resident (pod, tier, block) entries
kvevents_index_distinct_blocks              distinct content blocks
kvevents_event_lag_seconds                  histogram: apply time minus batch ts {pod}
kvevents_lookups_total                      lookups served {endpoint}
kvevents_lookup_latency_seconds             histogram: index lookup time {endpoint}
kvevents_lookup_prompt_tokens_total         prompt tokens looked up {endpoint}
kvevents_lookup_matched_tokens_total        best pod's matched tokens {endpoint}
kvevents_lookup_tier_tokens_total           best pod's leading run per tier {endpoint, tier}
kvevents_apply_errors_total                 exceptions while applying {pod, kind}
kvevents_ingest_heartbeat_timestamp_seconds wall time of the ingest loop's last iteration
kvevents_ingest_restarts_total              ingest thread restarts by the watchdog
kvevents_ingest_loop_errors_total           ingest loop iterations that raised (retried)
kvevents_ingest_max_pods                    pods the socket/file budget allows
kvevents_socket_errors_total                failed socket operations, retried {pod}
kvevents_seq_jumps_total                    seqs beyond the believable window {pod}
kvevents_continuity_mismatches_total        replays that showed a restarted publisher {pod}
kvevents_replay_timeouts_total              replays ended by their deadline {pod}
kvevents_held_back_dropped_total            held-back live messages over the byte bound {pod}
kvevents_held_back_bytes                    live bytes held back during a replay {pod}
kvevents_pod_replaying                      1 while a replay is outstanding {pod}
==========================================  =====================================
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvevents.aggregator import Aggregator
    from kvevents.index import LookupResult

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_LATENCY_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1
)


class AggregatorMetrics:
    """Creates and registers the aggregator's metrics on ``registry``."""

    def __init__(self, aggregator: Aggregator, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.event_lag = Histogram(
            "kvevents_event_lag_seconds", "Time from a batch's timestamp to its application",
            ["pod"], buckets=_LAG_BUCKETS, registry=registry,
        )
        self.lookups = Counter(
            "kvevents_lookups", "Lookups served", ["endpoint"], registry=registry
        )
        self.lookup_latency = Histogram(
            "kvevents_lookup_latency_seconds", "Index lookup time", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvevents_lookup_prompt_tokens", "Prompt tokens looked up", ["endpoint"],
            registry=registry,
        )
        self.matched_tokens = Counter(
            "kvevents_lookup_matched_tokens", "Leading tokens cached on the best pod",
            ["endpoint"], registry=registry,
        )
        self.tier_tokens = Counter(
            "kvevents_lookup_tier_tokens", "Best pod's leading cached run per tier",
            ["endpoint", "tier"], registry=registry,
        )
        # Running totals for the live page (a dict read is cheaper than a registry walk).
        self.totals: dict[str, float] = {"lookups": 0, "prompt_tokens": 0, "matched_tokens": 0}
        self.tier_totals: dict[str, float] = {}
        registry.register(_StateCollector(aggregator))
        # Children are cached per label so the hot path skips the label lookup.
        self._lag_children: dict[str, object] = {}

    def observe_batch(self, pod: str, batch_ts: float) -> None:
        child = self._lag_children.get(pod)
        if child is None:
            child = self._lag_children[pod] = self.event_lag.labels(pod)
        child.observe(max(0.0, time.time() - batch_ts))  # type: ignore[attr-defined]

    def observe_lookup(self, endpoint: str, seconds: float, result: LookupResult) -> None:
        self.lookups.labels(endpoint).inc()
        self.lookup_latency.labels(endpoint).observe(seconds)
        self.prompt_tokens.labels(endpoint).inc(result.prompt_tokens)
        self.totals["lookups"] += 1
        self.totals["prompt_tokens"] += result.prompt_tokens
        if result.pods:
            best = result.pods[0]
            self.matched_tokens.labels(endpoint).inc(best.tokens)
            self.totals["matched_tokens"] += best.tokens
            for tier, n in best.tiers.items():
                self.tier_tokens.labels(endpoint, tier).inc(n)
                self.tier_totals[tier] = self.tier_totals.get(tier, 0) + n

    def forget_pod(self, pod: str) -> None:
        """Drop a removed pod's histogram series."""
        if self._lag_children.pop(pod, None) is not None:
            try:
                self.event_lag.remove(pod)
            except KeyError:
                pass


class _StateCollector(Collector):
    """Builds the state-mirroring families from live objects at scrape time."""

    def __init__(self, aggregator: Aggregator) -> None:
        self._agg = aggregator

    def describe(self) -> list[Metric]:
        return []  # families depend on live state; nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        agg = self._agg
        counters = agg.index.counters()
        applied = CounterMetricFamily(
            "kvevents_events_applied", "Events applied to the index", labels=["pod", "tier", "type"])
        blocks = CounterMetricFamily(
            "kvevents_block_events_applied", "Block entries in applied events",
            labels=["pod", "tier", "type"])
        for row in counters.applied:
            applied.add_metric([row.pod, row.tier, row.type], row.events)
            blocks.add_metric([row.pod, row.tier, row.type], row.blocks)
        yield applied
        yield blocks

        # Every followed pod gets a series, 0 until it happens, so dashboards show 0
        # rather than "no data" for the healthy case.
        pod_names = [spec.name for spec in agg.pod_specs()]
        unknown = CounterMetricFamily(
            "kvevents_unknown_removals", "Removals of blocks never seen stored", labels=["pod"])
        orphans = CounterMetricFamily(
            "kvevents_orphan_blocks", "Stored blocks whose parent was unknown", labels=["pod"])
        for pod in pod_names:
            unknown.add_metric([pod], counters.unknown_removals.get(pod, 0))
            orphans.add_metric([pod], counters.orphan_blocks.get(pod, 0))
        yield unknown
        yield orphans

        resident = GaugeMetricFamily(
            "kvevents_resident_blocks", "Blocks resident now", labels=["pod", "tier"])
        up = GaugeMetricFamily("kvevents_pod_up", "1 when connected to the publisher", labels=["pod"])
        last_seq = GaugeMetricFamily("kvevents_pod_last_seq", "Last seq delivered", labels=["pod"])
        lag = GaugeMetricFamily(
            "kvevents_pod_lag_seconds", "Now minus the last batch's timestamp", labels=["pod"])
        per_pod = {
            "batches": CounterMetricFamily("kvevents_batches", "Batches received", labels=["pod"]),
            "gaps": CounterMetricFamily("kvevents_gaps", "Seq gaps detected", labels=["pod"]),
            "replayed_batches": CounterMetricFamily(
                "kvevents_replayed_batches", "Batches recovered by replay", labels=["pod"]),
            "lost_batches": CounterMetricFamily(
                "kvevents_lost_batches", "Batches neither received nor replayed", labels=["pod"]),
            "restarts": CounterMetricFamily(
                "kvevents_publisher_restarts", "Publisher restarts detected", labels=["pod"]),
        }
        errors = CounterMetricFamily(
            "kvevents_decode_errors", "Malformed frames and undecodable payloads or events",
            labels=["pod", "kind"])
        stats = agg.source_stats()
        now = time.time()
        for spec in agg.pod_specs():
            st = stats.get(spec.name)
            if st is None:
                continue
            for tier, n in agg.index.pod_block_counts(spec.name).items():
                resident.add_metric([spec.name, tier], n)
            up.add_metric([spec.name], 1.0 if st.connected > 0 else 0.0)
            if st.last_seq is not None:
                last_seq.add_metric([spec.name], st.last_seq)
            if st.last_batch_ts is not None:
                lag.add_metric([spec.name], max(0.0, now - st.last_batch_ts))
            for attr, fam in per_pod.items():
                fam.add_metric([spec.name], getattr(st, attr))
            errors.add_metric([spec.name, "frame"], st.malformed_frames)
            errors.add_metric([spec.name, "payload"], st.decode_errors)
            errors.add_metric([spec.name, "event"], st.skipped_events)
        ingest = {
            "socket_errors": CounterMetricFamily(
                "kvevents_socket_errors", "Failed socket operations (retried)", labels=["pod"]),
            "seq_jumps": CounterMetricFamily(
                "kvevents_seq_jumps", "Seqs beyond the believable window", labels=["pod"]),
            "continuity_mismatches": CounterMetricFamily(
                "kvevents_continuity_mismatches", "Replays that showed a restarted publisher",
                labels=["pod"]),
            "replay_timeouts": CounterMetricFamily(
                "kvevents_replay_timeouts", "Replays ended by their deadline", labels=["pod"]),
            "pending_dropped": CounterMetricFamily(
                "kvevents_held_back_dropped", "Held-back live messages dropped over the byte bound",
                labels=["pod"]),
        }
        held = GaugeMetricFamily("kvevents_held_back_bytes", "Live bytes held back during a replay",
                                 labels=["pod"])
        replaying = GaugeMetricFamily("kvevents_pod_replaying", "1 while a replay is outstanding",
                                      labels=["pod"])
        for spec in agg.pod_specs():
            st = stats.get(spec.name)
            if st is None:
                continue
            for attr, fam in ingest.items():
                fam.add_metric([spec.name], getattr(st, attr))
            held.add_metric([spec.name], st.pending_bytes)
            replaying.add_metric([spec.name], 1.0 if st.replaying else 0.0)
        yield from ingest.values()
        yield held
        yield replaying
        apply_errors = CounterMetricFamily(
            "kvevents_apply_errors", "Exceptions while applying batches or events",
            labels=["pod", "kind"])
        for (pod, kind), n in list(agg.apply_errors.items()):
            apply_errors.add_metric([pod, kind], n)
        yield apply_errors
        health = agg.ingest_health()
        beat = GaugeMetricFamily("kvevents_ingest_heartbeat_timestamp_seconds",
                                 "Wall time of the ingest loop's last iteration")
        beat.add_metric([], agg.ingest_heartbeat_wall())
        yield beat
        restarts = CounterMetricFamily("kvevents_ingest_restarts",
                                       "Ingest thread restarts by the watchdog")
        restarts.add_metric([], health["thread_restarts"])
        yield restarts
        loop_errors = CounterMetricFamily("kvevents_ingest_loop_errors",
                                          "Ingest loop iterations that raised (retried)")
        loop_errors.add_metric([], health["loop_errors"])
        yield loop_errors
        max_pods = GaugeMetricFamily("kvevents_ingest_max_pods",
                                     "Pods the socket/file budget allows")
        max_pods.add_metric([], agg.budget.max_pods)
        yield max_pods

        yield resident
        yield up
        yield last_seq
        yield lag
        yield from per_pod.values()
        yield errors

        entries = GaugeMetricFamily("kvevents_index_entries", "Resident (pod, tier, block) entries")
        entries.add_metric([], counters.resident_entries)
        yield entries
        distinct = GaugeMetricFamily("kvevents_index_distinct_blocks", "Distinct content blocks")
        distinct.add_metric([], counters.distinct_blocks)
        yield distinct
