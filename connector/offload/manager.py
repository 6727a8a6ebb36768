"""The CPU-tier offload manager: slot allocation on top of an eviction policy.

Scheduler side only: it never touches tensors. Single-threaded by contract (the engine's
scheduler loop owns it). See :mod:`connector.offload.abstract` for the lifecycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvevents.wire.schema import MEDIUM_CPU

from connector.offload.abstract import (
    BlockStatus,
    CPULoadStoreSpec,
    EvictionPolicy,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)
from connector.offload.arc import ARCPolicy
from connector.offload.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


class CPUOffloadingManager(OffloadingManager):
    """Manages ``num_slots`` CPU slots of ``block_size`` tokens each.

    Failure modes: ``prepare_load`` of a key that is not ready raises ``KeyError`` (a
    caller bug: it must come from ``lookup``); ``complete_*`` of unknown keys is ignored
    (the blocks were rolled back or reset meanwhile); ``prepare_store`` returns None when
    too few blocks can be evicted, leaving everything unchanged.
    """

    def __init__(
        self, num_slots: int, block_size: int, policy: str = "lru", tier: str = MEDIUM_CPU
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {sorted(POLICIES)}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.tier = tier
        self.policy: EvictionPolicy = POLICIES[policy](num_slots)
        # Free slots, popped from the end: allocating ascending slot numbers keeps a
        # fresh pool contiguous, which lets the transfer handler copy whole runs at once.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._events: list[OffloadingEvent] = []

    @property
    def num_used(self) -> int:
        """Slots holding a block (stored, being stored, or pinned)."""
        return self.num_slots - len(self._free)

    # -- loads -----------------------------------------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        n = 0
        for key in keys:
            status = self.policy.get(key)
            if status is None or not status.ready:
                break
            n += 1
        return n

    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        statuses = []
        for key in keys:
            status = self.policy.get(key)
            if status is None or not status.ready:
                raise KeyError(f"block {key} is not ready in the CPU tier")
            statuses.append(status)
        for status in statuses:
            status.ref_cnt += 1
        return CPULoadStoreSpec(tuple(s.slot for s in statuses))

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            status = self.policy.get(key)
            if status is not None and status.ref_cnt > 0:
                status.ref_cnt -= 1

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.touch(keys)

    # -- stores ----------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        seen: set[OffloadKey] = set()
        new_keys: list[OffloadKey] = []
        for key in keys:
            if key not in seen and self.policy.get(key) is None:
                new_keys.append(key)
            seen.add(key)
        need = len(new_keys) - len(self._free)
        evicted: list[tuple[OffloadKey, BlockStatus]] = []
        if need > 0:
            # Never evict a block this very call asks to keep (it is being reused).
            victims = self.policy.evict(need, protected=seen)
            if victims is None:
                return None
            evicted = victims
            self._free.extend(s.slot for _, s in evicted)
            self._events.append(
                OffloadingEvent(tuple(k for k, _ in evicted), self.block_size, self.tier, True)
            )
        slots = []
        for key in new_keys:
            slot = self._free.pop()
            self.policy.insert(key, BlockStatus(slot=slot))
            slots.append(slot)
        return PrepareStoreOutput(
            tuple(new_keys), CPULoadStoreSpec(tuple(slots)), tuple(k for k, _ in evicted)
        )

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        done: list[OffloadKey] = []
        for key in keys:
            status = self.policy.get(key)
            if status is None or status.ready:
                continue
            if success:
                status.ready = True
                done.append(key)
            else:
                # Rollback: the slot may hold partial data; forget the block entirely.
                self.policy.remove(key)
                self._free.append(status.slot)
        if done:
            self._events.append(OffloadingEvent(tuple(done), self.block_size, self.tier, False))

    # -- inspection ------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def ready_keys(self) -> list[OffloadKey]:
        return [k for k, s in self.policy.items() if s.ready]

    def num_free_slots(self) -> int:
        return len(self._free)

    def busy(self) -> bool:
        """True while any block is pinned by a load or awaits its store's completion."""
        return any(s.ref_cnt > 0 or not s.ready for _, s in self.policy.items())

    def reset(self) -> bool:
        """Drop every block (no events: the engine announces ``AllBlocksCleared``).

        Refused (returns False) while transfers are in flight.
        """
        if self.busy():
            return False
        self.policy.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._events.clear()
        return True
