"""Turns the offload manager's raw events into wire events, reference-counted.

Lifecycle: the core's scheduler side (:class:`OffloadPlanner`) calls :meth:`snapshot` when a chunk (offloaded
block) is scheduled for storing, while its request is alive and its tokens are at hand;
:meth:`translate` then converts drained :class:`OffloadingEvent` s:

* a chunk stored -> ``BlockStored(medium="CPU")`` carrying its k constituent engine
  hashes, parent hash, the chunk's tokens, the per-block ``block_size``, LoRA name and
  extra keys (self-describing), for the constituents whose count goes 0 -> 1 only;
* a chunk evicted -> ``BlockRemoved(medium="CPU")`` for its constituents whose count
  goes 1 -> 0 (the fan-out).

Chunks overlapping a shared, non-chunk-aligned prefix share constituent hashes; the
per-hash counts (one tracker per tier) make each engine block announced once and removed once.
A failed store drops its snapshot (:meth:`discard`). State is bounded by the CPU pool:
one constituent tuple per resident chunk, one count per resident engine block, and
snapshots only for in-flight stores. :meth:`reset` clears everything (the engine
announces ``AllBlocksCleared``).

With ``self_describing=False`` it emits vLLM's old-style events instead: the chunk key
only, ``token_ids=[]``, no parent, ``block_size=0`` (for comparison).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvevents.wire.schema import BlockRemoved, BlockStored, Event

from connector.offload.abstract import OffloadingEvent, OffloadKey


@dataclass(frozen=True)
class ChunkPayload:
    """What a self-describing event needs about one offloaded chunk."""

    block_hashes: tuple[int, ...]  # constituent engine block hashes, in order
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # block_size * len(block_hashes) tokens
    block_size: int  # engine block size
    lora_name: str | None
    extra_keys: tuple[Any, ...]  # one per constituent block


class OffloadEventsTracker:
    """Reference-counted wire events of one tier (``tier``: "CPU", the events' ``medium``)."""

    def __init__(self, tier: str, self_describing: bool = True, group_idx: int = 0) -> None:
        self.tier = tier
        self.self_describing = self_describing
        self.group_idx = group_idx
        self._snapshots: dict[OffloadKey, ChunkPayload] = {}
        self._resident: dict[OffloadKey, tuple[int, ...]] = {}  # hashes counted per chunk
        self._members: dict[OffloadKey, tuple[int, ...]] = {}  # true constituents per chunk
        self._counts: dict[int, int] = {}
        self.orphan_events = 0  # stored keys without a snapshot (announced by key only)

    def snapshot(self, key: OffloadKey, payload: ChunkPayload) -> None:
        self._snapshots[key] = payload

    def discard(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self._snapshots.pop(key, None)

    def translate(self, events: Sequence[OffloadingEvent]) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            for key in ev.keys:
                if ev.removed:
                    out.extend(self._removed(key))
                else:
                    out.extend(self._stored(key))
        return out

    def constituents(self, key: OffloadKey) -> tuple[int, ...]:
        return self._members.get(key, (key.block_hash,))

    def announced_hashes(self) -> set[int]:
        return set(self._counts)

    def reset(self) -> None:
        self._snapshots.clear()
        self._resident.clear()
        self._members.clear()
        self._counts.clear()

    # -- internals -----------------------------------------------------------

    def _stored(self, key: OffloadKey) -> list[Event]:
        payload = self._snapshots.pop(key, None)
        if payload is None:
            self.orphan_events += 1
        members = payload.block_hashes if payload is not None else (key.block_hash,)
        if key in self._resident:  # re-store of a resident chunk: nothing changes
            return []
        self._members[key] = members
        # Old-style events name the chunk by its key only, so that is what is counted.
        hashes = members if self.self_describing else (key.block_hash,)
        self._resident[key] = hashes
        if not self.self_describing or payload is None:
            new = [h for h in hashes if self._incr(h)]
            if not new:
                return []
            return [BlockStored(
                block_hashes=new,
                parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                medium=self.tier, lora_name=None, group_idx=self.group_idx,
            )]
        fresh = [self._incr(h) for h in hashes]
        # One event per run of consecutive newly-counted blocks, so that each event's
        # hashes, parent and tokens stay a valid chain segment.
        events: list[Event] = []
        bs = payload.block_size
        i = 0
        n = len(hashes)
        while i < n:
            if not fresh[i]:
                i += 1
                continue
            j = i
            while j < n and fresh[j]:
                j += 1
            parent = payload.parent_block_hash if i == 0 else hashes[i - 1]
            events.append(BlockStored(
                block_hashes=list(hashes[i:j]), parent_block_hash=parent,
                token_ids=list(payload.token_ids[i * bs : j * bs]), block_size=bs,
                lora_id=None, medium=self.tier, lora_name=payload.lora_name,
                extra_keys=list(payload.extra_keys[i:j]), group_idx=self.group_idx,
                kv_cache_spec_kind="full_attention",
            ))
            i = j
        return events

    def _removed(self, key: OffloadKey) -> list[Event]:
        self._snapshots.pop(key, None)
        self._members.pop(key, None)
        hashes = self._resident.pop(key, None)
        if hashes is None:
            return []
        gone = [h for h in hashes if self._decr(h)]
        if not gone:
            return []
        return [BlockRemoved(block_hashes=gone, medium=self.tier, group_idx=self.group_idx)]

    def _incr(self, h: int) -> bool:
        c = self._counts.get(h, 0)
        self._counts[h] = c + 1
        return c == 0

    def _decr(self, h: int) -> bool:
        c = self._counts.get(h, 0)
        if c <= 1:
            self._counts.pop(h, None)
            return c == 1
        self._counts[h] = c - 1
        return False
