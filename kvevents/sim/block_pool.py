"""The GPU block pool with prefix caching, emitting GPU-tier KV events like vLLM's.

Blocks are reference counted by the requests using them. A full block gets its hash and
becomes cached (``BlockStored(medium="GPU")``); when its last user frees it, it stays
cached in the free queue and is reused least-recently-freed first, which evicts it
(``BlockRemoved``). ``reset()`` (only with no block in use) drops every cached block and
emits ``AllBlocksCleared``. Events are drained with ``take_events()``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvevents.wire.schema import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event

from kvevents.sim.request import Request


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Free blocks, oldest first; cached ones keep their hash until reused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[Event] = []

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest cached prefix of the request's blocks, leaving its last token to compute."""
        out = []
        for h in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        evicted = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                    evicted.append(h)
            self._ref[b] = 1
            out.append(b)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU, group_idx=0))
        return out

    def free(self, blocks: Sequence[int]) -> None:
        # Reverse order: a request's tail blocks are evicted before its head, which
        # other requests are likelier to share.
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        """Register the request's newly full blocks in the prefix cache."""
        start = request.num_cached_blocks
        if num_full_blocks <= start:
            return
        hashes = request.block_hashes
        new: list[bool] = []
        for i in range(start, num_full_blocks):
            h, b = hashes[i], request.block_ids[i]
            if h in self.cached or self._hash[b] is not None:
                new.append(False)  # same content already cached by another block
                continue
            self.cached[h] = b
            self._hash[b] = h
            new.append(True)
        request.num_cached_blocks = num_full_blocks
        bs = self.block_size
        tokens = request.all_token_ids
        i = 0
        while i < len(new):
            if not new[i]:
                i += 1
                continue
            j = i
            while j < len(new) and new[j]:
                j += 1
            a, z = start + i, start + j
            self._events.append(BlockStored(
                block_hashes=list(hashes[a:z]), parent_block_hash=hashes[a - 1] if a > 0 else None,
                token_ids=list(tokens[a * bs : z * bs]), block_size=bs, lora_id=None,
                medium=MEDIUM_GPU, lora_name=request.lora_name,
                extra_keys=[request.block_extra_keys] * (z - a), group_idx=0,
                kv_cache_spec_kind="full_attention",
            ))
            i = j

    def reset(self) -> bool:
        if any(self._ref):
            return False
        self.cached.clear()
        self._hash = [None] * self.num_blocks
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events
