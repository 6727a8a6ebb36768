"""Per-publisher translation of engine block hashes to slots.

The engine's hashes are only used to translate ``BlockRemoved`` events and to find a
``BlockStored`` event's parent (DESIGN.md: index keyed by content). One map per pod,
because pods need not share a hash seed. Entries live while the pod holds the block in
at least one tier; the index deletes them when the pod's last reference goes.

Hashes are reduced to 64 bits (:func:`~kvevents.index.keys.hash64`) and kept in a
compact numpy table (~30-40 bytes per entry instead of ~90 for a dict). The exact
original is kept aside only when the reduction is not the identity (bytes digests,
ints outside [0, 2^64)), so :meth:`originals` can hand back what the engine sent.

Not thread-safe; owned and locked by ``PrefixIndex``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..schema import BlockHash
from .hashtable import U64Table
from .keys import hash64


def hashes_to_u64(hashes: Sequence[BlockHash]) -> tuple[np.ndarray, dict[int, BlockHash] | None]:
    """Engine hashes as a uint64 array, plus {reduced: original} where they differ."""
    try:
        # Fast path: plain ints in [0, 2^64) convert in C.
        return np.array(hashes, dtype=np.uint64), None
    except (TypeError, ValueError, OverflowError):
        pass
    red = [hash64(h) for h in hashes]
    orig = {r: h for r, h in zip(red, hashes) if r != h}
    return np.array(red, dtype=np.uint64), orig


class PodMap:
    """engine hash (reduced to uint64) -> slot, for one pod."""

    __slots__ = ("table", "_orig")

    def __init__(self) -> None:
        self.table = U64Table(64)
        self._orig: dict[int, BlockHash] = {}

    def remember(self, orig: dict[int, BlockHash] | None) -> None:
        if orig:
            self._orig.update(orig)

    def forget(self, keys: np.ndarray) -> None:
        """Delete entries (and their kept originals)."""
        self.table.delete(keys)
        if self._orig:
            for k in keys.tolist():
                self._orig.pop(k, None)

    def original(self, key: int) -> BlockHash:
        return self._orig.get(key, key)

    def items(self) -> tuple[list[BlockHash], np.ndarray]:
        """(original hashes, slots)."""
        keys, slots = self.table.items()
        kl = keys.tolist()
        if self._orig:
            kl = [self._orig.get(k, k) for k in kl]
        return kl, slots

    def clear(self) -> None:
        self.table.clear()
        self._orig.clear()

    @property
    def nbytes(self) -> int:
        return self.table.nbytes
