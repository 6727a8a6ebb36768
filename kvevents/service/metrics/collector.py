"""The state-mirroring families, built from a :class:`ServiceView` at scrape time.

One function per family group; :meth:`StateCollector.collect` calls them in the order
the view is read and yields their families in the exposition order of the scrape.
Every per-engine family covers the engines followed *now* (``model``: engine name ->
model label), so a removed engine is gone from the next scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvevents.ingest.gilmeter import HOLD_BUCKETS

from kvevents.service.view import ServiceView

ENGINE_LABELS = ["engine", "model_name"]


class StateCollector(Collector):
    """Builds the state-mirroring families from the view at scrape time."""

    def __init__(self, view: ServiceView) -> None:
        self._view = view

    def describe(self) -> list[Metric]:
        return []  # families depend on live state; nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        view = self._view
        model = {s.name: s.model or "" for s in view.engine_specs()}
        counters = view.index.counters()
        yield from applied_events(counters, model)
        yield from index_anomalies(counters, model)
        stats = view.source_stats()
        now = time.time()
        # Built now (the view is read in this order), yielded after the ingest families.
        streams = resident_blocks(view, stats, model) + stream_stats(stats, model, now)
        yield from ingest_recovery(stats, model)
        yield from apply_errors(view, model)
        yield from refused_events(counters, model)
        yield from ingest_health(view)
        yield from streams
        yield from index_totals(counters)


def applied_events(counters: Any, model: Mapping[str, str]) -> list[Metric]:
    """``kvevents_events_applied`` and ``kvevents_block_events_applied``
    {engine, model_name, tier, type}, from the index's counters."""
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
    return [applied, blocks]


def index_anomalies(counters: Any, model: Mapping[str, str]) -> list[Metric]:
    """``kvevents_unknown_removals`` and ``kvevents_orphan_blocks`` {engine, model_name}.
    Every followed engine gets a series, 0 until it happens, so dashboards show 0
    rather than "no data" for the healthy case."""
    unknown = CounterMetricFamily(
        "kvevents_unknown_removals", "Removals of blocks never seen stored",
        labels=ENGINE_LABELS)
    orphans = CounterMetricFamily(
        "kvevents_orphan_blocks", "Stored blocks whose parent was unknown",
        labels=ENGINE_LABELS)
    for name, m in model.items():
        unknown.add_metric([name, m], counters.unknown_removals.get(name, 0))
        orphans.add_metric([name, m], counters.orphan_blocks.get(name, 0))
    return [unknown, orphans]


def resident_blocks(view: ServiceView, stats: Mapping[str, Any],
                    model: Mapping[str, str]) -> list[Metric]:
    """``kvevents_resident_blocks`` {engine, model_name, tier}: the index's per-tier
    block counts of each followed engine that has a source."""
    resident = GaugeMetricFamily(
        "kvevents_resident_blocks", "Blocks resident now", labels=[*ENGINE_LABELS, "tier"])
    for name, m in model.items():
        if stats.get(name) is None:
            continue
        for tier, n in view.index.engine_block_counts(name).items():
            resident.add_metric([name, m, tier], n)
    return [resident]


def stream_stats(stats: Mapping[str, Any], model: Mapping[str, str],
                 now: float) -> list[Metric]:
    """Each engine's stream, from its subscriber's stats: up, last seq, lag, the batch
    counters (received, gaps, replayed, lost, publisher restarts) and
    ``kvevents_decode_errors`` by kind (frame, payload, event)."""
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
    for name, m in model.items():
        st = stats.get(name)
        if st is None:
            continue
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
    return [up, last_seq, lag, *per_engine.values(), errors]


def ingest_recovery(stats: Mapping[str, Any], model: Mapping[str, str]) -> list[Metric]:
    """Each engine's socket and replay troubles, from its subscriber's stats: socket
    errors, seq jumps, continuity mismatches, replay timeouts, held-back messages
    dropped, and the gauges of held-back bytes and of a replay outstanding."""
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
    return [*ingest.values(), held, replaying]


def apply_errors(view: ServiceView, model: Mapping[str, str]) -> list[Metric]:
    """``kvevents_apply_errors`` {engine, model_name, kind}: exceptions while applying,
    as the aggregator counted them; ``kvevents_dp_rank_mismatches`` {engine, model_name}:
    batches of another rank (:mod:`kvevents.service.apply`)."""
    fam = CounterMetricFamily(
        "kvevents_apply_errors", "Exceptions while applying batches or events",
        labels=[*ENGINE_LABELS, "kind"])
    for (engine, kind), n in list(view.apply_errors.items()):
        if engine in model:
            fam.add_metric([engine, model[engine], kind], n)
    ranks = CounterMetricFamily(
        "kvevents_dp_rank_mismatches", "Batches stamped with another data-parallel rank "
        "(data_parallel_rank, SGLang's attn_dp_rank) than the rank the engine is of its "
        "server (dp=); applied all the same", labels=ENGINE_LABELS)
    for engine, n in list(getattr(view, "rank_mismatches", {}).items()):
        if engine in model:
            ranks.add_metric([engine, model[engine]], n)
    return [fam, ranks]


def refused_events(counters: Any, model: Mapping[str, str]) -> list[Metric]:
    """``kvevents_refused_events`` {engine, model_name, reason}: events the index
    refused."""
    refused = CounterMetricFamily(
        "kvevents_refused_events", "Events the index refused (bad hashes or tokens, a "
        "namespace or tier cap reached), by reason", labels=[*ENGINE_LABELS, "reason"])
    for engine, reasons in counters.refused_events.items():
        if engine in model:
            for reason, n in reasons.items():
                refused.add_metric([engine, model[engine], reason], n)
    return [refused]


def ingest_health(view: ServiceView) -> list[Metric]:
    """The ingest loop's health and budget, unlabelled: heartbeat, watchdog restarts,
    loop errors, the engines the socket/file budget allows, and how long the loop holds
    the GIL at a time."""
    health = view.ingest_health()
    beat = GaugeMetricFamily("kvevents_ingest_heartbeat_timestamp_seconds",
                             "Wall time of the ingest loop's last iteration")
    beat.add_metric([], view.ingest_heartbeat_wall())
    restarts = CounterMetricFamily("kvevents_ingest_restarts",
                                   "Ingest thread restarts by the watchdog")
    restarts.add_metric([], health["thread_restarts"])
    loop_errors = CounterMetricFamily("kvevents_ingest_loop_errors",
                                      "Ingest loop iterations that raised (retried)")
    loop_errors.add_metric([], health["loop_errors"])
    max_engines = GaugeMetricFamily("kvevents_ingest_max_engines",
                                    "Engines the socket/file budget allows")
    max_engines.add_metric([], view.budget.max_engines)
    given_up = CounterMetricFamily("kvevents_recovery_given_up",
                                   "Engines whose first replay was not done within "
                                   "recovery_timeout_s (readiness stopped waiting for them)")
    given_up.add_metric([], health.get("recovery_given_up", 0))
    out = [beat, restarts, loop_errors, max_engines, given_up]
    meter = view.ingest_gil_holds()
    if meter is not None:
        holds = HistogramMetricFamily(
            "kvevents_ingest_gil_hold_seconds",
            "Stretches of Python the ingest thread ran between two GIL releases (an upper "
            "bound of how long it kept the event loop from the GIL)")
        cumulative, buckets = 0, []
        for bound, n in zip((*HOLD_BUCKETS, float("inf")), list(meter.counts)):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        holds.add_metric([], buckets, meter.total)
        out.append(holds)
    return out


def index_totals(counters: Any) -> list[Metric]:
    """The index's size, unlabelled: resident entries and distinct content blocks."""
    entries = GaugeMetricFamily("kvevents_index_entries",
                                "Resident (engine, tier, block) entries")
    entries.add_metric([], counters.resident_entries)
    distinct = GaugeMetricFamily("kvevents_index_distinct_blocks", "Distinct content blocks")
    distinct.add_metric([], counters.distinct_blocks)
    return [entries, distinct]
