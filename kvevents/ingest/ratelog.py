"""Rate limiting of repeated log lines.

A flood (thousands of idle TCP connections hitting the open-file limit, a publisher
sending garbage) must not turn into megabytes of log: each distinct message template
(logger + format string) may be logged ``burst`` times per ``interval_s``; the rest are
counted and summarised once per interval ("N similar messages suppressed").

Lifecycle: ``install()`` once at process start (idempotent); ``RateLimitFilter`` can
also be attached to any handler. Never raises from ``filter``.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitFilter(logging.Filter):
    """Passes at most ``burst`` records per message template per ``interval_s``."""

    def __init__(self, burst: int = 5, interval_s: float = 10.0, max_keys: int = 4096) -> None:
        super().__init__()
        self.burst = burst
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.suppressed_total = 0
        self._lock = threading.Lock()
        # key -> [window start, passed in window, suppressed in window]
        self._windows: dict[tuple[str, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            w = self._windows.get(key)
            if w is None or now - w[0] >= self.interval_s:
                suppressed = int(w[2]) if w is not None else 0
                if len(self._windows) >= self.max_keys and w is None:
                    self._windows.clear()  # bounded memory; worst case a few extra lines
                self._windows[key] = [now, 1, 0]
                if suppressed:
                    record.msg = f"{record.msg} [{suppressed} similar messages suppressed]"
                return True
            if w[1] < self.burst:
                w[1] += 1
                return True
            w[2] += 1
            self.suppressed_total += 1
            return False


_installed: RateLimitFilter | None = None


def install(burst: int = 5, interval_s: float = 10.0) -> RateLimitFilter:
    """Attach one shared filter to the handlers of the root, uvicorn and asyncio
    loggers (filters on handlers see propagated records too). Idempotent."""
    global _installed
    if _installed is None:
        _installed = RateLimitFilter(burst, interval_s)
    for name in ("", "uvicorn", "uvicorn.error", "asyncio"):
        for handler in logging.getLogger(name).handlers:
            if _installed not in handler.filters:
                handler.addFilter(_installed)
    return _installed
