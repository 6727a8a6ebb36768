"""Digests of the last batches applied from one publisher, to tell its stream apart
from a restarted process's.

After a reconnect or a suspicious seq jump the subscriber asks the publisher to replay
the last few seqs it applied and compares the payload digests: the same process
replays byte-identical payloads; a new process that has already published past our
last seq replays different ones under the same seqs (a restart the seq numbers alone
cannot show). CRC-32 is enough: this guards against accidents, not forgery.
"""

from __future__ import annotations

import zlib
from collections import deque


def digest(payload: bytes) -> int:
    return zlib.crc32(payload)


class DigestRing:
    """The last ``size`` (seq, digest) pairs delivered, oldest first. Not thread-safe;
    owned by the subscriber thread."""

    def __init__(self, size: int = 4) -> None:
        self._ring: deque[tuple[int, int]] = deque(maxlen=size)

    def add(self, seq: int, payload: bytes) -> None:
        self._ring.append((seq, zlib.crc32(payload)))  # digest(), inlined: once per batch

    def clear(self) -> None:
        self._ring.clear()

    def oldest(self) -> int | None:
        return self._ring[0][0] if self._ring else None

    def check(self, seq: int, payload: bytes) -> bool | None:
        """True/False if ``seq`` is remembered and matches / differs; None if unknown."""
        for s, d in self._ring:
            if s == seq:
                return d == digest(payload)
        return None

    def __len__(self) -> int:
        return len(self._ring)
