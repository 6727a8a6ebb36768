"""Engine names <-> the small integer ids the compiled core uses (an engine's bit in the
residency masks). Ids of dropped engines are reused, so the masks stay as narrow as the
number of engines followed at once.

Not thread-safe; owned and locked by :class:`~kvevents.index.PrefixIndex`.
"""

from __future__ import annotations

from array import array

from ._core import digest64

#: Engines followed at once (one bit each in every block's mask).
MAX_ENGINES = 65536


class EngineIds:
    """name <-> id, plus each id's stable hash salt (for its orphan and token-less
    keys, which must not collide across engines). Not to be confused with
    :class:`kvevents.engines.EngineRegistry` (the engines the aggregator follows)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str | None] = []
        self._free: list[int] = []
        self._rank: array | None = None  # per id: position in name order (lookup ties)

    def get(self, name: str) -> int | None:
        return self.ids.get(name)

    def add(self, name: str) -> tuple[int, int]:
        """A new id for ``name``: (id, salt). Raises ``OverflowError`` past MAX_ENGINES."""
        if self._free:
            pid = self._free.pop()
            self.names[pid] = name
        else:
            pid = len(self.names)
            if pid >= MAX_ENGINES:
                raise OverflowError(f"more than {MAX_ENGINES} engines")
            self.names.append(name)
        self.ids[name] = pid
        self._rank = None
        # The salt's domain string predates the engine naming: it is part of every
        # stored entry's key (and of snapshots), so it stays as it is.
        return pid, digest64("kvevents-pod", name)

    def remove(self, name: str) -> int | None:
        pid = self.ids.pop(name, None)
        if pid is not None:
            self.names[pid] = None
            self._free.append(pid)
            self._rank = None
        return pid

    def rank(self) -> array:
        """Per engine id, its position among the engines sorted by name (int32; recomputed
        only after engines come or go)."""
        if self._rank is None:
            live = sorted((n, pid) for pid, n in enumerate(self.names) if n is not None)
            rank = array("i", [0]) * max(len(self.names), 1)
            for pos, (_, pid) in enumerate(live):
                rank[pid] = pos
            self._rank = rank
        return self._rank

    def export(self) -> list[str | None]:
        return list(self.names)

    @classmethod
    def restore(cls, names: list[str | None]) -> EngineIds:
        reg = cls()
        reg.names = list(names)
        for pid, name in enumerate(names):
            if name is None:
                reg._free.append(pid)
            else:
                if name in reg.ids:
                    raise ValueError(f"engine {name!r} appears twice")
                reg.ids[name] = pid
        reg._free.reverse()
        return reg
