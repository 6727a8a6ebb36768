"""Prometheus metrics of the aggregator (prefix ``kvevents_``).

Metrics are objects bound to a registry passed in, never import-time globals (two
aggregators in one process must not collide). Counters that mirror live state (the
subscriber's and the index's) are built from a :class:`~kvevents.service.view.ServiceView`
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

Modules: :mod:`.collector` (the state families, one function per family group),
:mod:`.lag` (the event-lag histogram), :mod:`.lookups` (the lookup metrics);
:class:`AggregatorMetrics` here ties them to one registry.

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
kvevents_dp_rank_mismatches_total           batches of another data-parallel rank than the engine's {engine, ...}
kvevents_ingest_heartbeat_timestamp_seconds wall time of the ingest loop's last iteration
kvevents_ingest_restarts_total              ingest thread restarts by the watchdog
kvevents_ingest_loop_errors_total           ingest loop iterations that raised (retried)
kvevents_ingest_max_engines                 engines the socket/file budget allows
kvevents_ingest_gil_hold_seconds            histogram: ingest thread's Python stretches between GIL releases
kvevents_recovery_given_up_total            engines readiness stopped waiting for (recovery_timeout_s)
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

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from kvevents.service.metrics.collector import ENGINE_LABELS, StateCollector
from kvevents.service.metrics.lag import LagHistogram
from kvevents.service.metrics.lookups import LookupMetrics
from kvevents.service.view import ServiceView

if TYPE_CHECKING:
    from kvevents.index import LookupResult
    from kvevents.wire.schema import KVEventBatch

__all__ = ["ENGINE_LABELS", "AggregatorMetrics"]


class AggregatorMetrics:
    """Creates and registers the aggregator's metrics on ``registry``; reads live
    state through ``view`` at scrape time."""

    def __init__(self, view: ServiceView, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._view = view
        # Registration order is scrape order: lag, the lookup metrics, the state families.
        self.event_lag = LagHistogram()
        registry.register(self.event_lag)
        self._lookup = LookupMetrics(view, registry)
        registry.register(StateCollector(view))

    @property
    def totals(self) -> dict[str, float]:
        """Lookups, prompt and matched tokens so far (the live page's)."""
        return self._lookup.totals

    @property
    def tier_totals(self) -> dict[str, float]:
        """Matched tokens per tier so far."""
        return self._lookup.tier_totals

    def _model_of(self, engine: str) -> str:
        for spec in self._view.engine_specs():
            if spec.name == engine:
                return spec.model or ""
        return ""

    def observe_batches(self, engine: str, batches: list[KVEventBatch]) -> None:
        """The lag of each of ``batches`` (applied just now), in one call."""
        self.event_lag.observe(engine, self._model_of, time.time(), batches)

    def observe_lane_lags(self, engine: str, counts: list[int], total: float) -> None:
        """Lags the lane's sink observed (per bucket of ``LAG_BUCKETS``, and their sum)."""
        self.event_lag.merge(engine, self._model_of, counts, total)

    def observe_lookup(self, api: str, seconds: float, result: LookupResult,
                       model: str | None = None) -> None:
        """One lookup served by ``api``: its latency, prompt and matched tokens."""
        self._lookup.observe(api, seconds, result, model)

    def forget_engine(self, engine: str) -> None:
        """Drop a removed engine's histogram series (the state families drop it by
        themselves: they are built from the engines followed now)."""
        self.event_lag.forget(engine)
