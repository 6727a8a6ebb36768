"""The data dir: ``snapshot.bin`` (current) and ``snapshot.prev.bin`` (the one before).

A write goes to a temp file, is fsynced, the current file becomes the previous one, the
temp file is renamed into place, and the directory is fsynced: a crash at any point
leaves at least one whole, checksummed file. A read tries current, then previous, and
skips (logs) any file that fails verification.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from kvevents.service.snapshot.format import Snapshot, SnapshotError, decode

# The package's logger, as before the split (one logger name for the whole feature).
log = logging.getLogger("kvevents.service.snapshot")

CURRENT = "snapshot.bin"
PREVIOUS = "snapshot.prev.bin"


def write(data_dir: str | Path, data: bytes) -> Path:
    """Atomically make ``data`` the current snapshot, keeping the previous one.
    Raises ``OSError`` (the current file is then untouched)."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (CURRENT + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    cur = d / CURRENT
    if cur.exists():
        os.replace(cur, d / PREVIOUS)
    os.replace(tmp, cur)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames themselves must survive a power cut
    finally:
        os.close(fd)
    return cur


def read_latest(data_dir: str | Path) -> Snapshot | None:
    """The newest whole snapshot in ``data_dir`` (current, else previous), or None.
    Every file that fails verification is logged and skipped."""
    d = Path(data_dir)
    for name in (CURRENT, PREVIOUS):
        path = d / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.error("snapshot %s unreadable, ignored: %s", path, exc)
            continue
        try:
            snap = decode(data)
        except SnapshotError as exc:
            log.error("snapshot %s ignored: %s", path, exc)
            continue
        log.info("snapshot %s: %d engines, taken %.1f s ago", path, len(snap.engines),
                 time.time() - snap.created)
        return snap
    return None
