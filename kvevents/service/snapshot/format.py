"""The snapshot file's byte format: header, metadata, index state; encode and verify.

::

    magic b"KVEVSNAP" | version u32 | meta length u32 | state length u64
    | blake2b-256 of (meta + state) | meta (JSON) | state (PrefixIndex.export_state())

:func:`decode` checks magic, version, lengths and digest before anything is used and
raises :class:`SnapshotError` on a truncated, flipped or foreign file.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"KVEVSNAP"
VERSION = 1
_HEADER = struct.Struct(">8sIIQ32s")
# Bounds of what a reader accepts, so a corrupt length cannot make it allocate wildly.
MAX_META_BYTES = 64 * 1024 * 1024
MAX_STATE_BYTES = 64 * 1024 * 1024 * 1024


class SnapshotError(ValueError):
    """A snapshot that is not whole and ours: wrong magic/version, short, bad digest."""


@dataclass(frozen=True)
class EngineAnchor:
    """Where one engine's stream stood when the snapshot was taken."""

    spec: dict[str, Any]  # EngineSpec fields
    last_seq: int | None  # None: nothing applied yet
    last_ts: float | None  # publisher timestamp of batch ``last_seq``
    origin: str = "api"  # who asked to follow it (settings, API, a discovery source)


@dataclass(frozen=True)
class Snapshot:
    created: float
    engines: dict[str, EngineAnchor]
    state: bytes  # PrefixIndex.export_state()


def encode(snap: Snapshot) -> bytes:
    meta = json.dumps({
        "created": snap.created,
        "engines": {name: {"spec": a.spec, "last_seq": a.last_seq, "last_ts": a.last_ts,
                           "origin": a.origin}
                    for name, a in snap.engines.items()},
    }, allow_nan=False).encode()
    digest = hashlib.blake2b(meta + snap.state, digest_size=32).digest()
    return _HEADER.pack(MAGIC, VERSION, len(meta), len(snap.state), digest) + meta + snap.state


def decode(data: bytes) -> Snapshot:
    """Parse and verify a whole snapshot; raises :class:`SnapshotError`."""
    if len(data) < _HEADER.size:
        raise SnapshotError(f"truncated: {len(data)} bytes, header is {_HEADER.size}")
    magic, version, meta_len, state_len, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("not a kvevents snapshot (bad magic)")
    if version != VERSION:
        raise SnapshotError(f"snapshot version {version}; this build reads {VERSION}")
    if meta_len > MAX_META_BYTES or state_len > MAX_STATE_BYTES:
        raise SnapshotError("implausible section lengths")
    body = memoryview(data)[_HEADER.size:]
    if len(body) != meta_len + state_len:
        raise SnapshotError(f"truncated or padded: body {len(body)} bytes, "
                            f"header says {meta_len + state_len}")
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise SnapshotError("checksum mismatch (corrupt file)")
    try:
        meta = json.loads(bytes(body[:meta_len]))
        # "pods": the key of snapshots written before engines were called engines.
        anchors = meta["engines"] if "engines" in meta else meta["pods"]
        # "origin": absent from snapshots written before discovery (engines added then
        # came from the settings or the API).
        engines = {name: EngineAnchor(p["spec"], p["last_seq"], p["last_ts"],
                                      str(p.get("origin", "api")))
                   for name, p in anchors.items()}
        created = float(meta["created"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"bad metadata: {exc}") from None
    return Snapshot(created, engines, bytes(body[meta_len:]))
