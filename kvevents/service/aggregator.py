"""The aggregator: follows publishers, keeps the prefix index, answers queries.

Ownership and threads:

* :class:`Aggregator` owns a :class:`~kvevents.ingest.subscriber.Subscriber` (one thread that
  owns every ZeroMQ socket), the :class:`~kvevents.index.PrefixIndex`, the
  :class:`~kvevents.engines.EngineRegistry` of followed engines, the
  :class:`~kvevents.service.apply.IndexWriter` that applies the subscriber's signals,
  and the :class:`~kvevents.service.feed.EventFeed`.
* Ingest runs on the subscriber thread, off the HTTP event loop: each batch is applied
  to the index in per-publisher seq order as the subscriber delivers it (the index takes
  its own lock, so lookups from HTTP threads see whole batches).
* The subscriber's signals are applied and counted by :mod:`kvevents.service.apply`
  (restarts and losses drop an engine's state; a failed apply rebuilds it event by
  event). The loop's heartbeat and restarts feed ``/healthz``; the engine count is
  bounded by the socket/file budget planned at start (:mod:`kvevents.ingest.budget`).
* Engines come from the settings (origin ``static``), ``POST /v1/engines`` (``api``)
  or a discovery source, which hands over its whole desired set: :meth:`reconcile`
  adds, removes and replaces only the engines of that origin.

* Durable restarts (``data_dir``): the index and each engine's last applied (seq, ts) are
  captured together under the writer's lock and written by :mod:`kvevents.service.snapshot`
  every ``snapshot_interval_s`` and on ``stop()``. The constructor restores the newest
  whole snapshot (or a peer's, ``bootstrap_from``), checks each engine's continuity and
  resumes it at the next seq, or drops that engine's restored state (counted).
* A housekeeping thread records since when each engine is disconnected: an engine down for
  ``down_after_s`` is not offered for routing (:meth:`unroutable_engines`), nor is one
  whose discovery source no longer lists it (*leaving*, during its grace period). It
  also gives up on engines whose first replay is ``recovery_timeout_s`` overdue:
  readiness stops waiting for them (counted, logged, on ``GET /v1/engines``), so one
  dead engine never keeps a replica out of service; they are still followed.

Lifecycle: ``Aggregator(settings)`` -> ``start()`` -> queries / ``add_engine`` /
``remove_engine`` / ``reconcile`` from any thread -> ``stop()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict

from prometheus_client import CollectorRegistry

from kvevents.engines import EngineBudgetError, EngineExistsError, EngineRegistry, EngineSpec
from kvevents.index import IngestDecoder, LookupResult, MediaItem, PrefixIndex
from kvevents.ingest import ratelog
from kvevents.ingest.budget import Budget, make_context, plan_budget
from kvevents.ingest.gilmeter import HoldMeter
from kvevents.ingest.subscriber import SourceStats, Subscriber
from kvevents.service import snapshot
from kvevents.service.apply import IndexWriter
from kvevents.service.feed import EventFeed
from kvevents.service.metrics import AggregatorMetrics
from kvevents.service.settings import AggregatorSettings

log = logging.getLogger(__name__)

__all__ = ["Aggregator", "EngineBudgetError", "EngineExistsError"]


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
        self.budget: Budget = plan_budget(settings.max_engines)
        if len(settings.engines) > self.budget.max_engines:
            raise EngineBudgetError(
                f"{len(settings.engines)} engines configured but the socket budget allows "
                f"{self.budget.max_engines} (open-file limit {self.budget.nofile_soft}, hard "
                f"{self.budget.nofile_hard}; max_engines {settings.max_engines}): raise the hard "
                "open-file limit (ulimit -Hn) or follow fewer engines")
        self.engines = EngineRegistry(self.budget.max_engines, down_after_s=settings.down_after_s,
                                      stale_after_s=settings.stale_after_s)
        self._zmq = make_context(self.budget)
        # The writer asks the subscriber (made next) to rebuild an engine after a failed apply.
        self.writer = IndexWriter(self.index, self.engines, self.metrics, self.feed,
                                  lambda engine, why: self._subscriber.resync(engine, why))
        self._subscriber = Subscriber(
            self.writer.on_signal, replay_timeout=settings.replay_timeout_s,
            replay_deadline=settings.replay_deadline_s, seq_window=settings.seq_window,
            max_pending_bytes=settings.max_pending_bytes, recv_hwm=settings.recv_hwm,
            context=self._zmq,
            decoder=IngestDecoder(),  # common batches stay bytes: the index reads them in place
            group_batches=True,  # one lock, core call, metric and feed item per drain
            # In-order common batches applied without the GIL (settings.ingest_lane).
            lane=self.writer.lane if settings.ingest_lane else None,
        )
        self._started = False
        self.started_at = time.time()
        self.snapshot_stats = {"written": 0, "errors": 0, "restored_engines": 0,
                               "dropped_engines": 0, "last_write_s": None}
        self._stop = threading.Event()
        self._housekeeper: threading.Thread | None = None
        self.recovery_given_up = 0
        resume = snapshot.restore(self.index, settings, self.snapshot_stats)
        for spec in settings.engines:
            self.add_engine(spec, resume=resume.pop(spec.name, None))
        for pair in resume.values():
            # Added at run time (``api``) or found by a discovery source before the restart
            # (or by the peer bootstrapped from): that source reconciles them again.
            origin = pair[1].origin if pair[1].origin != "static" else "api"
            self.add_engine(pair[0], resume=pair, origin=origin)

    @property
    def apply_errors(self) -> dict[tuple[str, str], int]:
        """Exceptions while applying, by (engine, kind)."""
        return self.writer.apply_errors

    @property
    def rank_mismatches(self) -> dict[str, int]:
        """Batches of another data-parallel rank than the engine's, by engine."""
        return self.writer.rank_mismatches

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
        origins = {st.spec.name: (asdict(st.spec), st.origin) for st in self.engines.states()}
        state, anchors = self.writer.capture()
        engines = {name: snapshot.EngineAnchor(spec, *anchors.get(name, (None, None)), origin)
                   for name, (spec, origin) in origins.items()}
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
                stats = self._subscriber.stats()
                self.engines.track_down(stats)
                self._give_up_overdue(stats)
                if self.settings.data_dir and time.monotonic() >= next_snapshot:
                    self.save_snapshot()
                    next_snapshot = time.monotonic() + self.settings.snapshot_interval_s
            except Exception:
                log.exception("housekeeping failed; continuing")

    def _give_up_overdue(self, stats: dict[str, SourceStats]) -> None:
        for name in self.engines.give_up_overdue(stats, self.settings.recovery_timeout_s):
            self.recovery_given_up += 1
            log.warning("engine %s: no first contact within %.0fs (recovery_timeout_s); "
                        "readiness no longer waits for it, still following it",
                        name, self.settings.recovery_timeout_s)
            self.feed.publish("engine_given_up", {"engine": name})

    # -- health ------------------------------------------------------------------------

    def ingest_gil_holds(self) -> HoldMeter:
        """The ingest thread's stretches between GIL releases (see kvevents.ingest.gilmeter)."""
        return self._subscriber.gil_holds

    def ingest_health(self) -> dict:
        """``ok`` False with a ``reason`` when ingest is not running or stuck (its
        loop's heartbeat older than ``ingest_stuck_after_s`` while engines are followed;
        the loop beats every 50 ms even when idle)."""
        sub = self._subscriber
        age = time.monotonic() - sub.heartbeat
        out = {"ok": True, "reason": None, "heartbeat_age_seconds": round(age, 3),
               "loop_errors": sub.loop_errors, "thread_restarts": sub.thread_restarts,
               "recovery_given_up": self.recovery_given_up,
               "gil_hold_longest_seconds": round(sub.gil_holds.longest, 6)}
        if not self._started or not sub.running():
            out.update(ok=False, reason="ingest is not running")
        elif age > self.settings.ingest_stuck_after_s and len(self.engines):
            out.update(ok=False, reason=f"ingest stuck: no loop heartbeat for {age:.1f}s")
        return out

    def engine_counts(self) -> tuple[int, int]:
        """(engines, live engines) without touching the index: health must answer even
        while ingest holds the index lock."""
        stats = self._subscriber.stats()
        now = time.time()
        names = self.engines.names()
        live = sum(1 for n in names if n in stats and not stats[n].replaying
                   and self.engines.status(stats[n], now) == "live")
        return len(names), live

    def ingest_heartbeat_wall(self) -> float:
        """Wall-clock time of the ingest loop's last sign of life."""
        return time.time() - (time.monotonic() - self._subscriber.heartbeat)

    def readiness(self) -> dict:
        """Ready when every followed engine finished its initial replay from seq 0 (an engine
        without a replay endpoint has none to wait for; one whose publisher is down
        keeps the aggregator not ready, listed in ``waiting``, until ``recovery_timeout_s``
        gives up on it: then it is listed in ``given_up`` instead)."""
        stats = self._subscriber.stats()
        waiting, given_up = [], []
        for state in self.engines.states():
            name = state.spec.name
            if stats.get(name) and stats[name].initial_replay_done:
                continue
            (given_up if state.given_up else waiting).append(name)
        return {"ready": not waiting and self._started, "waiting": sorted(waiting),
                "given_up": sorted(given_up)}

    # -- engines ------------------------------------------------------------------------

    def add_engine(self, spec: EngineSpec,
                   resume: tuple[EngineSpec, snapshot.EngineAnchor] | None = None,
                   *, origin: str = "static") -> None:
        """Follow a new publisher. Raises :class:`EngineExistsError` for a taken name,
        :class:`EngineBudgetError` past the budget. ``resume``: its state was restored
        up to the anchor; continue after it. ``origin``: who asked (see :meth:`reconcile`)."""
        self.engines.add(spec, origin=origin)
        anchor = resume[1] if resume else None
        if anchor is not None:
            self.writer.resume(spec.name, anchor.last_seq, anchor.last_ts)
            self.engines.set_restore(spec.name, "resumed")
            self._subscriber.add_source(spec.source(anchor.last_seq + 1, anchor.last_ts))
        else:
            self._subscriber.add_source(spec.source())
        self.feed.publish("engine_added", {"engine": spec.name, "endpoint": spec.endpoint})

    def remove_engine(self, name: str) -> None:
        """Unsubscribe and drop the engine's state. Raises ``KeyError`` if unknown."""
        self.engines.remove(name)
        # Dropped now, and again once the subscriber has closed its sockets: batches it
        # delivered meanwhile (the name may be followed again at once, under a new spec)
        # must not be merged into the next engine of that name, nor outlive it.
        self._subscriber.remove_source(name, then=lambda: self._forget(name))
        self._forget(name)
        self.feed.publish("engine_removed", {"engine": name})

    def _forget(self, name: str) -> None:
        self.writer.drop(name)
        self.metrics.forget_engine(name)

    def reconcile(self, desired: Iterable[EngineSpec], origin: str) -> tuple[list[str], list[str]]:
        """Make the engines of ``origin`` equal ``desired``: follow the new ones, drop the
        vanished ones, and re-follow those whose spec changed (their state is dropped).
        Engines of other origins are left alone. Returns (added, removed) names; an engine
        the budget cannot take is logged and left out (the next call tries again)."""
        plan = self.engines.plan(desired, origin)
        removed = []
        for name in plan.remove:
            try:
                self.remove_engine(name)
                removed.append(name)
            except KeyError:
                pass  # removed meanwhile by someone else
        added = []
        for spec in plan.add:
            try:
                self.add_engine(spec, origin=origin)
                added.append(spec.name)
            except (EngineExistsError, EngineBudgetError) as exc:
                log.warning("%s: engine %s not followed: %s", origin, spec.name, exc)
        return added, removed

    def engine_specs(self) -> list[EngineSpec]:
        return self.engines.specs()

    def source_stats(self) -> dict[str, SourceStats]:
        return self._subscriber.stats()

    def engine_statuses(self) -> list[dict]:
        """One entry per engine, as ``GET /v1/engines`` shows it."""
        stats = self._subscriber.stats()
        now = time.time()
        out = []
        for state in self.engines.states():
            entry = self.engines.describe(state, stats.get(state.spec.name) or SourceStats(), now)
            entry["blocks"] = self.index.engine_block_counts(state.spec.name)
            out.append(entry)
        return out

    def down_engines(self) -> set[str]:
        """Engines with no connection to their publisher now (no index access: cheap
        enough for the event loop)."""
        return self._subscriber.disconnected(self.engines.names())

    def leaving_engines(self) -> set[str]:
        """Engines their discovery source no longer lists, in their grace period."""
        return {st.spec.name for st in self.engines.states() if st.leaving_since is not None}

    def unroutable_engines(self) -> set[str]:
        """Engines disconnected for at least ``down_after_s``: their blocks are not
        offered for routing (they stay in the index and in lookups)."""
        return self.engines.unroutable()

    # -- queries ---------------------------------------------------------------------

    def lookup(
        self, token_ids: list[int], model: str | None = None, lora_name: str | None = None,
        *, cache_salt: str | None = None, media: Sequence[MediaItem] = (), endpoint: str = "lookup",
        blocking: bool = True, timeout: float = -1,
    ) -> LookupResult:
        """Index lookup, timed into the metrics (``cache_salt``, ``media``: see
        :meth:`~kvevents.index.PrefixIndex.lookup`; never a label). ``blocking=False`` raises
        :class:`~kvevents.index.IndexBusy` instead of waiting for the index lock, and so
        does a ``timeout`` (seconds) that passes before the lock is free."""
        t0 = time.perf_counter()
        result = self.index.lookup(token_ids, model=model, lora_name=lora_name, cache_salt=cache_salt,
                                   media=media, blocking=blocking, timeout=timeout)
        self.metrics.observe_lookup(endpoint, time.perf_counter() - t0, result, model)
        return result
