"""A compact uint64 -> int32 hash table operated on whole numpy arrays at a time.

Why not a ``dict``: a Python dict keyed by 64-bit ints costs ~90 bytes per entry (a
40-byte int object plus ~50 bytes of table), which alone would blow the index's memory
budget (TARGETS P4: <= 150 bytes per resident entry). This table keeps keys and values
in flat numpy arrays (13 bytes per bucket, at most 50% full: ~26-52 bytes per entry) and
answers a whole event's worth of keys per call, so the per-call numpy overhead is paid
once per event rather than once per block.

Design: open addressing with linear probing over a power-of-two bucket array; a bucket
is empty (0), used (1) or a tombstone (2). Probing is vectorised: every pending key
advances one bucket per round, and rounds stop when no key is pending (the expected
number of rounds is small at load <= 0.5 because the bucket position is a strong mix of
the key). Deletions leave tombstones; the table is rebuilt when used + tombstones
exceeds half the buckets (and shrunk when mostly empty), which keeps probes short.

Lifecycle: create, then ``get`` / ``put`` / ``delete`` / ``items``. Not thread-safe:
the owner (``PrefixIndex``) serialises access with its lock. Never raises on missing
keys: ``get`` answers -1 and ``delete`` returns a found mask.
"""

from __future__ import annotations

import numpy as np

_EMPTY = 0
_WIN = 8
_WINDOW = np.arange(_WIN, dtype=np.int64)
_USED = 1
_TOMB = 2

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on a uint64 array (a bijection of uint64)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


class U64Table:
    """Map of uint64 keys to non-negative int32 values, vectorised over key arrays."""

    __slots__ = ("_keys", "_vals", "_state", "_mask", "_used", "_tombs")

    def __init__(self, capacity: int = 16) -> None:
        n = 16
        while n < 2 * capacity:
            n *= 2
        self._alloc(n)
        self._used = 0

    def _alloc(self, n: int) -> None:
        self._keys = np.zeros(n, dtype=np.uint64)
        self._vals = np.zeros(n, dtype=np.int32)
        self._state = np.zeros(n, dtype=np.uint8)
        self._mask = n - 1
        self._tombs = 0

    def __len__(self) -> int:
        return self._used

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes + self._state.nbytes

    # -- lookups -------------------------------------------------------------

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Bucket index of each key, or -1 where absent.

        Each round inspects a window of ``_WIN`` consecutive buckets per pending key, so
        almost every key resolves in the first round (a linear-probing run longer than
        8 is rare at load <= 0.5) and the numpy call overhead is paid ~once, not once
        per probe step of the slowest key.
        """
        n = keys.shape[0]
        out = np.full(n, -1, dtype=np.int64)
        if n == 0 or self._used == 0:
            return out
        mask = self._mask
        pos = (mix64(keys) & np.uint64(mask)).astype(np.int64)
        idx = np.arange(n)
        k = keys
        state, tkeys = self._state, self._keys
        while True:
            win = (pos[:, None] + _WINDOW) & mask
            hit = tkeys[win] == k[:, None]
            st = state[win]
            hit &= st == _USED
            hit_any = hit.any(axis=1)
            if hit_any.any():
                rows = np.flatnonzero(hit_any)
                out[idx[rows]] = win[rows, hit[rows].argmax(axis=1)]
            cont = ~hit_any & ~(st == _EMPTY).any(axis=1)
            if not cont.any():
                return out
            idx = idx[cont]
            k = k[cont]
            pos = pos[cont] + _WIN

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Values for ``keys`` (uint64 array) as int64, -1 where a key is absent."""
        b = self._find(keys)
        out = np.full(keys.shape[0], -1, dtype=np.int64)
        found = b >= 0
        out[found] = self._vals[b[found]]
        return out

    def get_one(self, key: int) -> int:
        """Scalar ``get`` (no array round trip for the common single-key case)."""
        if self._used == 0:
            return -1
        k = np.uint64(key)
        mask = self._mask
        pos = int(mix64(np.array([k], dtype=np.uint64))[0]) & mask
        state, tkeys = self._state, self._keys
        while True:
            st = state[pos]
            if st == _EMPTY:
                return -1
            if st == _USED and tkeys[pos] == k:
                return int(self._vals[pos])
            pos = (pos + 1) & mask

    # -- updates -------------------------------------------------------------

    def put(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert or overwrite. Keys must be distinct within one call."""
        n = keys.shape[0]
        if n == 0:
            return
        b = self._find(keys)
        found = b >= 0
        if found.any():
            self._vals[b[found]] = vals[found]
            if found.all():
                return
            keys = keys[~found]
            vals = vals[~found]
            n = keys.shape[0]
        if 2 * (self._used + self._tombs + n) > self._mask + 1:
            self._rebuild(self._used + n)
        self._insert_new(keys, vals)

    def _insert_new(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Place keys known to be absent into empty buckets (tombstones are left to
        the next rebuild, which keeps the probe loop to one condition)."""
        mask = self._mask
        pos = (mix64(keys) & np.uint64(mask)).astype(np.int64)
        idx = np.arange(keys.shape[0])
        state = self._state
        while idx.size:
            win = (pos[:, None] + _WINDOW) & mask
            emp = state[win] == _EMPTY
            has = emp.any(axis=1)
            # Rows without an empty bucket in their window move on by a window.
            first = np.where(has, win[np.arange(win.shape[0]), emp.argmax(axis=1)], -1)
            cand = np.flatnonzero(has)
            if cand.size:
                # Several pending keys may want the same empty bucket: one wins each.
                _, firsti = np.unique(first[cand], return_index=True)
                win_rows = cand[firsti]
                p = first[win_rows]
                state[p] = _USED
                self._keys[p] = keys[idx[win_rows]]
                self._vals[p] = vals[idx[win_rows]]
                self._used += win_rows.size
                keep = np.ones(idx.size, dtype=bool)
                keep[win_rows] = False
                # Losers retry from where they were (the won bucket is now used).
                adv = np.where(has, 0, _WIN)
                idx = idx[keep]
                pos = (pos + adv)[keep]
            else:
                pos = pos + _WIN

    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; returns a bool mask of those that were present."""
        b = self._find(keys)
        found = b >= 0
        if found.any():
            fb = np.unique(b[found])
            self._state[fb] = _TOMB
            self._used -= fb.size
            self._tombs += fb.size
            if self._tombs > (self._mask + 1) // 4 or (
                self._mask + 1 > 64 and 8 * self._used < self._mask + 1
            ):
                self._rebuild(self._used)
        return found

    def _rebuild(self, need: int) -> None:
        n = 16
        while n < 3 * need:  # land at ~1/3 full so the next growth is far away
            n *= 2
        live = self._state == _USED
        keys = self._keys[live]
        vals = self._vals[live]
        self._alloc(n)
        self._used = 0
        if keys.size:
            self._used = 0
            self._insert_new(keys, vals)

    def clear(self) -> None:
        self._alloc(16)
        self._used = 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (keys, values) as two arrays, in no particular order."""
        live = self._state == _USED
        return self._keys[live].copy(), self._vals[live].astype(np.int64)
