"""Give freed heap memory back to the OS after a flood.

Large bursts (hundreds of MB of 100 KB batches) leave glibc's malloc arenas holding
the freed memory, so RSS stays at the peak after the queues drain. ``malloc_trim(0)``
returns free pages of every arena. Only glibc has it; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_trim = None
try:
    # The process's own symbols (no library search: ctypes.util.find_library would run
    # ldconfig/gcc at import time, seconds on a busy machine).
    _trim = ctypes.CDLL(None).malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError, TypeError):  # not glibc
    _trim = None


def release_memory() -> bool:
    """Return free heap pages to the OS; True if the platform supports it."""
    if _trim is None:
        return False
    try:
        _trim(0)
    except Exception:  # never let housekeeping break ingest
        log.debug("malloc_trim failed", exc_info=True)
        return False
    return True


def rss_bytes() -> int | None:
    """This process's resident set size (Linux), for health output and tests."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")
