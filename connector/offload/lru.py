"""Least-recently-used eviction: one ordered map, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from connector.offload.abstract import BlockStatus, EvictionPolicy, OffloadKey


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched evictable block first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        self._blocks[key] = status

    def remove(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        # Touch in reverse so that the first key of a prefix ends up most recent: a
        # prefix's head is needed by every request sharing it, its tail by fewer.
        for key in reversed(list(keys)):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        chosen = list(_evictable(self._blocks, protected, n))
        if len(chosen) < n:
            return None
        for key, _ in chosen:
            del self._blocks[key]
        return chosen

    def items(self) -> Iterable[tuple[OffloadKey, BlockStatus]]:
        return self._blocks.items()

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


def _evictable(
    blocks: OrderedDict[OffloadKey, BlockStatus], protected: set[OffloadKey], limit: int
) -> Iterator[tuple[OffloadKey, BlockStatus]]:
    """Up to ``limit`` evictable blocks in eviction order, without mutating ``blocks``."""
    found = 0
    for key, status in blocks.items():
        if found >= limit:
            return
        if status.evictable and key not in protected:
            found += 1
            yield key, status
