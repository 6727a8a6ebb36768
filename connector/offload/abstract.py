"""Interfaces of the scheduler-side offload manager (no tensors here).

Primitives, keyed by :class:`OffloadKey` = (block hash, KV group). An offloaded block may
span k engine blocks and is keyed by the hash of its *last* constituent engine block
(which, through the hash chain, identifies the whole prefix up to it).

Lifecycle of a load::

    lookup(keys) -> n            # longest leading run of *ready* offloaded blocks
    prepare_load(keys[:n])       # pins them: they cannot be evicted until ...
    ... worker copies CPU -> GPU ...
    complete_load(keys[:n])      # ... the load completes (success or not): unpinned

Lifecycle of a store::

    prepare_store(keys) -> PrepareStoreOutput | None
                                 # allocates CPU slots for keys not yet offloaded,
                                 # evicting unpinned ready blocks; None = cannot allocate
                                 # (nothing is changed then). New blocks are not ready.
    ... worker copies GPU -> CPU ...
    complete_store(keys, success)# success: blocks become ready (and visible to lookup);
                                 # failure: rolled back, slots freed, as if never stored.

``touch(keys)`` marks blocks recently used for the eviction policy. Changes of the
tier's contents are recorded as :class:`OffloadingEvent` and drained by the consumer with
``take_events()`` (never pushed): a store emits one when it completes successfully, an
eviction when it happens, so stored/removed events always describe ready blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class OffloadKey(NamedTuple):
    """An offloaded block: its last constituent engine block's hash and KV group."""

    block_hash: int
    group: int = 0


@dataclass
class BlockStatus:
    """Per offloaded block state kept by a policy.

    ``slot`` is the CPU pool slot; ``ref_cnt`` > 0 means pinned by in-flight loads;
    ``ready`` is False between ``prepare_store`` and a successful ``complete_store``
    (such a block is also never evicted: the worker may be writing its slot).
    """

    slot: int
    ref_cnt: int = 0
    ready: bool = False

    @property
    def evictable(self) -> bool:
        return self.ready and self.ref_cnt == 0


@dataclass(frozen=True)
class CPULoadStoreSpec:
    """Where blocks live in the CPU pool: one slot per offloaded block."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class PrepareStoreOutput:
    """Result of ``prepare_store``: what to copy, where, and what was evicted for it."""

    keys_to_store: tuple[OffloadKey, ...]
    store_spec: CPULoadStoreSpec
    evicted_keys: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class OffloadingEvent:
    """Offloaded blocks became ready (``removed`` False) or were evicted (True)."""

    keys: tuple[OffloadKey, ...]
    block_size: int  # tokens per offloaded block
    tier: str  # where the blocks live ("CPU")
    removed: bool


class EvictionPolicy(ABC):
    """Which blocks exist in the tier and in which order they are evicted.

    Policies own the key -> :class:`BlockStatus` map; the manager owns slots.
    """

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None: ...

    @abstractmethod
    def insert(self, key: OffloadKey, status: BlockStatus) -> None:
        """Add a new (not yet ready) block."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> BlockStatus | None:
        """Drop a block (rollback of a failed store); returns its status."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark blocks recently used (unknown keys are ignored)."""

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Remove and return ``n`` evictable blocks not in ``protected``.

        All or nothing: if fewer than ``n`` can be evicted, nothing changes and None is
        returned.
        """

    @abstractmethod
    def items(self) -> Iterable[tuple[OffloadKey, BlockStatus]]: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one offload tier. See the module docstring."""

    @abstractmethod
    def lookup(self, keys: Sequence[OffloadKey]) -> int: ...

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec: ...

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None: ...

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None: ...

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None: ...

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]: ...
