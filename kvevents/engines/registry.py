"""The registry of followed engines: who is followed, since when, and whether routable.

One :class:`EngineState` per engine, keyed by name, behind one lock: the HTTP threads
(``GET /v1/engines``, routing), the housekeeping thread (down clocks) and the ingest
thread (an engine's model) all read it. The registry decides and records; it does not
open sockets or touch the index. The service performs what it decides
(:class:`~kvevents.service.aggregator.Aggregator`: subscribe, drop state, metrics).

* :meth:`add` / :meth:`remove`: one engine, checked against names taken and the
  socket budget (:class:`EngineExistsError`, :class:`EngineBudgetError`).
* :meth:`plan`: the changes that make the engines of one *origin* (``static``, ``api``,
  or a discovery source) equal a desired set: new names to add, vanished names to
  remove, and names whose spec changed (removed, then added again). Engines of other
  origins are never touched, so a discovery source cannot drop a configured engine.
* Status: ``live`` (a message within ``stale_after_s``), ``stale`` (connected but
  silent, or never heard from), ``down`` (no connection to the publisher). An engine
  down for ``down_after_s`` is not *routable*: its blocks stay in the index and in
  lookups, but routing does not offer it. Nor is an engine *leaving*: its discovery
  source no longer lists it and it waits out the grace period (:meth:`set_leaving`).
* Recovery: an engine whose first contact (the initial replay) has not finished
  ``recovery_timeout_s`` after it was added is *given up on* (:meth:`give_up_overdue`):
  readiness stops waiting for it, once, counted; it is still followed and recovers
  on its own when its publisher answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvevents.engines.spec import EngineSpec
from kvevents.ingest.source import SourceStats


class EngineExistsError(ValueError):
    """An engine of that name is already followed."""


class EngineBudgetError(ValueError):
    """More engines than the socket/file budget allows (see :mod:`kvevents.ingest.budget`)."""


@dataclass
class EngineState:
    spec: EngineSpec
    added_at: float
    origin: str = "static"  # who asked: "static" (settings), "api", or a discovery source
    resyncs: int = 0  # times its state was dropped after a loss
    restore: str | None = None  # continuity outcome when restored from a snapshot
    down_since: float | None = None  # monotonic time it was last seen disconnected
    added_mono: float = 0.0  # monotonic time it was added (the recovery clock)
    leaving_since: float | None = None  # wall time its source stopped listing it
    given_up: bool = False  # first contact overdue: readiness no longer waits for it


@dataclass(frozen=True)
class Plan:
    """What :meth:`EngineRegistry.plan` found: add these specs, remove these names."""

    add: tuple[EngineSpec, ...] = ()
    remove: tuple[str, ...] = ()


def stream_status(st: SourceStats, now: float, stale_after_s: float) -> str:
    """``live``, ``stale`` or ``down`` (see the module docstring); ``now`` is wall time."""
    if st.connected <= 0:
        return "down"
    if st.last_received is not None and now - st.last_received <= stale_after_s:
        return "live"
    return "stale"


class EngineRegistry:
    """The followed engines; every method is thread-safe and returns copies."""

    def __init__(self, max_engines: int, *, down_after_s: float, stale_after_s: float) -> None:
        self.max_engines = max_engines
        self.down_after_s = down_after_s
        self.stale_after_s = stale_after_s
        self._engines: dict[str, EngineState] = {}
        self._lock = threading.Lock()

    # -- membership --------------------------------------------------------------------

    def add(self, spec: EngineSpec, *, origin: str = "static") -> EngineState:
        """Record a new engine (down until its publisher connects). Raises
        :class:`EngineExistsError` for a taken name, :class:`EngineBudgetError` when
        the budget is used up; nothing is recorded then."""
        with self._lock:
            if spec.name in self._engines:
                raise EngineExistsError(f"engine {spec.name!r} already exists")
            if len(self._engines) >= self.max_engines:
                raise EngineBudgetError(
                    f"the socket budget allows {self.max_engines} engines and all are in "
                    "use: remove one, or raise the open-file limit or max_engines")
            now = time.monotonic()
            state = EngineState(spec, time.time(), origin, down_since=now, added_mono=now)
            self._engines[spec.name] = state
            return state

    def remove(self, name: str) -> EngineState:
        """Forget an engine; raises ``KeyError`` if unknown."""
        with self._lock:
            return self._engines.pop(name)

    def plan(self, desired: Iterable[EngineSpec], origin: str) -> Plan:
        """The changes that make the engines of ``origin`` equal ``desired`` (see the
        module docstring). A desired name held by another origin is left alone."""
        want = {spec.name: spec for spec in desired}
        with self._lock:
            mine = {n: s.spec for n, s in self._engines.items() if s.origin == origin}
            others = {n for n, s in self._engines.items() if s.origin != origin}
        changed = [n for n, spec in want.items() if n in mine and mine[n] != spec]
        remove = sorted(set(mine) - set(want)) + changed
        add = [spec for n, spec in want.items()
               if n not in others and (n not in mine or n in changed)]
        return Plan(tuple(add), tuple(remove))

    # -- reads ---------------------------------------------------------------------------

    def get(self, name: str) -> EngineState | None:
        return self._engines.get(name)  # one dict read: safe without the lock

    def model_of(self, name: str) -> tuple[bool, str | None]:
        """(followed, model) for the ingest thread."""
        state = self._engines.get(name)
        return (state is not None, state.spec.model if state else None)

    def dp_rank_of(self, name: str) -> int | None:
        """The data-parallel rank ``name`` is of its server (None: not a rank, or not
        followed), for the ingest thread."""
        state = self._engines.get(name)
        return state.spec.dp_rank if state else None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._engines)

    def specs(self) -> list[EngineSpec]:
        with self._lock:
            return [s.spec for s in self._engines.values()]

    def states(self) -> list[EngineState]:
        with self._lock:
            return list(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    # -- status ----------------------------------------------------------------------------

    def count_resync(self, name: str) -> None:
        with self._lock:
            state = self._engines.get(name)
            if state is not None:
                state.resyncs += 1

    def set_restore(self, name: str, outcome: str) -> None:
        with self._lock:
            state = self._engines.get(name)
            if state is not None:
                state.restore = outcome

    def track_down(self, stats: Mapping[str, SourceStats]) -> None:
        """Start or stop each engine's down clock from its connection count now."""
        now = time.monotonic()
        with self._lock:
            for name, state in self._engines.items():
                st = stats.get(name)
                if st is not None and st.connected > 0:
                    state.down_since = None
                elif state.down_since is None:
                    state.down_since = now

    def set_leaving(self, name: str, leaving: bool) -> bool:
        """Mark an engine as leaving (not routable, state kept) or back; False if unknown."""
        with self._lock:
            state = self._engines.get(name)
            if state is None:
                return False
            if not leaving:
                state.leaving_since = None
            elif state.leaving_since is None:
                state.leaving_since = time.time()
            return True

    def give_up_overdue(self, stats: Mapping[str, SourceStats], timeout_s: float) -> list[str]:
        """Engines whose initial replay is ``timeout_s`` overdue, newly given up on now
        (each engine once per time it was added); those done meanwhile are cleared."""
        now = time.monotonic()
        newly = []
        with self._lock:
            for name, state in self._engines.items():
                st = stats.get(name)
                if st is not None and st.initial_replay_done:
                    state.given_up = False
                elif not state.given_up and now - state.added_mono >= timeout_s:
                    state.given_up = True
                    newly.append(name)
        return newly

    def routable(self, state: EngineState) -> bool:
        if state.leaving_since is not None:
            return False
        return not (state.down_since is not None
                    and time.monotonic() - state.down_since >= self.down_after_s)

    def unroutable(self) -> set[str]:
        """Engines disconnected for at least ``down_after_s``, and leaving ones."""
        with self._lock:
            return {n for n, s in self._engines.items() if not self.routable(s)}

    def status(self, st: SourceStats, now: float) -> str:
        return stream_status(st, now, self.stale_after_s)

    def describe(self, state: EngineState, st: SourceStats, now: float) -> dict:
        """One engine as ``GET /v1/engines`` shows it, but its blocks (the index's)."""
        spec = state.spec
        return {
            "name": spec.name,
            "endpoint": spec.endpoint,
            "replay_endpoint": spec.replay_endpoint,
            "model": spec.model,
            "http": spec.http,
            "dp_rank": spec.dp_rank,
            "role": spec.role,
            "status": "replaying" if st.replaying else self.status(st, now),
            "replay_gap": ({"from_seq": st.replay_from, "held_from_seq": st.replay_until,
                            "held_bytes": st.pending_bytes} if st.replaying else None),
            "connected": st.connected > 0,
            "last_seq": st.last_seq,
            "lag_seconds": None if st.last_batch_ts is None else max(0.0, now - st.last_batch_ts),
            "last_event_age_seconds": None if st.last_received is None else now - st.last_received,
            "batches": st.batches,
            "lane_batches": st.lane_batches,
            "gaps": st.gaps,
            "replayed_batches": st.replayed_batches,
            "lost_batches": st.lost_batches,
            "restarts": st.restarts,
            "resyncs": state.resyncs,
            "malformed": st.malformed_frames + st.decode_errors,
            "routable": self.routable(state),
            "restore": state.restore,
            "origin": state.origin,
            "leaving_since": state.leaving_since,
            "recovery_given_up": state.given_up,
        }
