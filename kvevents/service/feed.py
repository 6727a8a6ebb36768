"""A bounded feed of what the index applies, for server-sent events (the live page).

The ingest thread appends; HTTP handlers read everything after the id they last saw.
Old items fall off the end: a reader that falls behind is told how many it missed
(``missed``), never blocked and never blocking the writer.
"""

from __future__ import annotations

import collections
import json
import math
import re
import threading
from typing import Any

# A resume id is what we sent: ASCII digits (str.isdigit() also takes "²").
_EVENT_ID = re.compile(r"[0-9]{1,19}")


def parse_last_event_id(header: str | None, default: int) -> int:
    """The id a reconnecting SSE client sent in ``Last-Event-ID``; ``default`` when
    the header is absent or is not one of our ids (never an error: it is a hint)."""
    if header and _EVENT_ID.fullmatch(header):
        return int(header)
    return default


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(data: Any) -> str:
    """Strict JSON for the feed: NaN and infinities (a publisher's bogus timestamp, a
    ratio over nothing) become null, since ``Infinity`` is not JSON and breaks
    ``JSON.parse`` in the page."""
    try:
        return json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), separators=(",", ":"), allow_nan=False)


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
