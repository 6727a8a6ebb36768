"""Residency: which (pod, tier) holds which content block, with reference counts.

Every distinct content key gets a small integer *slot*. Per slot the store keeps flat
numpy columns (key, parent key, depth, namespace, tokens) and, per tier, a pod bitmask
(``W`` uint64 words, so any number of pods). A (pod, tier, slot) entry is present while
its reference count is > 0; the count is the bit itself (count 1) plus, only for the
rare counts above 1 (re-announced blocks), an entry in a side dict. That keeps a resident
entry to about one bit plus the slot's shared columns, which is what TARGETS P4 needs.

A slot is freed (its key leaves the content table and the slot number is reused) when no
pod holds it in any tier. Children keep their parent's *key*, not its slot number, so a
freed-and-reused slot can never be mistaken for a live parent.

Lifecycle: owned by one ``PrefixIndex``; pods are small ints allocated by the caller.
Not thread-safe (the index's lock serialises writers against readers). Never raises on
unknown data: removals of absent entries are reported back as counts.
"""

from __future__ import annotations

import numpy as np

from .hashtable import U64Table

_ONE = np.uint64(1)
_BIT = [np.uint64(1 << i) for i in range(64)]


class Residency:
    """Slots, per-tier pod bitmasks and reference counts."""

    def __init__(self, capacity: int = 1024) -> None:
        self.content = U64Table(capacity)
        self._cap = 0
        self.n_slots = 0  # high-water mark of slot numbers handed out
        self._free: list[int] = []
        self.words = 1  # uint64 words per pod bitmask
        self.tok_width = 16
        self.key = np.zeros(0, dtype=np.uint64)
        self.parent = np.zeros(0, dtype=np.uint64)  # parent's content key (0: none)
        self.depth = np.zeros(0, dtype=np.uint16)  # 1 = first block; 0 = not on a root chain
        self.ns = np.zeros(0, dtype=np.uint16)  # namespace id (model, block size, lora)
        self.extra = np.zeros(0, dtype=np.uint16)  # number of side refcount entries
        self.tokens = np.zeros((0, self.tok_width), dtype=np.uint32)
        self.masks: list[np.ndarray] = []  # per tier: (cap, words) uint64
        # (slot, pod, tier) -> count - 1, only for counts > 1.
        self.refs: dict[tuple[int, int, int], int] = {}
        # resident entries per (pod, tier): grown on demand.
        self.counts = np.zeros((0, 0), dtype=np.int64)
        self._grow(capacity)

    # -- storage management ----------------------------------------------------

    def _grow(self, need: int) -> None:
        cap = max(need, self._cap + self._cap // 2, 1024)

        def ext(a: np.ndarray) -> np.ndarray:
            # np.zeros is calloc-backed: pages beyond what we copy stay unmapped, so
            # spare capacity costs address space, not RSS.
            b = np.zeros((cap,) + a.shape[1:], dtype=a.dtype)
            b[: a.shape[0]] = a
            return b

        self.key = ext(self.key)
        self.parent = ext(self.parent)
        self.depth = ext(self.depth)
        self.ns = ext(self.ns)
        self.extra = ext(self.extra)
        self.tokens = ext(self.tokens)
        self.masks = [ext(m) for m in self.masks]
        self._cap = cap

    def ensure_tier(self, tier: int) -> None:
        while len(self.masks) <= tier:
            self.masks.append(np.zeros((self._cap, self.words), dtype=np.uint64))
        self._ensure_counts(self.counts.shape[0], tier + 1)

    def ensure_pod(self, pod: int) -> None:
        if pod >= 64 * self.words:
            words = pod // 64 + 1
            self.masks = [
                np.concatenate(
                    [m, np.zeros((m.shape[0], words - m.shape[1]), dtype=np.uint64)], axis=1
                )
                for m in self.masks
            ]
            self.words = words
        self._ensure_counts(pod + 1, self.counts.shape[1])

    def _ensure_counts(self, pods: int, tiers: int) -> None:
        p, t = self.counts.shape
        if pods > p or tiers > t:
            c = np.zeros((max(p, pods), max(t, tiers)), dtype=np.int64)
            c[:p, :t] = self.counts
            self.counts = c

    def _ensure_tok_width(self, width: int) -> None:
        if width > self.tok_width:
            t = np.zeros((self._cap, width), dtype=np.uint32)
            t[:, : self.tok_width] = self.tokens
            self.tokens = t
            self.tok_width = width

    def _alloc(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        k = min(n, len(self._free))
        if k:
            out[:k] = self._free[-k:]
            del self._free[-k:]
        rest = n - k
        if rest:
            if self.n_slots + rest > self._cap:
                self._grow(self.n_slots + rest)
            out[k:] = np.arange(self.n_slots, self.n_slots + rest)
            self.n_slots += rest
        return out

    @property
    def live_slots(self) -> int:
        return self.n_slots - len(self._free)

    # -- slots -----------------------------------------------------------------

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        """Slot per content key, -1 where unknown."""
        return self.content.get(keys)

    def intern(
        self,
        keys: np.ndarray,
        parent_key: int,
        first_depth: int,
        ns: int,
        tokens: np.ndarray | None,
    ) -> np.ndarray:
        """Slots for a chained run of keys, creating the missing ones.

        ``parent_key`` is the key before ``keys[0]`` (0 for a root or unknown parent);
        ``first_depth`` is the depth of ``keys[0]`` (0: not on a verified root chain);
        ``tokens`` is the (n, block_size) token matrix or None.
        """
        slots, hint = self.content.probe(keys)
        new = (slots < 0).nonzero()[0]
        nn = new.shape[0]
        if nn:
            n = keys.shape[0]
            s = self._alloc(nn)
            everything = nn == n  # common: a fresh run (skip the [new] gathers)
            if everything:
                slots = s
                knew = keys
            else:
                slots[new] = s
                knew = keys[new]
            # Just looked up: these keys are absent (and distinct: a chain's keys are).
            self.content.claim(knew, s.astype(np.int32), hint if everything else hint[new])
            self.key[s] = knew
            par = np.empty(n, dtype=np.uint64)
            par[0] = parent_key
            par[1:] = keys[:-1]
            self.parent[s] = par if everything else par[new]
            if first_depth:
                self.depth[s] = np.minimum(first_depth + new, 65535)
            else:
                self.depth[s] = 0
            self.ns[s] = ns
            self.extra[s] = 0
            if tokens is not None and tokens.shape[1]:
                self._ensure_tok_width(tokens.shape[1])
                self.tokens[s, : tokens.shape[1]] = tokens if everything else tokens[new]
        return slots

    def _free_empty(self, slots: np.ndarray) -> int:
        """Free those of ``slots`` that no pod holds in any tier."""
        if not slots.size:
            return 0
        held = np.zeros(slots.shape[0], dtype=bool)
        for m in self.masks:
            held |= m[slots].any(axis=1)
        dead = np.unique(slots[~held])
        if dead.size:
            self.content.delete(self.key[dead])
            self._free.extend(dead.tolist())
        return int(dead.size)

    # -- reference counts --------------------------------------------------------

    def add(self, slots: np.ndarray, pod: int, tier: int, distinct: bool = False) -> int:
        """Count one more reference of (pod, tier) to each slot (duplicates allowed;
        ``distinct``: the caller knows there are none). Returns how many entries became
        present."""
        if slots.size == 0:
            return 0
        w, bit = divmod(pod, 64)
        b = _BIT[bit]
        m = self.masks[tier]
        u, cnt = (slots, None)
        # A set is cheaper than np.unique for event-sized arrays; duplicates are rare.
        if not distinct and slots.size > 1 and len(set(slots.tolist())) != slots.size:
            u, cnt = np.unique(slots, return_counts=True)
        mc = m[:, w]  # 1-D column view: its fancy indexing is ~2x cheaper than m[u, w]
        col = mc[u]
        had = (col & b) != 0
        mc[u] = col | b
        new_present = int(u.size - np.count_nonzero(had))
        self.counts[pod, tier] += new_present
        if cnt is None and new_present == u.size:
            return new_present
        # Extra references: re-announced entries, and repeats within this call.
        extra = had.astype(np.int64)
        if cnt is not None:
            extra += cnt - 1
        for i in extra.nonzero()[0].tolist():
            s = int(u[i])
            key = (s, pod, tier)
            old = self.refs.get(key)
            if old is None:
                self.refs[key] = int(extra[i])
                self.extra[s] += 1
            else:
                self.refs[key] = old + int(extra[i])
        return new_present

    def remove(self, slots: np.ndarray, pod: int, tier: int) -> tuple[int, np.ndarray]:
        """Drop one reference of (pod, tier) per slot (duplicates allowed, applied in
        turn). Returns (unknown removals, slots that the pod no longer holds in any
        tier). Slots left with no holder are freed."""
        if slots.size == 0:
            return 0, slots
        w, bit = divmod(pod, 64)
        b = _ONE << np.uint64(bit)
        m = self.masks[tier]
        unknown = 0
        if slots.size > 1 and len(set(slots.tolist())) != slots.size:
            u, cnt = np.unique(slots, return_counts=True)
        else:
            u, cnt = slots, np.ones(slots.size, dtype=np.int64)
        mc = m[:, w]  # 1-D column view (cheaper fancy indexing)
        col = mc[u]
        had = (col & b) != 0
        unknown += int(np.count_nonzero(~had))
        u = u[had]
        cnt = cnt[had]
        # Entries with a side count absorb removals before their bit goes.
        clear = np.ones(u.size, dtype=bool)
        side = ((self.extra[u] > 0) | (cnt > 1)).nonzero()[0]
        for i in side.tolist():
            s = int(u[i])
            c = int(cnt[i])
            key = (s, pod, tier)
            extra = self.refs.get(key, 0)
            if c <= extra:
                if c == extra:
                    del self.refs[key]
                    self.extra[s] -= 1
                else:
                    self.refs[key] = extra - c
                clear[i] = False
            else:
                if extra:
                    del self.refs[key]
                    self.extra[s] -= 1
                unknown += c - extra - 1
        gone = u[clear]
        if gone.size:
            mc[gone] &= ~b
            self.counts[pod, tier] -= gone.size
            still = np.zeros(gone.size, dtype=bool)
            for t, mt in enumerate(self.masks):
                if t != tier:
                    still |= (mt[gone, w] & b) != 0
            gone = gone[~still]
            self._free_empty(gone)
        return unknown, gone

    def holds(self, slot: int, pod: int, tier: int) -> bool:
        w, bit = divmod(pod, 64)
        return bool((int(self.masks[tier][slot, w]) >> bit) & 1)

    def count(self, slot: int, pod: int, tier: int) -> int:
        if not self.holds(slot, pod, tier):
            return 0
        return 1 + self.refs.get((slot, pod, tier), 0)

    def drop_pod(self, pod: int) -> None:
        """Forget everything ``pod`` holds, in every tier."""
        if pod >= 64 * self.words:
            return
        w, bit = divmod(pod, 64)
        nb = ~(_ONE << np.uint64(bit))
        n = self.n_slots
        touched = np.zeros(n, dtype=bool)
        for t, m in enumerate(self.masks):
            col = m[:n, w]
            touched |= (col >> np.uint64(bit)) & _ONE != 0
            m[:n, w] = col & nb
        if pod < self.counts.shape[0]:
            self.counts[pod, :] = 0
        for key in [k for k in self.refs if k[1] == pod]:
            del self.refs[key]
            self.extra[key[0]] -= 1
        self._free_empty(np.flatnonzero(touched))

    def pod_slots(self, pod: int, tier: int) -> np.ndarray:
        """Slots that ``pod`` holds in ``tier``."""
        if tier >= len(self.masks) or pod >= 64 * self.words:
            return np.empty(0, dtype=np.int64)
        w, bit = divmod(pod, 64)
        col = self.masks[tier][: self.n_slots, w]
        return np.flatnonzero((col >> np.uint64(bit)) & _ONE)

    def nbytes(self) -> int:
        arrays = [self.key, self.parent, self.depth, self.ns, self.extra, self.tokens]
        return sum(a.nbytes for a in arrays + self.masks) + self.content.nbytes
