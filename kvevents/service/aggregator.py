"""The aggregator: follows publishers, keeps the prefix index, answers queries.

Ownership and threads:

* :class:`Aggregator` owns a :class:`~kvevents.ingest.subscriber.Subscriber` (one thread that
  owns every ZeroMQ socket), the :class:`~kvevents.index.PrefixIndex`, the engine registry
  and the :class:`~kvevents.service.feed.EventFeed`.
* Ingest runs on the subscriber thread, off the HTTP event loop: each batch is applied
  to the index in per-publisher seq order as the subscriber delivers it (the index takes
  its own lock, so lookups from HTTP threads see whole batches).
* The subscriber's signals are applied and counted: a restart drops the engine's state
  before its new batches; a loss that replay could not fill is counted and drops the
  engine's state too (the index only claims blocks it can vouch for), after which the
  engine's new announcements rebuild it.
* Ingest is supervised (issue 11): an exception while applying a batch is counted by
  kind and the engine is rebuilt from replay with each event applied on its own, so one bad
  event costs only itself; the loop's heartbeat and restarts feed ``/healthz``; the engine
  count is bounded by the socket/file budget planned at start
  (:mod:`kvevents.ingest.budget`).

* Durable restarts (``data_dir``): the index and each engine's last applied (seq, ts) are
  captured together under ``_apply_lock`` and written by :mod:`kvevents.service.snapshot`
  every ``snapshot_interval_s`` and on ``stop()``. The constructor restores the newest
  whole snapshot (or a peer's, ``bootstrap_from``), checks each engine's continuity and
  resumes it at the next seq, or drops that engine's restored state (counted).
* A housekeeping thread records since when each engine is disconnected: an engine down for
  ``down_after_s`` is not offered for routing (:meth:`unroutable_engines`).

Lifecycle: ``Aggregator(settings)`` -> ``start()`` -> queries / ``add_engine`` /
``remove_engine`` from any thread -> ``stop()``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry

from kvevents.service import snapshot
from kvevents.service.feed import EventFeed
from kvevents.ingest import ratelog
from kvevents.ingest.budget import Budget, make_context, plan_budget
from kvevents.index import ApplyStats, IngestDecoder, LookupResult, PrefixIndex
from kvevents.index.results import add_stats
from kvevents.service.metrics import AggregatorMetrics
from kvevents.routing.policies import KVAwarePolicy
from kvevents.wire.schema import KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec
from kvevents.ingest.subscriber import (
    BatchesLost,
    BatchesReceived,
    GapDetected,
    PublisherRestarted,
    Resynced,
    Signal,
    SourceConfig,
    SourceStats,
    Subscriber,
)

log = logging.getLogger(__name__)


class EngineExistsError(ValueError):
    pass


class EngineBudgetError(ValueError):
    """More engines than the socket/file budget allows (see :mod:`kvevents.ingest.budget`)."""


@dataclass
class EngineState:
    spec: EngineSpec
    added_at: float
    resyncs: int = 0  # times its state was dropped after a loss
    restore: str | None = None  # continuity outcome when restored from a snapshot
    down_since: float | None = None  # monotonic time it was last seen disconnected


class Aggregator:
    """See the module docstring."""

    def __init__(
        self, settings: AggregatorSettings, registry: CollectorRegistry | None = None
    ) -> None:
        self.settings = settings
        self.index = PrefixIndex()
        self.feed = EventFeed(settings.event_feed_size)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AggregatorMetrics(self, self.registry)
        self.router = KVAwarePolicy()
        self._engines: dict[str, EngineState] = {}
        self._engines_lock = threading.Lock()
        self.budget: Budget = plan_budget(settings.max_engines)
        if len(settings.engines) > self.budget.max_engines:
            raise EngineBudgetError(
                f"{len(settings.engines)} engines configured but the socket budget allows "
                f"{self.budget.max_engines} (open-file limit {self.budget.nofile_soft}, hard "
                f"{self.budget.nofile_hard}; max_engines {settings.max_engines}): raise the hard "
                "open-file limit (ulimit -Hn) or follow fewer engines")
        self._zmq = make_context(self.budget)
        self._subscriber = Subscriber(
            self._on_signal, replay_timeout=settings.replay_timeout_s,
            replay_deadline=settings.replay_deadline_s, seq_window=settings.seq_window,
            max_pending_bytes=settings.max_pending_bytes, recv_hwm=settings.recv_hwm,
            context=self._zmq,
            decoder=IngestDecoder(),  # common batches stay bytes: the index reads them in place
            group_batches=True,  # one lock, core call, metric and feed item per drain
        )
        # (engine, kind) -> count of exceptions while applying (kind: exception or event type).
        self.apply_errors: dict[tuple[str, str], int] = {}
        # engine -> [seq of the batch that failed, resync seen]: while set, that engine's
        # batches up to the seq are applied event by event.
        self._careful: dict[str, list] = {}
        self._started = False
        self.started_at = time.time()
        # Held while a batch is applied and its anchor recorded, and while a snapshot
        # is captured, so a snapshot's index state and anchors always agree.
        self._apply_lock = threading.Lock()
        self._anchors: dict[str, tuple[int, float]] = {}  # engine -> (seq, ts) last applied
        self.snapshot_stats = {"written": 0, "errors": 0, "restored_engines": 0,
                               "dropped_engines": 0, "last_write_s": None}
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None
        resume = snapshot.restore(self.index, settings, self.snapshot_stats)
        for spec in settings.engines:
            self.add_engine(spec, resume=resume.pop(spec.name, None))
        for pair in resume.values():  # engines added at run time before the restart
            self.add_engine(pair[0], resume=pair)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        # Floods (idle TCP connections at the file limit, garbage publishers) must not
        # become megabytes of repeated log lines.
        ratelog.install()
        self._subscriber.start()
        self._housekeeper = threading.Thread(target=self._housekeeping, daemon=True,
                                             name="kvevents-housekeeping")
        self._housekeeper.start()
        self._started = True

    def stop(self) -> None:
        self._started = False
        self._stop.set()
        if self._housekeeper is not None:
            self._housekeeper.join(5)
        if self._subscriber.stop():  # every socket closed: release the context's threads
            self._zmq.destroy(linger=0)
        if self.settings.data_dir:
            self.save_snapshot()  # the final one: nothing applied after it

    # -- snapshots ---------------------------------------------------------------------

    def capture_snapshot(self) -> bytes:
        """The encoded snapshot of now (index + anchors agree)."""
        with self._engines_lock:
            specs = {name: asdict(p.spec) for name, p in self._engines.items()}
        with self._apply_lock:
            state = self.index.export_state()
            anchors = dict(self._anchors)
        engines = {name: snapshot.EngineAnchor(spec, *anchors.get(name, (None, None)))
                   for name, spec in specs.items()}
        return snapshot.encode(snapshot.Snapshot(time.time(), engines, state))

    def save_snapshot(self) -> bool:
        """Write a snapshot to ``data_dir``; False (logged, counted) if it failed."""
        t0 = time.perf_counter()
        try:
            snapshot.write(self.settings.data_dir, self.capture_snapshot())
        except Exception:  # a full disk must not end ingest or the housekeeping loop
            self.snapshot_stats["errors"] += 1
            log.exception("snapshot to %s failed", self.settings.data_dir)
            return False
        self.snapshot_stats["written"] += 1
        self.snapshot_stats["last_write_s"] = time.perf_counter() - t0
        return True

    # -- housekeeping ------------------------------------------------------------------

    _TICK_S = 0.25

    def _housekeeping(self) -> None:
        """Down-engine clocks and periodic snapshots; survives its own errors."""
        next_snapshot = time.monotonic() + self.settings.snapshot_interval_s
        while not self._stop.wait(self._TICK_S):
            try:
                self._track_down()
                if self.settings.data_dir and time.monotonic() >= next_snapshot:
                    self.save_snapshot()
                    next_snapshot = time.monotonic() + self.settings.snapshot_interval_s
            except Exception:
                log.exception("housekeeping failed; continuing")

    def _track_down(self) -> None:
        stats = self._subscriber.stats()
        now = time.monotonic()
        with self._engines_lock:
            for name, state in self._engines.items():
                st = stats.get(name)
                if st is not None and st.connected > 0:
                    state.down_since = None
                elif state.down_since is None:
                    state.down_since = now

    def unroutable_engines(self) -> set[str]:
        """Engines disconnected for at least ``down_after_s``: their blocks are not
        offered for routing (they stay in the index and in lookups)."""
        limit = time.monotonic() - self.settings.down_after_s
        with self._engines_lock:
            return {name for name, p in self._engines.items()
                    if p.down_since is not None and p.down_since <= limit}

    # -- health ------------------------------------------------------------------------

    def ingest_health(self) -> dict:
        """``ok`` False with a ``reason`` when ingest is not running or stuck (its
        loop's heartbeat older than ``ingest_stuck_after_s`` while engines are followed;
        the loop beats every 50 ms even when idle)."""
        sub = self._subscriber
        age = time.monotonic() - sub.heartbeat
        out = {"ok": True, "reason": None, "heartbeat_age_seconds": round(age, 3),
               "loop_errors": sub.loop_errors, "thread_restarts": sub.thread_restarts}
        if not self._started or not sub.running():
            out.update(ok=False, reason="ingest is not running")
        elif age > self.settings.ingest_stuck_after_s and self._engines:
            out.update(ok=False, reason=f"ingest stuck: no loop heartbeat for {age:.1f}s")
        return out

    def engine_counts(self) -> tuple[int, int]:
        """(engines, live engines) without touching the index: health must answer even
        while ingest holds the index lock."""
        stats = self._subscriber.stats()
        now = time.time()
        names = self._engine_names()
        live = sum(1 for n in names
                   if n in stats and not stats[n].replaying and self._status(stats[n], now) == "live")
        return len(names), live

    def ingest_heartbeat_wall(self) -> float:
        """Wall-clock time of the ingest loop's last sign of life."""
        return time.time() - (time.monotonic() - self._subscriber.heartbeat)

    def readiness(self) -> dict:
        """Ready when every followed engine finished its initial replay from seq 0 (an engine
        without a replay endpoint has none to wait for; one whose publisher is down
        keeps the aggregator not ready, listed in ``waiting``)."""
        stats = self._subscriber.stats()
        waiting = sorted(name for name in self._engine_names()
                         if not (stats.get(name) and stats[name].initial_replay_done))
        return {"ready": not waiting and self._started, "waiting": waiting}

    def _engine_names(self) -> list[str]:
        with self._engines_lock:
            return list(self._engines)

    # -- engines ------------------------------------------------------------------------

    def add_engine(self, spec: EngineSpec,
                   resume: tuple[EngineSpec, snapshot.EngineAnchor] | None = None) -> None:
        """Follow a new publisher. Raises :class:`EngineExistsError` for a taken name.
        ``resume``: its state was restored up to the anchor; continue after it."""
        with self._engines_lock:
            if spec.name in self._engines:
                raise EngineExistsError(f"engine {spec.name!r} already exists")
            if len(self._engines) >= self.budget.max_engines:
                raise EngineBudgetError(
                    f"the socket budget allows {self.budget.max_engines} engines and all are in "
                    "use: remove one, or raise the open-file limit or max_engines")
            self._engines[spec.name] = EngineState(spec, time.time(), down_since=time.monotonic())
        anchor = resume[1] if resume else None
        if anchor is not None:
            with self._apply_lock:
                self._anchors[spec.name] = (anchor.last_seq, anchor.last_ts)
            self._engines[spec.name].restore = "resumed"
        self._subscriber.add_source(
            SourceConfig(
                spec.name, spec.endpoint, replay_endpoint=spec.replay_endpoint,
                topic=spec.topic, bind=spec.bind,
                resume_seq=None if anchor is None else anchor.last_seq + 1,
                resume_ts=None if anchor is None else anchor.last_ts,
            )
        )
        self.feed.publish("engine_added", {"engine": spec.name, "endpoint": spec.endpoint})

    def remove_engine(self, name: str) -> None:
        """Unsubscribe and drop the engine's state. Raises ``KeyError`` if unknown."""
        with self._engines_lock:
            if name not in self._engines:
                raise KeyError(name)
            del self._engines[name]
        self._subscriber.remove_source(name)
        with self._apply_lock:
            self.index.drop_engine(name)
            self._anchors.pop(name, None)
        self.metrics.forget_engine(name)
        self.feed.publish("engine_removed", {"engine": name})

    def engine_specs(self) -> list[EngineSpec]:
        with self._engines_lock:
            return [p.spec for p in self._engines.values()]

    def source_stats(self) -> dict[str, SourceStats]:
        return self._subscriber.stats()

    def engine_statuses(self) -> list[dict]:
        """One entry per engine, as ``GET /v1/engines`` shows it."""
        stats = self._subscriber.stats()
        now = time.time()
        out = []
        with self._engines_lock:
            engines = list(self._engines.values())
        for state in engines:
            spec = state.spec
            st = stats.get(spec.name) or SourceStats()
            out.append({
                "name": spec.name,
                "endpoint": spec.endpoint,
                "replay_endpoint": spec.replay_endpoint,
                "model": spec.model,
                "status": "replaying" if st.replaying else self._status(st, now),
                "replay_gap": ({"from_seq": st.replay_from, "held_from_seq": st.replay_until,
                                "held_bytes": st.pending_bytes} if st.replaying else None),
                "connected": st.connected > 0,
                "last_seq": st.last_seq,
                "lag_seconds": None if st.last_batch_ts is None else max(0.0, now - st.last_batch_ts),
                "last_event_age_seconds": None if st.last_received is None else now - st.last_received,
                "blocks": self.index.engine_block_counts(spec.name),
                "batches": st.batches,
                "gaps": st.gaps,
                "replayed_batches": st.replayed_batches,
                "lost_batches": st.lost_batches,
                "restarts": st.restarts,
                "resyncs": state.resyncs,
                "malformed": st.malformed_frames + st.decode_errors,
                "routable": not (state.down_since is not None
                                 and time.monotonic() - state.down_since >= self.settings.down_after_s),
                "restore": state.restore,
            })
        return out

    def down_engines(self) -> set[str]:
        """Engines with no connection to their publisher now (no index access: cheap
        enough for the event loop)."""
        stats = self._subscriber.stats()
        with self._engines_lock:
            names = list(self._engines)
        return {n for n in names if (stats.get(n) or SourceStats()).connected <= 0}

    def _status(self, st: SourceStats, now: float) -> str:
        """live: a message within ``stale_after_s``; stale: connected (or never heard
        from yet) but silent; down: no connection to the publisher."""
        if st.connected <= 0:
            return "down"
        if st.last_received is not None and now - st.last_received <= self.settings.stale_after_s:
            return "live"
        return "stale"

    # -- queries ---------------------------------------------------------------------

    def lookup(
        self, token_ids: list[int], model: str | None = None, lora_name: str | None = None,
        *, endpoint: str = "lookup", blocking: bool = True, timeout: float = -1,
    ) -> LookupResult:
        """Index lookup, timed into the metrics. ``blocking=False`` raises
        :class:`~kvevents.index.IndexBusy` instead of waiting for the index lock, and so
        does a ``timeout`` (seconds) that passes before the lock is free."""
        t0 = time.perf_counter()
        result = self.index.lookup(token_ids, model=model, lora_name=lora_name,
                                   blocking=blocking, timeout=timeout)
        self.metrics.observe_lookup(endpoint, time.perf_counter() - t0, result, model)
        return result

    # -- ingest (subscriber thread) -----------------------------------------------------

    def _model_of(self, engine: str) -> tuple[bool, str | None]:
        state = self._engines.get(engine)
        return (state is not None, state.spec.model if state else None)

    def _on_signal(self, sig: Signal) -> None:
        known, model = self._model_of(sig.source)
        if not known:
            return  # removed while its last messages were in flight
        if isinstance(sig, BatchesReceived):  # our subscriber groups: no BatchReceived
            self._on_batches(sig, model)
        elif isinstance(sig, PublisherRestarted):
            with self._apply_lock:
                self.index.drop_engine(sig.source)
                self._anchors.pop(sig.source, None)
            self.feed.publish("restart", {"engine": sig.source, "last_seq": sig.last_seq})
        elif isinstance(sig, BatchesLost):
            with self._apply_lock:
                self.index.drop_engine(sig.source)
                self._anchors.pop(sig.source, None)  # nothing restorable until rebuilt
            with self._engines_lock:
                state = self._engines.get(sig.source)
                if state is not None:
                    state.resyncs += 1
            log.warning("engine %s: %d batches lost from seq %d (%s); its state was dropped",
                        sig.source, sig.count, sig.first_seq, sig.reason)
            self.feed.publish("loss", {"engine": sig.source, "first_seq": sig.first_seq,
                                       "count": sig.count, "reason": sig.reason})
        elif isinstance(sig, Resynced):
            self.index.drop_engine(sig.source)
            careful = self._careful.get(sig.source)
            if careful is not None:
                careful[1] = True
            with self._engines_lock:
                state = self._engines.get(sig.source)
                if state is not None:
                    state.resyncs += 1
            self.feed.publish("resync", {"engine": sig.source, "reason": sig.reason})
        elif isinstance(sig, GapDetected):
            self.feed.publish("gap", {"engine": sig.source, "expected": sig.expected_seq,
                                      "received": sig.received_seq})

    def _on_batches(self, sig: BatchesReceived, model: str | None) -> None:
        """Consecutive batches of one engine: applied, then observed, as one."""
        with self._apply_lock:
            applied = self._apply_group(sig, model)
            if applied is not None:
                self._anchors[sig.source] = (sig.seqs[-1], sig.batches[-1].ts)
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
        when the group was not applied as a whole.

        A group that raises leaves the engine's state unknown (part of it may be
        applied), so the engine is dropped and rebuilt from replay, this time event by
        event up to the group's last seq (which batch failed is not known): a bad event
        is counted by its kind and skipped, the rest of its batch applies. Past that seq
        batches apply whole again."""
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
            self._count_apply_error(sig.source, type(exc).__name__)
            log.warning("engine %s: applying batches seq %d-%d failed (%s: %s); rebuilding the "
                        "engine event by event", sig.source, seqs[0], seqs[-1],
                        type(exc).__name__, exc)
            self._careful[sig.source] = [seqs[-1], False]
            self._subscriber.resync(sig.source, f"apply failed at seq {seqs[0]}-{seqs[-1]}")
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
