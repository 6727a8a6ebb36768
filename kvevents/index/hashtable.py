"""A compact uint64 -> int32 hash table operated on whole numpy arrays at a time.

Why not a ``dict``: a Python dict keyed by 64-bit ints costs ~90 bytes per entry (a
40-byte int object plus ~50 bytes of table), which alone would blow the index's memory
budget (TARGETS P4: <= 150 bytes per resident entry). This table keeps keys and values
in flat numpy arrays (12 bytes per bucket, at most 50% full: ~24-48 bytes per entry) and
answers a whole event's worth of keys per call, so the per-call numpy overhead is paid
once per event rather than once per block.

Design: open addressing with linear probing over a power-of-two bucket array. A bucket's
value column holds ``value + 1`` for a used bucket, 0 for an empty one and -1 for a
tombstone, so there is no separate state column (one gather less per probe). The home
bucket is Fibonacci hashing (the top bits of ``key * 0x9E37...``: two ufuncs instead of
a full 64-bit finaliser; engine hashes and content keys are already uniform, and the
multiply spreads sequential keys too).

Probing is vectorised and optimised for the numpy call count, which is what an event-
or prompt-sized call costs: every key first looks at its home bucket (most keys resolve
there at load <= 0.5); the few left over then inspect windows of ``_WIN`` consecutive
buckets per round. Inserts claim empty buckets by scatter-then-read-back (when several
new keys want the same bucket exactly one wins, no sort needed); losers move on. Deletions
leave tombstones; the table is rebuilt when used + tombstones exceeds half the buckets
(and shrunk when mostly empty), which keeps probes short.

Lifecycle: create, then ``get`` / ``put`` / ``delete`` / ``items``. Not thread-safe:
the owner (``PrefixIndex``) serialises access with its lock. Never raises on missing
keys: ``get`` answers -1 and ``delete`` returns a found mask.
"""

from __future__ import annotations

import numpy as np

_WIN = 8
_WINDOW = np.arange(_WIN, dtype=np.int64)
_MASK64 = (1 << 64) - 1
_FIB_INT = 0x9E3779B97F4A7C15
_FIB = np.uint64(_FIB_INT)

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

    __slots__ = ("_keys", "_vals", "_mask", "_shift", "_nshift", "_used", "_tombs")

    def __init__(self, capacity: int = 16) -> None:
        n = 16
        while n < 2 * capacity:
            n *= 2
        self._alloc(n)
        self._used = 0

    def _alloc(self, n: int) -> None:
        self._keys = np.zeros(n, dtype=np.uint64)
        # value + 1; 0 = empty, -1 = tombstone. np.zeros: calloc-backed, lazily mapped.
        self._vals = np.zeros(n, dtype=np.int32)
        self._mask = n - 1
        self._nshift = 64 - (n.bit_length() - 1)
        self._shift = np.uint64(self._nshift)
        self._tombs = 0

    def __len__(self) -> int:
        return self._used

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _FIB) >> self._shift).view(np.int64)

    # -- lookups -------------------------------------------------------------

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Bucket index of each key, or -1 where absent."""
        n = keys.shape[0]
        if n == 0 or self._used == 0:
            return np.full(n, -1, dtype=np.int64)
        pos = self._home(keys)
        tv = self._vals[pos]
        hit = self._keys[pos] == keys
        hit &= tv > 0
        if np.count_nonzero(hit) == n:
            return pos
        out = np.where(hit, pos, -1)
        # Keys neither found at home nor stopped by an empty home bucket probe on.
        rest = np.flatnonzero(~hit & (tv != 0))
        if rest.size:
            self._find_rest(keys, pos, rest, out)
        return out

    def _find_rest(self, keys: np.ndarray, pos: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
        """Window probing from the bucket after ``pos`` for keys ``idx``; fills ``out``."""
        mask = self._mask
        tv, tk = self._vals, self._keys
        k = keys[idx]
        p = pos[idx] + 1
        while True:
            win = (p[:, None] + _WINDOW) & mask
            v = tv[win]
            hit = tk[win] == k[:, None]
            hit &= v > 0
            hit_any = hit.any(axis=1)
            if hit_any.any():
                rows = np.flatnonzero(hit_any)
                out[idx[rows]] = win[rows, hit[rows].argmax(axis=1)]
            cont = ~hit_any & ~(v == 0).any(axis=1)
            if not cont.any():
                return
            idx = idx[cont]
            k = k[cont]
            p = p[cont] + _WIN

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Values for ``keys`` (uint64 array) as int64, -1 where a key is absent."""
        n = keys.shape[0]
        if n == 0 or self._used == 0:
            return np.full(n, -1, dtype=np.int64)
        pos = self._home(keys)
        tv = self._vals[pos]
        hit = self._keys[pos] == keys
        hit &= tv > 0
        if np.count_nonzero(hit) == n:
            return tv.astype(np.int64) - 1
        out = np.where(hit, tv - 1, -1).astype(np.int64)
        rest = np.flatnonzero(~hit & (tv != 0))
        if rest.size:
            b = np.full(n, -1, dtype=np.int64)
            self._find_rest(keys, pos, rest, b)
            found = np.flatnonzero(b >= 0)
            if found.size:
                out[found] = self._vals[b[found]] - 1
        return out

    def get_one(self, key: int) -> int:
        """Scalar ``get`` (pure Python: no array round trip for a single key)."""
        if self._used == 0:
            return -1
        key &= _MASK64
        mask = self._mask
        pos = ((key * _FIB_INT) & _MASK64) >> self._nshift
        tv, tk = self._vals, self._keys
        while True:
            v = int(tv[pos])
            if v == 0:
                return -1
            if v > 0 and int(tk[pos]) == key:
                return v - 1
            pos = (pos + 1) & mask

    # -- updates -------------------------------------------------------------

    def put(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert or overwrite. Keys must be distinct within one call."""
        n = keys.shape[0]
        if n == 0:
            return
        if self._used:
            b = self._find(keys)
            found = b >= 0
            nf = np.count_nonzero(found)
            if nf:
                self._vals[b[found]] = vals[found] + 1
                if nf == n:
                    return
                new = ~found
                keys = keys[new]
                vals = vals[new]
                n = keys.shape[0]
        if 2 * (self._used + self._tombs + n) > self._mask + 1:
            self._rebuild(self._used + n)
        self._insert_new(keys, vals)

    def _insert_new(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Place keys known to be absent (and distinct) into empty buckets (tombstones
        are left to the next rebuild, which keeps the probe loop to one condition)."""
        mask = self._mask
        tv, tk = self._vals, self._keys
        pos = self._home(keys)
        v1 = vals.astype(np.int32) + 1
        k = keys
        self._used += keys.shape[0]
        while True:
            emp = tv[pos] == 0
            ne = np.count_nonzero(emp)
            if ne == pos.shape[0]:
                # Every pending key has an empty bucket: claim by scatter + read back.
                tk[pos] = k
                won = tk[pos] == k
                nw = np.count_nonzero(won)
                if nw == ne:
                    tv[pos] = v1
                    return
                tv[pos[won]] = v1[won]
                lost = ~won
            elif ne:
                p = pos[emp]
                ke = k[emp]
                tk[p] = ke
                won_e = tk[p] == ke
                tv[p[won_e]] = v1[emp][won_e]
                lost = ~emp
                lost[np.flatnonzero(emp)[~won_e]] = True
            else:
                lost = None
            if lost is None:
                pos = (pos + 1) & mask
            else:
                k = k[lost]
                v1 = v1[lost]
                pos = (pos[lost] + 1) & mask

    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; returns a bool mask of those that were present."""
        b = self._find(keys)
        found = b >= 0
        nf = np.count_nonzero(found)
        if nf:
            fb = b[found] if nf != b.shape[0] else b
            if nf > 1:
                if nf <= 64:
                    if len(set(fb.tolist())) != nf:
                        fb = np.unique(fb)
                else:
                    fb = np.unique(fb)
            self._vals[fb] = -1
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
        live = self._vals > 0
        keys = self._keys[live]
        vals = self._vals[live] - 1
        self._alloc(n)
        self._used = 0
        if keys.size:
            self._insert_new(keys, vals)

    def clear(self) -> None:
        self._alloc(16)
        self._used = 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (keys, values) as two arrays, in no particular order."""
        live = self._vals > 0
        return self._keys[live].copy(), self._vals[live].astype(np.int64) - 1
