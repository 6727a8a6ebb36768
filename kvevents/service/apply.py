"""Applying the subscriber's signals to the index (the ingest thread's half of the service).

:class:`IndexWriter` is the subscriber's consumer. Every signal of one engine arrives in
seq order on the subscriber's loop thread:

* :class:`BatchesReceived`: applied to the index as one group (one lock, one core call),
  then observed once (metrics, the feed). The engine's anchor (seq and publisher
  timestamp of the last batch applied) is recorded under :attr:`IndexWriter.lock`
  together with the apply, so a snapshot captured under the same lock always pairs an
  index state with the anchors it holds.
* The lane (:meth:`IndexWriter.lane`, the subscriber's ``lane=``): the engine's
  :class:`~kvevents.index._core.WireSink` applies its common batches straight from the
  received messages without the GIL, and records the anchor itself under the index's
  lock (a capture holds both locks). :class:`BatchesApplied` then reports them, at most
  every 0.1 s: the apply-lag histogram and the feed are fed once per report. A sink that
  failed part way is handled like a failed group (below).
* :class:`PublisherRestarted` and :class:`BatchesLost`: the engine's state is dropped
  (the index only claims blocks it can vouch for); its new announcements rebuild it.
* :class:`Resynced`: dropped likewise, after a failed apply or a continuity break.
* :class:`GapDetected`: only shown on the feed (the subscriber replays it).

The rank check: an engine that is one rank of a data-parallel server
(``EngineSpec.dp_rank``) should only get batches stamped with that rank
(``data_parallel_rank``, SGLang's ``attn_dp_rank``). One stamped with another rank is
still applied (its blocks are on whatever publishes on that stream), and counted
(:attr:`IndexWriter.rank_mismatches`, ``kvevents_dp_rank_mismatches_total``): ports that
do not follow the rank + port rule, or ranks crossed in the configuration. The lane
declines such a batch, so the Python path counts it; a batch without a rank is not
checked. Cost: one attribute read per batch, none for an engine that is not a rank.

Failure: an exception while applying a group leaves the engine's state unknown, so it
is counted by kind (:attr:`apply_errors`), the engine is dropped and rebuilt from
replay, this time event by event up to the group's last seq: one bad event costs only
itself. Nothing here raises into the subscriber.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvevents.engines import EngineRegistry
from kvevents.index import ApplyStats, PrefixIndex, WireSink
from kvevents.index.results import add_stats
from kvevents.ingest.signals import (
    BatchesApplied,
    BatchesLost,
    BatchesReceived,
    GapDetected,
    PublisherRestarted,
    Resynced,
    Signal,
)
from kvevents.service.feed import EventFeed
from kvevents.service.metrics import AggregatorMetrics
from kvevents.service.metrics.lag import LAG_BUCKETS
from kvevents.wire.schema import KVEventBatch

log = logging.getLogger(__name__)


class IndexWriter:
    """The subscriber's consumer; see the module docstring. ``resync(engine, reason)``
    asks the subscriber to rebuild an engine from replay."""

    def __init__(self, index: PrefixIndex, engines: EngineRegistry, metrics: AggregatorMetrics,
                 feed: EventFeed, resync: Callable[[str, str], None]) -> None:
        self.index = index
        self.engines = engines
        self.metrics = metrics
        self.feed = feed
        self._resync = resync
        # Held while the Python path applies a group and records its anchor, and while a
        # snapshot is captured, so a snapshot's index state and anchors always agree (the
        # lane records its anchors under the index's lock, which a capture holds too).
        self.lock = threading.Lock()
        # engine -> its sink (anchor keeper and, outside careful mode, the lane's way in).
        self._sinks: dict[str, WireSink] = {}
        # (engine, kind) -> count of exceptions while applying (kind: exception or event type).
        self.apply_errors: dict[tuple[str, str], int] = {}
        # engine -> [seq of the batch that failed, resync seen]: while set, that engine's
        # batches up to the seq are applied event by event.
        self._careful: dict[str, list] = {}
        # engine -> batches stamped with another data-parallel rank than the engine's.
        self.rank_mismatches: dict[str, int] = {}

    # -- called by the service -----------------------------------------------------------

    def resume(self, engine: str, seq: int, ts: float) -> None:
        """The engine's restored state holds its batches up to ``seq`` (stamped ``ts``)."""
        with self.lock:
            self._sink(engine).set_anchor(seq, ts)

    def _sink(self, engine: str) -> WireSink:
        sink = self._sinks.get(engine)
        if sink is None or not sink.valid:
            sink = self._sinks[engine] = self.index.sink(
                engine, self.engines.model_of(engine)[1], LAG_BUCKETS)
        return sink

    def lane(self, engine: str) -> object | None:
        """The subscriber's ``lane``: the capsule of ``engine``'s sink, refreshed, or None
        while the engine is unknown or being rebuilt event by event (careful mode). Runs
        on the ingest thread once per drain."""
        if engine in self._careful or not self.engines.model_of(engine)[0]:
            return None
        sink = self._sink(engine)
        sink.refresh()
        rank = self.engines.dp_rank_of(engine)
        sink.dp_rank = -1 if rank is None else rank  # (another rank's batch: declined)
        return sink.capsule

    def drop(self, engine: str, *, forget: bool = True) -> None:
        """Forget the engine's blocks and anchor (nothing restorable until rebuilt).
        ``forget`` (the service unsubscribed it): its counters and apply errors too, so
        engines that come and go leave nothing behind; a restart or a loss keeps them."""
        with self.lock:
            self.index.drop_engine(engine, forget=forget)  # its sink and anchor with it
            self._sinks.pop(engine, None)
            if forget:
                self._careful.pop(engine, None)
                for key in [k for k in self.apply_errors if k[0] == engine]:
                    del self.apply_errors[key]
                self.rank_mismatches.pop(engine, None)

    def capture(self) -> tuple[bytes, dict[str, tuple[int, float]]]:
        """The index state and the anchors it holds, taken together."""
        with self.lock:
            return self.index.export_state_with_anchors()

    # -- the subscriber's consumer (its loop thread) ------------------------------------

    def on_signal(self, sig: Signal) -> None:
        known, model = self.engines.model_of(sig.source)
        if not known:
            return  # removed while its last messages were in flight
        if isinstance(sig, BatchesApplied):
            self._on_applied(sig)
        elif isinstance(sig, BatchesReceived):  # our subscriber groups: no BatchReceived
            self._on_batches(sig, model)
        elif isinstance(sig, PublisherRestarted):
            self.drop(sig.source, forget=False)
            self.feed.publish("restart", {"engine": sig.source, "last_seq": sig.last_seq})
        elif isinstance(sig, BatchesLost):
            self.drop(sig.source, forget=False)
            self.engines.count_resync(sig.source)
            log.warning("engine %s: %d batches lost from seq %d (%s); its state was dropped",
                        sig.source, sig.count, sig.first_seq, sig.reason)
            self.feed.publish("loss", {"engine": sig.source, "first_seq": sig.first_seq,
                                       "count": sig.count, "reason": sig.reason})
        elif isinstance(sig, Resynced):
            self.index.drop_engine(sig.source)
            self._sinks.pop(sig.source, None)
            careful = self._careful.get(sig.source)
            if careful is not None:
                careful[1] = True
            self.engines.count_resync(sig.source)
            self.feed.publish("resync", {"engine": sig.source, "reason": sig.reason})
        elif isinstance(sig, GapDetected):
            self.feed.publish("gap", {"engine": sig.source, "expected": sig.expected_seq,
                                      "received": sig.received_seq})

    def _on_applied(self, sig: BatchesApplied) -> None:
        """What the engine's sink applied through the lane: observed (lag, feed); a
        failure handled like a failed group."""
        sink = self._sinks.get(sig.source)
        if sink is None:
            return
        stored, removed, cleared, lag_counts, lag_sum = sink.take_report()
        self.metrics.observe_lane_lags(sig.source, lag_counts, lag_sum)
        self.feed.publish("batch", {
            "engine": sig.source, "seq": sig.last_seq, "batches": sig.count,
            "replayed": False, "stored": stored, "removed": removed, "cleared": cleared,
        })
        if sig.failed:
            exc = sink.take_error()
            self._failed(sig.source, sig.last_seq, sig.last_seq, exc)

    def _failed(self, engine: str, first: int, last: int, exc: BaseException | None) -> None:
        """Applying batches ``first``..``last`` failed part way: the engine's state is
        unknown. Count it, rebuild the engine event by event up to ``last``."""
        kind = type(exc).__name__ if exc is not None else "unknown"
        self._count_apply_error(engine, kind)
        log.warning("engine %s: applying batches seq %d-%d failed (%s: %s); rebuilding the "
                    "engine event by event", engine, first, last, kind, exc)
        self._careful[engine] = [last, False]
        self._resync(engine, f"apply failed at seq {first}-{last}")

    def _check_ranks(self, engine: str, batches: list) -> None:
        """Count ``batches`` stamped with another data-parallel rank than ``engine``'s
        (see the module docstring)."""
        rank = self.engines.dp_rank_of(engine)
        if rank is None:
            return
        other = [b.data_parallel_rank for b in batches
                 if b.data_parallel_rank is not None and b.data_parallel_rank != rank]
        if other:
            if engine not in self.rank_mismatches:
                log.warning("engine %s is data-parallel rank %d, but its stream carries batches "
                            "of rank %s: are its ports rank + port? (counted in "
                            "kvevents_dp_rank_mismatches_total)", engine, rank, other[0])
            self.rank_mismatches[engine] = self.rank_mismatches.get(engine, 0) + len(other)

    def _on_batches(self, sig: BatchesReceived, model: str | None) -> None:
        """Consecutive batches of one engine: applied, then observed, as one."""
        self._check_ranks(sig.source, sig.batches)
        with self.lock:
            applied = self._apply_group(sig, model)
            if applied is not None:
                self._sink(sig.source).set_anchor(sig.seqs[-1], sig.batches[-1].ts)
        if applied is None:
            return
        self.metrics.observe_batches(sig.source, sig.batches)
        self.feed.publish("batch", {
            "engine": sig.source, "seq": sig.seqs[-1], "batches": len(sig.seqs),
            "replayed": sig.replayed, "stored": applied.stored_blocks,
            "removed": applied.removed_blocks, "cleared": applied.cleared,
        })

    def _apply_group(self, sig: BatchesReceived, model: str | None) -> ApplyStats | None:
        """Apply a group of consecutive batches; never raises. Returns the stats, or None
        when the group was not applied as a whole (see the module docstring). Past the
        failed group's last seq, batches apply whole again."""
        careful = self._careful.get(sig.source)
        seqs, batches = sig.seqs, sig.batches
        rebuilt = None
        if careful is not None and careful[1]:  # rebuilding, after the resync
            upto = careful[0]
            rebuilt = ApplyStats()
            for seq, batch in zip(seqs, batches):
                if seq <= upto:
                    rebuilt = add_stats(rebuilt, self._apply_each(sig.source, batch, model))
            seqs = [q for q in seqs if q > upto]
            batches = batches[len(batches) - len(seqs):]
            if not seqs:
                return rebuilt
            del self._careful[sig.source]  # rebuilt past the failure: back to batches
        try:
            stats = self.index.apply_batches(sig.source, batches, model=model)
        except Exception as exc:
            self._failed(sig.source, seqs[0], seqs[-1], exc)
            return None
        if rebuilt is not None:
            stats = add_stats(stats, rebuilt)
        return stats

    def _count_apply_error(self, engine: str, kind: str) -> None:
        key = (engine, kind)
        self.apply_errors[key] = self.apply_errors.get(key, 0) + 1

    def _apply_each(self, engine: str, batch: KVEventBatch, model: str | None) -> ApplyStats:
        """The slow, isolating path (only while rebuilding after a failure)."""
        total = ApplyStats()
        ts, rank = batch.ts, batch.data_parallel_rank
        for ev in batch.events:
            one = KVEventBatch(ts, [ev], rank)
            try:
                st = self.index.apply_batch(engine, one, model=model)
            except Exception:
                self._count_apply_error(engine, type(ev).__name__)
                continue
            total = add_stats(total, st)
        return total
