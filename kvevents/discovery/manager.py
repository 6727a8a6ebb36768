"""The discovery manager: sources' desired sets reconciled into the aggregator.

:class:`Discovery` runs each :class:`~kvevents.discovery.source.Source` on its own
daemon thread and applies what it emits through
:meth:`~kvevents.service.aggregator.Aggregator.reconcile` under the source's origin, so
a source only ever adds and removes its own engines (never a configured or
API-added one). Between a source and the aggregator sits the grace period:

* an engine the source stops listing is marked *leaving* at once (not routable, not a
  gateway target: within one source round of its disappearance) but stays followed,
  its state intact, for ``grace_s`` seconds; if it comes back within that time it is
  routable again with nothing lost (a DNS flap, a pod briefly not Ready);
* after ``grace_s`` it is removed: unsubscribed, its index state and metric series
  dropped (:meth:`~kvevents.service.aggregator.Aggregator.remove_engine`);
* an engine listed again with a *different* spec (new address or ports under the same
  name) is replaced: its old state is dropped, never merged. A new process behind the
  same address is caught by stream continuity (a restarted seq), as for any engine.

Readiness (:meth:`readiness`): not ready until every source has finished its first
round, so a replica never serves before it knows the fleet; a source that has not
succeeded within ``first_round_timeout_s`` is given up on (counted, visible on
``GET /v1/discovery``) rather than holding the replica out forever.

Lifecycle: ``Discovery(aggregator, sources, ...)`` -> :meth:`start` (after the
aggregator's; with sources, it registers their counters on the aggregator's registry,
see :class:`_Metrics`) -> :meth:`stop` (before the aggregator's; unregisters them;
returns within a few seconds).
A source whose ``run`` raises is counted and restarted after a back-off; a failed
reconcile is logged and retried on the next round; the grace ticker survives its own
errors. No loop here dies quietly: :meth:`status` shows every thread's state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily

from kvevents.discovery.source import Source
from kvevents.engines.spec import EngineSpec

if TYPE_CHECKING:
    from kvevents.service.aggregator import Aggregator

log = logging.getLogger(__name__)

__all__ = ["Discovery"]

_TICK_S = 0.2
_RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)


class _Tracked:
    """One source's view: what it lists now, and what left and since when."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.present: dict[str, EngineSpec] = {}
        self.leaving: dict[str, tuple[EngineSpec, float]] = {}  # name -> (spec, monotonic since)
        self.crashes = 0
        self.thread: threading.Thread | None = None
        self.started = time.monotonic()
        self.given_up = False


class _Metrics:
    """The sources' counters at scrape time (registered only when there are sources):
    ``kvevents_discovery_errors_total{origin}``, failed rounds (the last set stood), and
    ``kvevents_discovery_query_failures_total{origin, query, reason}``, DNS questions that
    got no answer from any server (``query`` A, AAAA, SRV...; ``reason`` refused,
    servfail, notimp, timeout...), whether or not the round failed."""

    def __init__(self, tracked: dict[str, _Tracked]) -> None:
        self._tracked = tracked

    def collect(self):
        errors = CounterMetricFamily("kvevents_discovery_errors", "failed discovery rounds "
                                     "(the source's last set stood)", labels=["origin"])
        failures = CounterMetricFamily(
            "kvevents_discovery_query_failures", "DNS questions of a discovery source that no "
            "server answered, by kind and reason", labels=["origin", "query", "reason"])
        for origin, t in self._tracked.items():
            errors.add_metric([origin], t.source.status.errors)
            for (query, reason), n in sorted(dict(t.source.status.query_failures).items()):
                failures.add_metric([origin, query, reason], n)
        yield errors
        yield failures


class Discovery:
    """See the module docstring. Thread-safe; one per aggregator."""

    def __init__(self, aggregator: Aggregator, sources: Sequence[Source], *, grace_s: float = 30.0,
                 first_round_timeout_s: float = 30.0) -> None:
        origins = [s.origin for s in sources]
        if len(origins) != len(set(origins)):
            raise ValueError(f"discovery sources must differ, got {origins}")
        self.aggregator = aggregator
        self.grace_s = grace_s
        self.first_round_timeout_s = first_round_timeout_s
        self._tracked = {s.origin: _Tracked(s) for s in sources}
        self._lock = threading.Lock()  # one reconcile at a time: emits and the ticker
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._metrics: _Metrics | None = None
        self.reconcile_errors = 0
        self.sources_given_up = 0
        self.added = 0
        self.removed = 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        for t in self._tracked.values():
            # Engines restored under this origin (a snapshot, a peer's bootstrap) are what
            # the source listed last: ones it no longer lists get the grace period.
            t.present = {st.spec.name: st.spec for st in self.aggregator.engines.states()
                         if st.origin == t.source.origin}
            t.started = time.monotonic()
            t.thread = threading.Thread(target=self._run_source, args=(t,), daemon=True,
                                        name=f"kvevents-discovery-{t.source.origin}"[:60])
            t.thread.start()
        self._ticker = threading.Thread(target=self._tick_forever, daemon=True,
                                        name="kvevents-discovery-grace")
        self._ticker.start()
        registry = getattr(self.aggregator, "registry", None)
        if self._tracked and registry is not None and self._metrics is None:
            self._metrics = _Metrics(self._tracked)
            registry.register(self._metrics)

    def stop(self, timeout_s: float = 3.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in [t.thread for t in self._tracked.values()] + [self._ticker]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._metrics is not None:  # an app restarted on the same aggregator registers anew
            self.aggregator.registry.unregister(self._metrics)
            self._metrics = None
        alive = [t.source.origin for t in self._tracked.values() if t.thread and t.thread.is_alive()]
        if alive:  # daemon threads: they cannot keep the process up, but say so
            log.warning("discovery sources still stopping after %.0fs: %s", timeout_s, alive)

    # -- the sources' threads --------------------------------------------------------------

    def _run_source(self, t: _Tracked) -> None:
        while not self._stop.is_set():
            try:
                t.source.run(lambda specs, t=t: self._emit(t, specs), self._stop)
                return  # run returns only when stopped
            except Exception as exc:  # a bug or an unexpected library error: count, restart
                t.crashes += 1
                t.source.status.failed(f"{type(exc).__name__}: {exc}")
                log.exception("discovery source %s failed; restarting it", t.source.origin)
                self._stop.wait(_RESTART_BACKOFF_S[min(t.crashes, len(_RESTART_BACKOFF_S)) - 1])

    def _emit(self, t: _Tracked, specs: Sequence[EngineSpec]) -> None:
        """A source's whole desired set, now."""
        present: dict[str, EngineSpec] = {}
        for spec in specs:
            present.setdefault(spec.name, spec)  # a name twice: the first wins
        now = time.monotonic()
        with self._lock:
            for name, spec in t.present.items():
                if name not in present and name not in t.leaving:
                    t.leaving[name] = (spec, now)
                    self.aggregator.engines.set_leaving(name, True)
                    log.info("%s: engine %s vanished; unroutable now, dropped in %.0fs unless "
                             "it returns", t.source.origin, name, self.grace_s)
            for name in present:
                if t.leaving.pop(name, None) is not None:
                    self.aggregator.engines.set_leaving(name, False)
                    log.info("%s: engine %s is back", t.source.origin, name)
            t.present = present
            self._apply(t)

    def _apply(self, t: _Tracked) -> None:
        """Reconcile the source's present engines plus those still in their grace period
        (a leaving engine whose name is listed again with a new spec is replaced)."""
        desired = dict(t.present)
        for name, (spec, _) in t.leaving.items():
            desired.setdefault(name, spec)
        try:
            added, removed = self.aggregator.reconcile(desired.values(), t.source.origin)
        except Exception:
            self.reconcile_errors += 1
            log.exception("%s: reconcile failed; retried on the next round", t.source.origin)
            return
        self.added += len(added)
        self.removed += len(removed)
        for name in added:
            if name in t.leaving:  # re-followed under a new spec while leaving: keep it so
                self.aggregator.engines.set_leaving(name, True)
        if added or removed:
            log.info("%s: following %s%s", t.source.origin,
                     f"+{added} " if added else "", f"-{removed}" if removed else "")

    def _tick_forever(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self.tick()
            except Exception:
                log.exception("discovery grace ticker failed; continuing")

    def tick(self) -> None:
        """Remove engines past their grace period; give up on sources overdue."""
        now = time.monotonic()
        with self._lock:
            for t in self._tracked.values():
                expired = [n for n, (_, since) in t.leaving.items() if now - since >= self.grace_s]
                for name in expired:
                    del t.leaving[name]
                if expired:
                    self._apply(t)
                if (not t.source.status.first_round_done and not t.given_up
                        and now - t.started >= self.first_round_timeout_s):
                    t.given_up = True
                    self.sources_given_up += 1
                    log.warning("discovery source %s: no successful round in %.0fs; readiness "
                                "no longer waits for it (%s)", t.source.origin,
                                self.first_round_timeout_s, t.source.status.last_error)

    # -- reads --------------------------------------------------------------------------

    def readiness(self) -> dict:
        """Ready once every source finished its first round (or was given up on)."""
        waiting = sorted(o for o, t in self._tracked.items()
                         if not t.source.status.first_round_done and not t.given_up)
        return {"ready": not waiting, "waiting_sources": waiting}

    def status(self) -> list[dict]:
        """One entry per source, as ``GET /v1/discovery`` shows it."""
        out = []
        for origin, t in self._tracked.items():
            st = t.source.status
            out.append({
                "origin": origin, **t.source.describe(),
                "running": bool(t.thread and t.thread.is_alive()),
                "first_round_done": st.first_round_done, "given_up": t.given_up,
                "rounds": st.rounds, "errors": st.errors, "last_error": st.last_error,
                "last_ok": st.last_ok, "crashes": t.crashes, "engines": sorted(t.present),
                "leaving": sorted(t.leaving), **st.extra,
            })
        return out
