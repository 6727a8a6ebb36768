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
new keys want the same bucket exactly one wins, no sort needed); losers move on.
``probe`` + ``claim`` (and ``put``) reuse the lookup's probe: an absent key's probe ends
at the empty bucket an insert would take, so most inserts cost no second probe. Deletions
leave tombstones; the table is rebuilt when used + tombstones exceeds half the buckets
(and shrunk when mostly empty), which keeps probes short.

Lifecycle: create, then ``get`` / ``put`` / ``delete`` / ``items``. Not thread-safe:
the owner (``PrefixIndex``) serialises access with its lock. Never raises on missing
keys: ``get`` answers -1 and ``delete`` returns a found mask.
"""

from __future__ import annotations

import numpy as np

_WIN = 8
_SMALL = 32  # keys per call up to which _find probes windows from the home bucket
_WINDOW = np.arange(_WIN, dtype=np.int64)
_MASK64 = (1 << 64) - 1
# Direct ufunc reductions: ndarray.any/all go through a Python-level wrapper (~1-2 us).
_any1 = np.logical_or.reduce
_all1 = np.logical_and.reduce
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

    def _find(self, keys: np.ndarray, hint: np.ndarray | None = None) -> np.ndarray:
        """Bucket index of each key, or -1 where absent. With ``hint`` (an int64 array
        of -1s), absent keys also get the empty bucket their probe stopped at: where an
        insert would put them (see :meth:`_claim`).

        Up to ``_SMALL`` keys: windows from the home bucket (one round resolves almost
        every key: a displacement of ``_WIN`` or more is ~0.3% at load <= 0.5). More
        keys: the home bucket alone first (~3/4 of keys resolve there, and 1-D ops on
        it cost far less than the 2-D window ops), then windows for the rest. Measured
        on event- and prompt-sized calls (100-2,000 keys), home-first wins by ~20%.
        """
        n = keys.shape[0]
        if n == 0 or self._used == 0:
            return np.full(n, -1, dtype=np.int64)
        pos = self._home(keys)
        if n <= _SMALL:
            out = np.full(n, -1, dtype=np.int64)
            self._find_win(keys, pos, None, out, hint)
            return out
        tv = self._vals[pos]
        hit = self._keys[pos] == keys
        hit &= tv > 0
        if np.count_nonzero(hit) == n:
            return pos
        out = np.where(hit, pos, -1)
        if hint is not None:
            e = (tv == 0).nonzero()[0]
            hint[e] = pos[e]
        # Keys neither found at home nor stopped by an empty home bucket probe on.
        rest = (~hit & (tv != 0)).nonzero()[0]
        if rest.size:
            self._find_win(keys[rest], pos[rest] + 1, rest, out, hint)
        return out

    def _find_win(
        self, k: np.ndarray, p: np.ndarray, idx: np.ndarray | None, out: np.ndarray,
        hint: np.ndarray | None = None,
    ) -> None:
        """Window probing from buckets ``p`` for keys ``k`` (rows ``idx`` of ``out``,
        all rows when None); writes each found key's bucket into ``out``."""
        mask = self._mask
        tv, tk = self._vals, self._keys
        while True:
            win = (p[:, None] + _WINDOW) & mask
            v = tv[win]
            hit = tk[win] == k[:, None]
            hit &= v > 0
            hit_any = _any1(hit, axis=1)
            rows = hit_any.nonzero()[0]
            if rows.size:
                b = win[rows, hit[rows].argmax(axis=1)]
                out[rows if idx is None else idx[rows]] = b
            full = _all1(v, axis=1)  # no empty bucket in the window: go on
            cont = ~hit_any
            if hint is not None:
                # Absent keys: the window's first empty bucket ends their probe.
                er = (cont & ~full).nonzero()[0]
                if er.size:
                    eb = win[er, (v[er] == 0).argmax(axis=1)]
                    hint[er if idx is None else idx[er]] = eb
            cont &= full
            if not np.count_nonzero(cont):
                return
            if idx is None:
                idx = cont.nonzero()[0]
            else:
                idx = idx[cont]
            k = k[cont]
            p = p[cont] + _WIN

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Values for ``keys`` (uint64 array) as int64, -1 where a key is absent."""
        b = self._find(keys)
        out = self._vals[b].astype(np.int64)
        out -= 1
        out[b < 0] = -1
        return out

    def get_leading(self, keys: np.ndarray) -> np.ndarray:
        """Values (int32) of the leading run of ``keys`` that are present: stops
        before the first absent key (what a prefix walk needs, minus get's fix-ups)."""
        b = self._find(keys)
        found = b >= 0
        if np.count_nonzero(found) != b.shape[0]:
            b = b[: int(found.argmin())]
        out = self._vals[b]
        out -= 1
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

    def insert_new(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert keys the caller knows are absent and distinct (skips the lookup that
        ``put`` does first)."""
        n = keys.shape[0]
        if n == 0:
            return
        if 2 * (self._used + self._tombs + n) > self._mask + 1:
            self._rebuild(self._used + n)
        self._insert_new(keys, vals)

    def put(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert or overwrite. Keys must be distinct within one call."""
        n = keys.shape[0]
        if n == 0:
            return
        got, hint = self.probe(keys)
        found = got >= 0
        nf = np.count_nonzero(found)
        if nf == 0:
            self._claim(keys, vals, hint)
            return
        b = self._find(keys[found])  # rare (re-announced blocks): a second lookup is fine
        self._vals[b] = vals[found] + 1
        if nf != n:
            new = ~found
            self._claim(keys[new], vals[new], hint[new])

    def probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``get`` plus, per absent key, an insertion hint for :meth:`claim`. Makes
        room first, so that claiming up to ``len(keys)`` keys needs no rebuild."""
        n = keys.shape[0]
        if 2 * (self._used + self._tombs + n) > self._mask + 1:
            self._rebuild(self._used + n)
        hint = np.full(n, -1, dtype=np.int64)
        b = self._find(keys, hint)
        out = self._vals[b].astype(np.int64)
        out -= 1
        out[b < 0] = -1
        return out, hint

    def claim(self, keys: np.ndarray, vals: np.ndarray, hint: np.ndarray) -> None:
        """Insert absent, distinct keys with the hints :meth:`probe` just gave them (no
        table change in between)."""
        if keys.shape[0]:
            self._claim(keys, vals, hint)

    def _claim(self, keys: np.ndarray, vals: np.ndarray, hint: np.ndarray) -> None:
        """Each key takes its hinted empty bucket, by scatter + read back (several keys
        may hint the same bucket: one wins); the rest go through ``_insert_new``."""
        tk, tv = self._keys, self._vals
        n = keys.shape[0]
        ok = hint >= 0
        nok = np.count_nonzero(ok)
        if nok != n:
            rest = ~ok
            self._insert_new(keys[rest], vals[rest])
            if not nok:
                return
            keys, vals, hint = keys[ok], vals[ok], hint[ok]
            n = nok
        tk[hint] = keys
        won = tk[hint] == keys
        nw = np.count_nonzero(won)
        if nw == n:
            tv[hint] = vals + 1
            self._used += n
            return
        tv[hint[won]] = vals[won] + 1
        self._used += nw
        lost = ~won
        self._insert_new(keys[lost], vals[lost])

    def _insert_new(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Place keys known to be absent (and distinct) into empty buckets (tombstones
        are left to the next rebuild, which keeps the probe loop to one condition).

        Each round, every pending key targets the first empty bucket in its window of
        ``_WIN`` buckets and claims it by scatter + read back: where several keys target
        one bucket exactly one wins, and the losers retry the same window (whose next
        empty bucket is now their first). Keys whose window is full move on a window.
        """
        mask = self._mask
        tv, tk = self._vals, self._keys
        pos = self._home(keys)
        v1 = vals.astype(np.int32) + 1
        k = keys
        self._used += keys.shape[0]
        while True:
            emp = tv[(pos[:, None] + _WINDOW) & mask] == 0
            first = emp.argmax(axis=1)
            m = pos.shape[0]
            has = emp[np.arange(m), first]
            nh = np.count_nonzero(has)
            tgt = (pos + first) & mask
            if nh == m:
                tk[tgt] = k
                won = tk[tgt] == k
                nw = np.count_nonzero(won)
                if nw == m:
                    tv[tgt] = v1
                    return
                tv[tgt[won]] = v1[won]
                pend = ~won
            else:
                hi = has.nonzero()[0]
                p = tgt[hi]
                kh = k[hi]
                tk[p] = kh
                won = tk[p] == kh
                tv[p[won]] = v1[hi[won]]
                pend = np.ones(m, dtype=bool)
                pend[hi[won]] = False
                # Full windows move on by a window; losers retry theirs.
                pos = pos + np.where(has, 0, _WIN)
            k = k[pend]
            v1 = v1[pend]
            pos = pos[pend]

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
        # In pieces: the probe windows of a whole table's keys would be large temporaries.
        for i in range(0, keys.shape[0], 1 << 16):
            self._insert_new(keys[i : i + (1 << 16)], vals[i : i + (1 << 16)])

    def clear(self) -> None:
        self._alloc(16)
        self._used = 0

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (keys, values) as two arrays, in no particular order."""
        live = self._vals > 0
        return self._keys[live].copy(), self._vals[live].astype(np.int64) - 1
