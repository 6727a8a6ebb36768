"""Counters by engine *name*, as :class:`~kvevents.index.PrefixIndex` reports them.

The compiled core counts per engine *id* (reset when an id is reused); the facade keeps
the counters of engines' past lives here, by name, so they outlive drops, and adds the
live engines' own in with :func:`all_counts`. Not thread-safe: callers hold the index
lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._core import Core
from .engine_ids import EngineIds


@dataclass
class Counts:
    """Counters by engine name: applied[(engine, tier, kind)] = [events, blocks], and per
    engine unknown removals, orphan blocks, ignored events, refused events by reason."""

    applied: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)
    orphans: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)

    def copy(self) -> Counts:
        return Counts({k: list(v) for k, v in self.applied.items()}, dict(self.unknown),
                      dict(self.orphans), dict(self.ignored),
                      {p: dict(r) for p, r in self.refused.items()})


def fold(core: Core, engine: str, pid: int, into: Counts) -> None:
    """Add engine ``pid``'s cumulative core counters to ``into`` (by engine name)."""
    applied, cleared, unknown, orphans, ignored, refused = core.engine_counters(pid)
    for (tier, kind), (n_ev, n_bl) in applied.items():
        c = into.applied.setdefault((engine, tier, kind), [0, 0])
        c[0] += n_ev
        c[1] += n_bl
    if cleared:
        into.applied.setdefault((engine, "*", "AllBlocksCleared"), [0, 0])[0] += cleared
    for d, n in ((into.unknown, unknown), (into.orphans, orphans), (into.ignored, ignored)):
        if n:
            d[engine] = d.get(engine, 0) + n
    if refused:
        mine = into.refused.setdefault(engine, {})
        for reason, n in refused.items():
            mine[reason] = mine.get(reason, 0) + n


def all_counts(core: Core, engines: EngineIds, past: Counts) -> Counts:
    """The counters by name: ``past`` (dropped engines' past lives) plus the live
    engines' (caller holds the lock). ``past`` is not changed."""
    out = past.copy()
    for engine, pid in engines.ids.items():
        fold(core, engine, pid, out)
    return out
