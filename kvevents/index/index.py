"""``PrefixIndex``: the aggregator's exact, reference-counted prefix index.

Pipeline of one ``apply_batch`` (events in order, each vectorised over its blocks)::

    BlockStored  -> content keys (keys.py, chained from the parent's key)
                 -> slots (store.py: content table)      -> refcount +1 per (pod, tier, slot)
                 -> pod map (podmap.py): engine hash -> slot
    BlockRemoved -> pod map -> slots -> refcount -1; the pod map entry goes with the
                    pod's last reference; the slot goes with the last holder
    AllBlocksCleared / drop_pod -> forget the pod's whole state

``lookup`` chains the prompt's full blocks from the namespace root in growing chunks and
stops as soon as no pod still matches, so its cost follows the prompt (and the match),
not the size of the index.

Namespaces: (model, block size, LoRA name) roots keep blocks apart. ``model`` is the
one ``apply_batch`` was given for the pod (events do not carry it).

Thread-safety: one writer (the ingest thread) and any number of readers (HTTP). Every
public method takes ``self.lock`` (a plain ``threading.Lock``, coarse on purpose: an
apply of one batch or one lookup holds it for tens to hundreds of microseconds, and
numpy releases nothing worth sharing). Callers may also hold ``lock`` themselves
around several calls for a consistent multi-call view (it is not re-entrant: do not
call index methods while holding it).

Failure: malformed events (wrong token count, hashes of odd types) never raise; they
are handled as token-less events or counted. Unknown removals are counted.
"""

from __future__ import annotations

import array
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    medium_of,
)
from .hashtable import mix64
from .keys import ContentHasher, digest64, extra_digests, hash64
from .podmap import PodMap, hashes_to_u64
from .results import (
    ApplyStats,
    BlockHolder,
    BlockInfo,
    EventCount,
    IndexCounters,
    LookupResult,
    PodMatch,
    PrefixInfo,
)
from .store import Residency

_FIRST_CHUNK = 128  # blocks keyed before the first early-exit check in lookup
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
# Token lists are packed with struct in pieces of this many ints: far faster than
# array/np.array on a list, and small enough that no piece needs a fresh mmap.
_PACK = 4096
_packers: dict[int, struct.Struct] = {}


def feeds_prefix_matching(event: BlockStored | BlockRemoved) -> bool:
    """Whether an event belongs to the full-attention group prefix matching uses.

    ``kv_cache_spec_kind``, when present (stores only), decides; otherwise group 0 (or
    no group) does. Removals carry only ``group_idx``, so a hybrid engine's group-0
    removals always apply; a removal for a block we never stored is just counted.
    """
    kind = getattr(event, "kv_cache_spec_kind", None)
    if kind is not None:
        return kind == "full_attention"
    return event.group_idx in (None, 0)


def _lora_of(ev: BlockStored) -> str | None:
    if ev.lora_name is not None:
        return ev.lora_name
    if ev.lora_id is not None:
        return f"lora_id:{ev.lora_id}"
    return None


class PrefixIndex:
    """Exact prefix index over the KV blocks every pod announces.

    Lifecycle: create once; feed each pod's batches in seq order with
    :meth:`apply_batch`; call :meth:`drop_pod` when a publisher restarts, loses events
    beyond replay, or is unsubscribed; query from any thread.
    """

    def __init__(self, keep_tokens: bool = True) -> None:
        """``keep_tokens``: keep each block's token ids (for ``blocks_by_engine_hash``
        and ``top_prefixes``; costs 4 bytes per token per distinct block)."""
        self.lock = threading.Lock()
        self._keep_tokens = keep_tokens
        self._hasher = ContentHasher()
        self._store = Residency()
        # Pods: name <-> small int id (the bit in the residency masks).
        self._pod_id: dict[str, int] = {}
        self._pod_name: list[str | None] = []
        self._free_pod_ids: list[int] = []
        # Pod ids in pod-name order (lookup's tie order), rebuilt when pods change.
        self._by_name: list[int] | None = None
        self._name_rank: list[int] = []
        self._maps: dict[int, PodMap] = {}
        # Tiers: medium name <-> id.
        self._tier_id: dict[str, int] = {}
        self._tier_name: list[str] = []
        # Namespaces: (model, block_size, lora_name) <-> id, with their roots.
        self._ns_id: dict[tuple[str | None, int, str | None], int] = {}
        self._ns: list[tuple[str | None, int, str | None]] = []
        self._ns_root: list[int] = []
        # Counters (monotonic, by pod name).
        self._applied: dict[tuple[str, str, str], list[int]] = {}
        self._unknown: dict[str, int] = {}
        self._orphans: dict[str, int] = {}
        self._ignored: dict[str, int] = {}

    # ------------------------------------------------------------------ registries

    def _pod(self, name: str) -> int:
        pid = self._pod_id.get(name)
        if pid is None:
            if self._free_pod_ids:
                pid = self._free_pod_ids.pop()
                self._pod_name[pid] = name
            else:
                pid = len(self._pod_name)
                self._pod_name.append(name)
            self._pod_id[name] = pid
            self._by_name = None
            self._maps[pid] = PodMap()
            self._store.ensure_pod(pid)
        return pid

    def _tier(self, name: str) -> int:
        tid = self._tier_id.get(name)
        if tid is None:
            tid = len(self._tier_name)
            self._tier_id[name] = tid
            self._tier_name.append(name)
            self._store.ensure_tier(tid)
        return tid

    def _namespace(self, model: str | None, block_size: int, lora: str | None) -> int:
        key = (model, block_size, lora)
        nid = self._ns_id.get(key)
        if nid is None:
            nid = len(self._ns)
            self._ns_id[key] = nid
            self._ns.append(key)
            self._ns_root.append(self._hasher.root(model, block_size, lora))
        return nid

    def _count(self, pod: str, tier: str, kind: str, blocks: int) -> None:
        c = self._applied.get((pod, tier, kind))
        if c is None:
            self._applied[(pod, tier, kind)] = [1, blocks]
        else:
            c[0] += 1
            c[1] += blocks

    # ------------------------------------------------------------------ ingest

    def apply_batch(
        self, pod: str, batch: KVEventBatch, model: str | None = None
    ) -> ApplyStats:
        """Apply one decoded batch of ``pod``'s events, in order.

        ``model`` names the pod's model (the namespace its blocks live in); the same pod
        should always be fed with the same model. Never raises on event content.
        """
        stats = ApplyStats()
        with self.lock:
            pid = self._pod(pod)
            for ev in batch.events:
                stats.events += 1
                if isinstance(ev, BlockStored):
                    if not feeds_prefix_matching(ev):
                        stats.ignored_events += 1
                        continue
                    self._stored(pod, pid, ev, model, stats)
                elif isinstance(ev, BlockRemoved):
                    if not feeds_prefix_matching(ev):
                        stats.ignored_events += 1
                        continue
                    self._removed(pod, pid, ev, stats)
                elif isinstance(ev, AllBlocksCleared):
                    self._forget(pid)
                    stats.cleared += 1
                    self._count(pod, "*", "AllBlocksCleared", 0)
            if stats.unknown_removals:
                self._unknown[pod] = self._unknown.get(pod, 0) + stats.unknown_removals
            if stats.orphan_blocks:
                self._orphans[pod] = self._orphans.get(pod, 0) + stats.orphan_blocks
            if stats.ignored_events:
                self._ignored[pod] = self._ignored.get(pod, 0) + stats.ignored_events
        return stats

    def _stored(
        self, pod: str, pid: int, ev: BlockStored, model: str | None, stats: ApplyStats
    ) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        medium = medium_of(ev)
        tier = self._tier(medium)
        self._count(pod, medium, "BlockStored", n)
        stats.stored_blocks += n
        pmap = self._maps[pid]
        h64, orig = hashes_to_u64(ev.block_hashes)
        # (Without reductions the originals are the uint64 values themselves.)
        if n > 1 and len(set(ev.block_hashes if orig is None else h64.tolist())) != n:
            # A hash repeated inside one event: apply it as separate one-block events
            # so each occurrence counts (rare; keeps the vector path simple).
            for i in range(n):
                self._stored(pod, pid, _one_block(ev, i), model, stats)
            self._applied[(pod, medium, "BlockStored")][0] -= n
            self._applied[(pod, medium, "BlockStored")][1] -= n
            stats.stored_blocks -= n
            return
        bs = ev.block_size
        lora = _lora_of(ev)
        store = self._store
        if bs > 0 and len(ev.token_ids) >= n * bs:
            ns = self._namespace(model, bs, lora)
            try:
                toks = _as_int64(ev.token_ids[: n * bs])
            except (TypeError, ValueError, OverflowError):
                toks = np.array(ev.token_ids[: n * bs], dtype=np.int64)
            if ev.parent_block_hash is None:
                start, parent_key, depth0 = self._ns_root[ns], 0, 1
            else:
                ph = hash64(ev.parent_block_hash)
                ps = pmap.table.get_one(ph)
                if ps >= 0:
                    start = parent_key = int(store.key[ps])
                    d = int(store.depth[ps])
                    depth0 = d + 1 if d else 0
                else:
                    # Unknown parent: a chain root no lookup from the sequence start
                    # can produce, but still a stable key so removals translate.
                    start = digest64("orphan", pod, ph, model, bs, lora)
                    parent_key, depth0 = 0, 0
            if depth0 == 0:
                stats.orphan_blocks += n
            mat = toks.reshape(n, bs)
            keys = self._hasher.chain(start, self._hasher.row_hashes(mat, extra_digests(ev.extra_keys, n)))
            slots = store.intern(keys, parent_key, depth0, ns, mat if self._keep_tokens else None)
            # A chain's keys are distinct, hence so are its slots.
            store.add(slots, pid, tier, distinct=True)
        else:
            # Token-less (e.g. legacy CPU offload) event: translate through the pod map.
            slots = pmap.table.get(h64)
            unk = (slots < 0).nonzero()[0]
            if unk.size:
                stats.orphan_blocks += int(unk.size)
                ns = self._namespace(model, 0, lora)
                salt = np.uint64(digest64("tokenless", pod, model, lora))
                keys = mix64(h64[unk] ^ salt)
                slots[unk] = store.intern(keys, 0, 0, ns, None)
            store.add(slots, pid, tier)
        pmap.table.put(h64, slots.astype(np.int32))
        pmap.remember(orig)

    def _removed(self, pod: str, pid: int, ev: BlockRemoved, stats: ApplyStats) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        medium = medium_of(ev)
        tier = self._tier(medium)
        self._count(pod, medium, "BlockRemoved", n)
        stats.removed_blocks += n
        pmap = self._maps[pid]
        h64, _ = hashes_to_u64(ev.block_hashes)
        slots = pmap.table.get(h64)
        known = slots >= 0
        nk = int(np.count_nonzero(known))
        stats.unknown_removals += n - nk
        if nk == 0:
            return
        if nk != n:
            h64 = h64[known]
            slots = slots[known]
        unknown, gone = self._store.remove(slots, pid, tier)
        stats.unknown_removals += unknown
        if gone.size:
            # Usually every removed block is gone (then no isin needed); the table's
            # delete tolerates repeated keys.
            if gone.size == slots.size and gone.size == len(set(slots.tolist())):
                dead = h64
            else:
                dead = h64[np.isin(slots, gone)]
            pmap.forget(dead)

    def _forget(self, pid: int) -> None:
        self._store.drop_pod(pid)
        self._maps[pid].clear()

    def drop_pod(self, pod: str) -> None:
        """Forget everything ``pod`` announced (publisher restart, unrecoverable gap,
        unsubscribe). Its counters are kept. Unknown pods are ignored."""
        with self.lock:
            pid = self._pod_id.pop(pod, None)
            if pid is None:
                return
            self._forget(pid)
            del self._maps[pid]
            self._pod_name[pid] = None
            self._free_pod_ids.append(pid)
            self._by_name = None

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        token_ids: Sequence[int] | np.ndarray,
        model: str | None = None,
        lora_name: str | None = None,
    ) -> LookupResult:
        """Per pod, how many leading tokens of the prompt are cached (any tier, and per
        tier), best first. ``model=None`` searches every model's namespaces."""
        # Tokens are converted chunk by chunk inside _match: with an early exit only the
        # examined part of a long prompt is paid for.
        toks = token_ids
        n_tok = len(toks)
        with self.lock:
            spaces = [
                i for i, (m, bs, lo) in enumerate(self._ns)
                if bs > 0 and lo == lora_name and (model is None or m == model)
            ]
            block_size = self._ns[spaces[0]][1] if spaces else 0
            names = self._pod_name
            tn = self._tier_name
            found = [
                (self._match(toks, ns, self._ns[ns][1]), self._ns[ns][1])
                for ns in spaces
                if n_tok >= self._ns[ns][1]
            ]
            found = [(ends, bs) for ends, bs in found if ends[0]]
            pods: list[PodMatch] = []
            if len(found) == 1 and len(found[0][0]) == 1:
                # One namespace, one tier (the common case): the tier's run is the
                # any-tier run. Sort plain tuples (C comparisons), then build Structs.
                ends, bs = found[0]
                tname = tn[0]
                by_name = self._by_name
                if by_name is None:
                    by_name = self._pod_order()
                rank = self._name_rank
                # Sort plain ints (blocks descending, then name): no tuples to build.
                order = sorted([rank[pid] - (b << 24) for pid, b in ends[0].items() if names[pid] is not None])
                for k in order:
                    name = names[by_name[k & 0xFFFFFF]]
                    t = -(k >> 24) * bs
                    pods.append(PodMatch(name, t, {tname: t}, bs))  # type: ignore[arg-type]
            elif found:
                best: dict[int, tuple[int, dict[str, int], int]] = {}
                for ends, bs in found:
                    single = len(ends) == 1
                    for pid, blocks in ends[0].items():
                        t = blocks * bs
                        cur = best.get(pid)
                        if cur is None or t > cur[0]:
                            if single:
                                tiers = {tn[0]: t}
                            else:
                                tiers = {
                                    tn[j]: e[pid] * bs for j, e in enumerate(ends[1:]) if pid in e
                                }
                            best[pid] = (t, tiers, bs)
                # (Pod names are unique: comparisons never reach the third element.)
                order2 = sorted(
                    [(-t, names[pid], (tiers, bs)) for pid, (t, tiers, bs) in best.items() if names[pid] is not None]
                )
                for negt, name, (tiers, bs) in order2:
                    pods.append(PodMatch(name, -negt, tiers, bs))  # type: ignore[arg-type]
        if pods:
            block_size = pods[0].block_size
        return LookupResult(
            prompt_tokens=n_tok, block_size=block_size, pods=pods, model=model, lora_name=lora_name
        )

    def _pod_order(self) -> list[int]:
        """Pod ids sorted by pod name (and each id's rank in that order)."""
        names = self._pod_name
        by_name = sorted((pid for pid, n in enumerate(names) if n is not None), key=lambda p: names[p])
        rank = [0] * len(names)
        for i, pid in enumerate(by_name):
            rank[pid] = i
        self._name_rank = rank
        self._by_name = by_name
        return by_name

    def _match(self, toks: Sequence[int] | np.ndarray, ns: int, bs: int) -> list[dict[int, int]]:
        """Leading matched blocks per pod: ``[{pod id: blocks in any tier}, {pod id:
        blocks in tier 0}, ...]``, pods with no match left out. With a single tier the
        list holds only the any-tier dict (the tier's runs are the same).

        All tiers are handled at once: one gather of every tier's masks per chunk, one
        running AND over (any tier, tier 0, tier 1, ...) columns, and Python work only
        for the rows where some pod's run ends. With a single tier, "any tier" is that
        tier and is not computed twice.
        """
        store = self._store
        masks = store.masks
        words = store.words
        n_blocks = len(toks) // bs
        ntier = len(masks)
        if ntier == 0 or n_blocks == 0:
            return [{}]
        ncol = 1 if ntier == 1 else ntier + 1  # column groups: any, then per tier
        carry = np.full((1, ncol * words), _ALL_ONES, dtype=np.uint64)
        ends: list[dict[int, int]] = [{} for _ in range(ncol)]
        start = self._ns_root[ns]
        hasher = self._hasher
        content = store.content
        off = 0
        chunk = _FIRST_CHUNK
        while off < n_blocks:
            c = min(chunk, n_blocks - off)
            keys = hasher.keys(start, _as_int64(toks[off * bs : (off + c) * bs]), bs)
            start = int(keys[-1])
            slots = content.get_leading(keys)
            stop = False
            if slots.shape[0] != c:
                c = slots.shape[0]
                stop = True
            if c:
                if ntier == 1:
                    g = masks[0][slots]  # (c, words)
                else:
                    per = [m[slots] for m in masks]
                    anym = np.bitwise_or.reduce(per) if ntier > 1 else per[0]
                    g = np.concatenate([anym, *per], axis=1)  # (c, ncol * words)
                run = np.bitwise_and.accumulate(np.concatenate([carry, g]), axis=0)
                if words == 1 and ncol == 1:
                    changed = (run[1:, 0] != run[:-1, 0]).nonzero()[0]
                else:
                    changed = np.logical_or.reduce(run[1:] != run[:-1], axis=1).nonzero()[0]
                if changed.size:
                    before = run[changed].tolist()
                    after = run[changed + 1].tolist()
                    for r, b_row, a_row in zip(changed.tolist(), before, after):
                        length = off + r
                        if not length:
                            continue  # runs of length 0 are not matches
                        for col in range(ncol * words):
                            dropped = b_row[col] & ~a_row[col]
                            if dropped:
                                j, w = divmod(col, words)
                                _record_bits(ends[j], dropped, w * 64, length)
                carry = run[-1:]
            off += c
            if stop or not np.count_nonzero(carry[0, :words]):
                break
            chunk *= 4
        if off:
            crow = carry[0].tolist()
            for col in range(ncol * words):
                if crow[col]:
                    j, w = divmod(col, words)
                    _record_bits(ends[j], crow[col], w * 64, off)
        return ends

    # ------------------------------------------------------------------ queries

    def blocks_by_engine_hash(self, block_hash: BlockHash) -> BlockInfo:
        """Where an engine block hash lives: every pod holding it (with per-tier reference
        counts) and, when known, its tokens and namespace."""
        h = hash64(block_hash)
        with self.lock:
            holders: list[BlockHolder] = []
            first_slot = -1
            for pid, pmap in self._maps.items():
                s = pmap.table.get_one(h)
                if s < 0:
                    continue
                tiers = {
                    self._tier_name[t]: self._store.count(s, pid, t)
                    for t in range(len(self._tier_name))
                    if self._store.holds(s, pid, t)
                }
                if tiers:
                    holders.append(BlockHolder(pod=self._pod_name[pid], tiers=tiers))  # type: ignore[arg-type]
                    if first_slot < 0 or self._store.depth[s] > self._store.depth[first_slot]:
                        first_slot = s
            info = BlockInfo(engine_hash=block_hash, holders=sorted(holders, key=lambda x: x.pod))
            if first_slot >= 0:
                model, bs, lora = self._ns[int(self._store.ns[first_slot])]
                info.model, info.block_size, info.lora_name = model, bs, lora
                info.depth = int(self._store.depth[first_slot])
                if bs and self._keep_tokens:
                    info.tokens = self._store.tokens[first_slot, :bs].tolist()
        return info

    def top_prefixes(self, model: str | None = None, limit: int = 10) -> list[PrefixInfo]:
        """The most widely cached prefixes: ordered by number of pods holding them, then
        length. A prefix is reported at its longest extent with that many holders; its
        shorter sub-prefixes are not repeated. Costs O(distinct blocks): for dashboards,
        not per request."""
        with self.lock:
            st = self._store
            n = st.n_slots
            if n == 0 or not st.masks:
                return []
            anym = st.masks[0][:n].copy()
            for m in st.masks[1:]:
                anym |= m[:n]
            npods = np.bitwise_count(anym).sum(axis=1).astype(np.int64)
            ok = (st.depth[:n] > 0) & (npods > 0)
            if model is not None:
                nss = [i for i, (m, _, _) in enumerate(self._ns) if m == model]
                ok &= np.isin(st.ns[:n], nss)
            cand = np.flatnonzero(ok)
            score = npods[cand] * 65536 + st.depth[cand].astype(np.int64)
            order = cand[np.argsort(-score, kind="stable")]
            out: list[PrefixInfo] = []
            covered: set[int] = set()
            for s in order.tolist():
                if len(out) >= limit:
                    break
                k = int(st.key[s])
                if k in covered:
                    continue
                # Walk to the root: marks the sub-prefixes, collects the leading tokens.
                chain: list[int] = []
                cur = s
                while cur >= 0:
                    chain.append(cur)
                    covered.add(int(st.key[cur]))
                    if st.depth[cur] <= 1:
                        break
                    cur = st.content.get_one(int(st.parent[cur]))
                mdl, bs, lora = self._ns[int(st.ns[s])]
                lead: list[int] = []
                if self._keep_tokens:
                    for c in reversed(chain):
                        lead.extend(st.tokens[c, :bs].tolist())
                        if len(lead) >= 64:
                            break
                pods = [
                    self._pod_name[w * 64 + b]
                    for w in range(st.words)
                    for b in range(64)
                    if (int(anym[s, w]) >> b) & 1 and self._pod_name[w * 64 + b] is not None
                ]
                d = int(st.depth[s])
                out.append(PrefixInfo(
                    tokens=d * bs, blocks=d, block_size=bs, leading_tokens=lead[:64],
                    pods=sorted(pods), model=mdl, lora_name=lora,  # type: ignore[arg-type]
                ))
            return out

    def pod_block_counts(self, pod: str) -> dict[str, int]:
        """Resident blocks of ``pod`` per tier (medium name); {} for an unknown pod."""
        with self.lock:
            pid = self._pod_id.get(pod)
            if pid is None or pid >= self._store.counts.shape[0]:
                return {}
            row = self._store.counts[pid]
            return {self._tier_name[t]: int(row[t]) for t in range(len(self._tier_name)) if row[t]}

    def engine_hashes(self, pod: str) -> dict[str, set[BlockHash]]:
        """Engine hashes ``pod`` holds now, per tier, as the engine sent them. For
        exactness checks against an engine's true cache contents."""
        with self.lock:
            pid = self._pod_id.get(pod)
            if pid is None:
                return {}
            hashes, slots = self._maps[pid].items()
            out: dict[str, set[BlockHash]] = {}
            w, bit = divmod(pid, 64)
            for t, m in enumerate(self._store.masks):
                held = (m[slots, w] >> np.uint64(bit)) & np.uint64(1)
                sel = np.flatnonzero(held)
                if sel.size:
                    out[self._tier_name[t]] = {hashes[i] for i in sel.tolist()}
            return out

    def pods(self) -> list[str]:
        """Pods with state in the index (fed at least once and not dropped)."""
        with self.lock:
            return sorted(self._pod_id)

    def counters(self) -> IndexCounters:
        """Snapshot of the counters and sizes."""
        with self.lock:
            return IndexCounters(
                applied=[
                    EventCount(pod=p, tier=t, type=k, events=c[0], blocks=c[1])
                    for (p, t, k), c in sorted(self._applied.items())
                ],
                unknown_removals=dict(self._unknown),
                orphan_blocks=dict(self._orphans),
                ignored_events=dict(self._ignored),
                resident_entries=int(self._store.counts.sum()),
                distinct_blocks=self._store.live_slots,
            )

    def memory_bytes(self) -> int:
        """Bytes held in the index's numpy arrays (excludes Python object overhead)."""
        with self.lock:
            return self._store.nbytes() + sum(m.nbytes for m in self._maps.values())
    # PROVISIONAL (snapshot branch): the lead's index core provides these two; this
    # pickle of the instance's state stands in so the snapshot code can be tested.
    def export_state(self) -> bytes:
        """The whole index state as bytes, for :meth:`import_state`."""
        import pickle

        with self.lock:
            state = {k: v for k, v in self.__dict__.items() if k != "lock"}
            return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def import_state(self, data: bytes) -> None:
        """Replace the whole state with ``data`` from :meth:`export_state`; raises
        ``ValueError`` on bad data (and then changes nothing)."""
        import pickle

        try:
            state = pickle.loads(data)
        except Exception as exc:
            raise ValueError(f"not an index state: {exc}") from None
        expected = {k for k in self.__dict__ if k != "lock"}
        if not isinstance(state, dict) or set(state) != expected:
            raise ValueError("not an index state: wrong fields")
        with self.lock:
            self.__dict__.update(state)



def _as_int64(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as an int64 array. ``struct.pack`` over pieces of a list is 2-3x
    faster than ``array.array`` / ``np.asarray`` (which box-check item by item through
    slower paths); anything struct refuses (non-ints, out of range) falls back to the
    array conversion, which raises or converts exactly as before."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False)
    n = len(tokens)
    try:
        if n <= _PACK:
            p = _packers.get(n)
            if p is None:
                p = _packers[n] = struct.Struct(f"={n}q")
            return np.frombuffer(p.pack(*tokens), dtype=np.int64)
        parts = []
        for i in range(0, n, _PACK):
            piece = tokens[i : i + _PACK]
            m = len(piece)
            p = _packers.get(m)
            if p is None:
                p = _packers[m] = struct.Struct(f"={m}q")
            parts.append(p.pack(*piece))
        return np.frombuffer(b"".join(parts), dtype=np.int64)
    except (struct.error, TypeError):
        return np.frombuffer(array.array("q", tokens), dtype=np.int64)


# _BYTE_BITS[v]: the set bit positions of byte value v (bit scans by table lookup:
# a lookup answer often has all 64 pods of a word set).
_BYTE_BITS = [tuple(b for b in range(8) if v >> b & 1) for v in range(256)]


def _record_bits(ends: dict[int, int], word: int, base: int, length: int) -> None:
    """Set ``ends[base + bit] = length`` for each set bit of ``word`` (a pod's run
    ends once: its bit drops out of the running AND for good)."""
    if word & (word - 1) == 0:  # a single pod
        ends[base + word.bit_length() - 1] = length
        return
    for i, byte in enumerate(word.to_bytes(8, "little")):
        if byte:
            b0 = base + 8 * i
            for b in _BYTE_BITS[byte]:
                ends[b0 + b] = length


def _one_block(ev: BlockStored, i: int) -> BlockStored:
    """Block ``i`` of a stored event as its own one-block event (parent = block i-1)."""
    bs = ev.block_size
    parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
    toks: list[Any] = ev.token_ids[i * bs : (i + 1) * bs] if bs else []
    extra = [ev.extra_keys[i]] if ev.extra_keys and i < len(ev.extra_keys) else None
    return BlockStored(
        block_hashes=[ev.block_hashes[i]], parent_block_hash=parent, token_ids=toks,
        block_size=bs, lora_id=ev.lora_id, medium=ev.medium, lora_name=ev.lora_name,
        extra_keys=extra, group_idx=ev.group_idx, kv_cache_spec_kind=ev.kv_cache_spec_kind,
    )
