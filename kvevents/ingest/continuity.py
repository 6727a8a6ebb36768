"""The last batches applied from one publisher (or their digests), to tell its stream
apart from a restarted process's.

After a reconnect or a suspicious seq jump the subscriber asks the publisher to replay
the last few seqs it applied and compares the payloads: the same process replays
byte-identical payloads; a new process that has already published past our last seq
replays different ones under the same seqs (a restart the seq numbers alone cannot
show). Large payloads are compared by CRC-32: that guards against accidents, not
forgery.
"""

from __future__ import annotations

import zlib
from collections import deque


def digest(payload: bytes) -> int:
    return zlib.crc32(payload)


class DigestRing:
    """The last ``size`` (seq, payload or digest) pairs delivered, oldest first. Not
    thread-safe; owned by the subscriber thread.

    Payloads up to ``_KEEP_BYTES`` are kept as they are (the ``bytes`` objects the
    stream already made) and compared whole when checked; larger ones are reduced to
    their CRC-32 at once, so the ring holds at most ``size * _KEEP_BYTES`` of payload.
    Why: the check is rare (after a reconnect or a seq jump) but ``add`` runs for every
    batch, and a CRC of each was 6% of the ingest thread."""

    _KEEP_BYTES = 8 << 10

    def __init__(self, size: int = 4) -> None:
        self._ring: deque[tuple[int, bytes | int]] = deque(maxlen=size)

    def add(self, seq: int, payload: bytes) -> None:
        self._ring.append((seq, payload if len(payload) <= self._KEEP_BYTES
                           else zlib.crc32(payload)))

    def clear(self) -> None:
        self._ring.clear()

    def oldest(self) -> int | None:
        return self._ring[0][0] if self._ring else None

    def check(self, seq: int, payload: bytes) -> bool | None:
        """True/False if ``seq`` is remembered and matches / differs; None if unknown."""
        for s, kept in self._ring:
            if s == seq:
                if isinstance(kept, bytes):
                    return kept == payload
                return kept == digest(payload)
        return None

    def __len__(self) -> int:
        return len(self._ring)
