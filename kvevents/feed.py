"""A bounded feed of what the index applies, for server-sent events (the live page).

The ingest thread appends; HTTP handlers read everything after the id they last saw.
Old items fall off the end: a reader that falls behind is told how many it missed
(``missed``), never blocked and never blocking the writer.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class EventFeed:
    """Thread-safe ring of ``(id, kind, data)``; ids grow from 1."""

    def __init__(self, size: int = 2048) -> None:
        self._items: collections.deque[tuple[int, str, dict[str, Any]]] = collections.deque(
            maxlen=size
        )
        self._next = 1
        self._lock = threading.Lock()

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self._items.append((self._next, kind, data))
            self._next += 1

    @property
    def last_id(self) -> int:
        return self._next - 1

    def since(self, last_id: int, limit: int = 500) -> tuple[list[tuple[int, str, dict]], int]:
        """Items with id > ``last_id`` (at most ``limit``, the newest), and how many
        newer items the reader will never see (dropped from the ring or over limit)."""
        with self._lock:
            if not self._items or last_id >= self._items[-1][0]:
                return [], 0
            first = self._items[0][0]
            start = max(0, last_id + 1 - first)
            items = list(self._items)[start:]
            missed = max(0, first - last_id - 1)
        if len(items) > limit:
            missed += len(items) - limit
            items = items[-limit:]
        return items, missed
