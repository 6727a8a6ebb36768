"""Adaptive Replacement Cache (Megiddo & Modha) eviction.

Resident blocks are split into T1 (seen once since insertion) and T2 (touched again);
ghost lists B1 / B2 remember keys recently evicted from each. A re-inserted key found in
a ghost list shifts the target size ``p`` of T1 toward the list that would have kept it,
so the policy adapts between recency (one-off long prompts) and frequency (shared system
prompts). Pinned or not-yet-ready blocks are skipped, never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from connector.offload.abstract import BlockStatus, EvictionPolicy, OffloadKey


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._t1.get(key) or self._t2.get(key)

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        if key in self._b1:
            # A recency miss: T1 was too small.
            self.p = min(float(self.capacity), self.p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = status
        elif key in self._b2:
            # A frequency miss: T2 was too small.
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = status
        else:
            self._t1[key] = status

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        status = self._t1.pop(key, None)
        return status if status is not None else self._t2.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            status = self._t1.pop(key, None)
            if status is not None:
                self._t2[key] = status
            elif key in self._t2:
                self._t2.move_to_end(key)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        # Choose all victims first without mutating, so that failure changes nothing.
        it1, it2 = _evictable(self._t1, protected), _evictable(self._t2, protected)
        t1_len, t2_len = len(self._t1), len(self._t2)
        chosen: list[tuple[OffloadKey, BlockStatus, bool]] = []  # (key, status, from_t1)
        while len(chosen) < n:
            prefer_t1 = t1_len > 0 and t1_len >= max(1.0, self.p)
            order = ((it1, True), (it2, False)) if prefer_t1 else ((it2, False), (it1, True))
            for it, from_t1 in order:
                victim = next(it, None)
                if victim is not None:
                    chosen.append((*victim, from_t1))
                    if from_t1:
                        t1_len -= 1
                    else:
                        t2_len -= 1
                    break
            else:
                return None
        for key, _, from_t1 in chosen:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        # Ghost lists remember at most ``capacity`` keys each: bounded state.
        for ghost in (self._b1, self._b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [(k, s) for k, s, _ in chosen]

    def items(self) -> Iterable[tuple[OffloadKey, BlockStatus]]:
        yield from self._t1.items()
        yield from self._t2.items()

    def clear(self) -> None:
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def _evictable(
    blocks: OrderedDict[OffloadKey, BlockStatus], protected: set[OffloadKey]
) -> Iterator[tuple[OffloadKey, BlockStatus]]:
    for key, status in blocks.items():
        if status.evictable and key not in protected:
            yield key, status
