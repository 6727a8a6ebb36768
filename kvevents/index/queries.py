"""Inspection queries of :class:`~kvevents.index.PrefixIndex` (dashboards, debugging):
where an engine hash lives, an engine's blocks, the most shared prefixes.

Each works over what it is handed: the compiled :class:`Core`, the :class:`EngineIds`
table and the index lock (it knows nothing of the facade). Readers never stall the
writer: queries whose cost grows with the index read it in chunks of ``CHUNK`` slots
or table buckets, taking the lock once per chunk (tens of microseconds each), so
ingest runs between chunks. Such an answer is not an atomic snapshot while ingest
runs; on a quiet index it is exact. The facade keeps ``top_prefixes`` answers in a
:class:`PrefixCache` for ``PREFIX_TTL_S`` so clients polling it cost one scan a second
in all.
"""

from __future__ import annotations

import heapq
import threading
import time

from ..wire.schema import BlockHash
from ._core import Core
from .engine_ids import EngineIds
from .results import BlockHolder, BlockInfo, PrefixInfo

CHUNK = 16384
PREFIX_TTL_S = 1.0
PREFIX_CACHE_KEYS = 64
LEADING_TOKENS = 64
WALK_STEPS = 256
_MASK64 = (1 << 64) - 1


def hash64(h: BlockHash) -> int:
    """An engine hash reduced to 64 bits as the core does: ints modulo 2^64 (so signed
    int64 hashes map to their two's complement), bytes by their last 8 bytes."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:].rjust(8, b"\0"), "little")
    return h & _MASK64


def blocks_by_engine_hash(lock: threading.Lock, core: Core, engines: EngineIds,
                          block_hash: BlockHash) -> BlockInfo:
    h = hash64(block_hash)
    with lock:
        tn = core.tier_name
        holders: list[BlockHolder] = []
        best = None  # (depth, slot)
        for pid, name in enumerate(engines.names):
            if name is None:
                continue
            s = core.slot_of_hash(pid, h)
            if s < 0 or core.ns_info[core.slot_info(s)[3]][3]:
                continue  # unknown, or a salted sequence's: not shown
            tiers = {tn[t]: c for t in range(len(tn)) if (c := core.refcount(s, pid, t))}
            if tiers:
                holders.append(BlockHolder(engine=name, tiers=tiers))
                d = core.slot_info(s)[2]
                if best is None or d > best[0]:
                    best = (d, s)
        info = BlockInfo(engine_hash=block_hash, holders=sorted(holders, key=lambda x: x.engine))
        if best is not None:
            _key, _parent, depth, ns, toks = core.slot_info(best[1])
            info.model, info.block_size, info.lora_name, _private = core.ns_info[ns]
            info.depth = depth
            info.tokens = toks
    return info


def engine_hashes(lock: threading.Lock, core: Core, engines: EngineIds,
                  engine: str) -> dict[str, set[BlockHash]]:
    out: dict[str, set[BlockHash]] = {}
    start = 0
    while start >= 0:
        with lock:
            pid = engines.get(engine)
            if pid is None:
                return {}
            start, chunk = core.engine_entries(pid, start, CHUNK)
            signed = core.engine_signed(pid)
            orig = core.engine_orig[pid]
            tn = list(core.tier_name)
        for h, _slot, tmask in chunk:
            v = orig.get(h, h) if orig else h
            if signed and isinstance(v, int) and v >= 1 << 63:
                v -= 1 << 64
            t = 0
            while tmask:
                if tmask & 1:
                    out.setdefault(tn[t], set()).add(v)
                tmask >>= 1
                t += 1
    return out


class PrefixCache:
    """Recent ``top_prefixes`` answers by (model, limit), each valid for
    ``PREFIX_TTL_S``; at most ``PREFIX_CACHE_KEYS`` of them (the keys come from the
    query string: any model name, any limit). Owned by the facade, which clears it when
    an engine is dropped. Reads and writes are single dict operations."""

    def __init__(self) -> None:
        self._answers: dict[tuple[str | None, int], tuple[float, list[PrefixInfo]]] = {}

    def get(self, model: str | None, limit: int) -> list[PrefixInfo] | None:
        hit = self._answers.get((model, limit))
        if hit is not None and time.monotonic() - hit[0] < PREFIX_TTL_S:
            return hit[1]
        return None

    def put(self, model: str | None, limit: int, answer: list[PrefixInfo]) -> None:
        if len(self._answers) >= PREFIX_CACHE_KEYS:
            self._answers.clear()
        self._answers[(model, limit)] = (time.monotonic(), answer)

    def clear(self) -> None:
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._answers)


def top_prefixes(lock: threading.Lock, core: Core, engines: EngineIds, model: str | None,
                 limit: int) -> list[PrefixInfo]:
    """Two chunked passes over the slots (mark the parents a child dominates: held by
    as many engines, so never the longest extent; then keep the best undominated
    candidates), then candidates in score order, each checked alive and walked to its
    root under a short lock. (Uncached: the facade keeps answers in a
    :class:`PrefixCache`.)"""
    if limit <= 0:
        return []
    with lock:
        n = core.n_slot_hw
        # Salted sequences' namespaces are never shown.
        ns_filter = bytes(1 if (model is None or m == model) and not private else 0
                          for (m, _, _, private) in core.ns_info)
    dominated = bytearray(n)
    dom = memoryview(dominated)
    for start in range(0, n, CHUNK):
        with lock:
            core.scan_prefixes(start, CHUNK, ns_filter, dom, True)
    keep = max(4 * limit, limit + 64)
    heap: list[tuple[int, int, int]] = []
    for start in range(0, n, CHUNK):
        with lock:
            cand = core.scan_prefixes(start, CHUNK, ns_filter, dom, False)
        for c in cand:
            if len(heap) < keep:
                heapq.heappush(heap, c)
            elif c > heap[0]:
                heapq.heapreplace(heap, c)
    out: list[PrefixInfo] = []
    covered: set[int] = set()
    for score, slot, skey in sorted(heap, key=lambda c: (-c[0], c[1])):
        if len(out) >= limit:
            break
        if skey in covered:
            continue
        with lock:
            if not core.slot_alive(slot, skey):
                continue
            _k, parent, depth, ns, _t = core.slot_info(slot)
            names = engines.names
            holders = sorted(names[p] for p in core.holders(slot) if names[p] is not None)
            mdl, bs, lora, _private = core.ns_info[ns]
        # Walk to the root (WALK_STEPS blocks per lock hold): marks the sub-prefixes,
        # collects the leading tokens. A block freed meanwhile ends the walk.
        chain_toks: list[list[int] | None] = []
        cur, cur_key, d = slot, skey, depth
        while cur >= 0 and d > 0:
            with lock:
                for _ in range(WALK_STEPS):
                    if not core.slot_alive(cur, cur_key):
                        cur = -1
                        break
                    covered.add(cur_key)
                    _k, parent, d, _ns, toks = core.slot_info(cur)
                    if (d - 1) * bs < LEADING_TOKENS:
                        chain_toks.append(toks)
                    if d <= 1:
                        cur = -1
                        break
                    cur_key = parent
                    cur = core.slot_of_key(parent)
                    if cur < 0:
                        break
        lead: list[int] = []
        for toks in reversed(chain_toks):
            if toks is None or len(lead) >= LEADING_TOKENS:
                break
            lead.extend(toks)
        out.append(PrefixInfo(
            tokens=depth * bs, blocks=depth, block_size=bs, leading_tokens=lead[:LEADING_TOKENS],
            engines=holders, model=mdl, lora_name=lora,
        ))
    return out
