"""Durable restarts: snapshots of the index plus where each engine's stream stood.

A snapshot is one file (:mod:`.format`)::

    magic b"KVEVSNAP" | version u32 | meta length u32 | state length u64
    | blake2b-256 of (meta + state) | meta (JSON) | state (PrefixIndex.export_state())

``meta`` holds, per engine, its spec and the seq and publisher timestamp of the last batch
applied to ``state``: the anchor from which the engine's stream resumes. The pair is
captured atomically by the aggregator (under its apply lock), so ``state`` holds
exactly the batches up to each anchor.

Modules:

* :mod:`.format`: the byte format (:func:`encode`, :func:`decode`, :class:`Snapshot`,
  :class:`EngineAnchor`, :class:`SnapshotError`). Reading checks magic, version,
  lengths and digest before anything is used.
* :mod:`.store`: the data dir, ``snapshot.bin`` (current) and ``snapshot.prev.bin``
  (the one before), never more; :func:`write` is atomic and fsynced, so a crash leaves
  at least one whole file; :func:`read_latest` skips (logs) a truncated, flipped or
  foreign file and tries the previous one, never half-loads.
* :mod:`.peer`: :func:`fetch_peer`, a peer aggregator's snapshot over HTTP (bootstrap).
* :mod:`.recovery`: :func:`restore` on startup, and :func:`check_continuity`: the
  publisher's replay buffer is asked for the anchor seq and the batch it returns must
  carry the anchor's timestamp. A different timestamp or no such batch means another
  publisher process (:data:`RESTARTED`); a first replayed seq above the anchor means the
  buffer wrapped while we were down (:data:`WRAPPED`). Either way that engine's restored
  state cannot be vouched for and is dropped, as the live loss rule does.
"""

from __future__ import annotations

from kvevents.service.snapshot.format import (
    _HEADER,
    MAGIC,
    MAX_META_BYTES,
    MAX_STATE_BYTES,
    VERSION,
    EngineAnchor,
    Snapshot,
    SnapshotError,
    decode,
    encode,
)
from kvevents.service.snapshot.peer import fetch_peer
from kvevents.service.snapshot.recovery import (
    CONTINUOUS,
    RESTARTED,
    UNREACHABLE,
    WRAPPED,
    check_continuity,
    restore,
)
from kvevents.service.snapshot.store import CURRENT, PREVIOUS, read_latest, write

__all__ = [
    "CONTINUOUS", "CURRENT", "MAGIC", "MAX_META_BYTES", "MAX_STATE_BYTES", "PREVIOUS",
    "RESTARTED", "UNREACHABLE", "VERSION", "WRAPPED", "EngineAnchor", "Snapshot",
    "SnapshotError", "check_continuity", "decode", "encode", "fetch_peer", "read_latest",
    "restore", "write",
]
