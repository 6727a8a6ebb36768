"""``PrefixIndex``: the aggregator's exact, reference-counted prefix index.

A small facade over the compiled core (``_core.pyx``), which does all the per-event,
per-block and per-token work::

    apply_batches(engine, batches) ─► Core.apply_batches: one call per part of a group
                                      (every event, in order; wire batches without the GIL)
    lookup(tokens)          ─► Core.lookup: one call per lookup (every namespace asked)
    queries.py              ─► inspection (top prefixes, an engine's blocks) in short chunks
    state.py                ─► snapshot / restore of the whole index

The facade owns what is per engine *name* (ids: ``engine_ids.py``; counters kept across
drops: ``counts.py``), the top-prefix cache and the lock. ``queries.py`` and ``state.py``
are handed the core, the engine ids and the lock (or are called under it) and return
values the facade stores; they never import this module.

Namespaces: (model, block size, LoRA name) roots keep blocks apart; ``model`` is the
one ``apply_batch`` was given for the engine (events do not carry it). Their number is
capped in total and per engine; tiers are capped too. An event beyond a cap, or
with hashes or tokens of the wrong type or range, is refused whole, counted by reason
(``counters().refused_events``) and logged at most once a minute per engine and reason;
the rest of its batch applies.

The ingest lane: :meth:`sink` gives an engine's :class:`~kvevents.index._core.WireSink`,
through which the subscriber's compiled pass applies that engine's common batches
straight from the received messages, without the GIL, taking ``self.lock`` per batch;
the sink also keeps the engine's anchor (the last batch applied, by either path), and
:meth:`export_state_with_anchors` reads them under the same lock as the state.

Thread-safety: one writer (the ingest thread) and any number of readers (HTTP). Every
public method takes ``self.lock`` (a :class:`~kvevents.index._core.NogilLock`, used like
``threading.Lock``; compiled code takes it without the GIL) for a time bounded by
its own input: one batch, one prompt, or one chunk of an inspection query; nothing
holds it for a time that grows with the index. ``lookup(..., blocking=False)`` raises
:class:`IndexBusy` instead of waiting, so an event loop can hand the wait to a thread.
Callers may hold ``lock`` themselves around several calls (it is not re-entrant: do not
call index methods while holding it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ..wire.schema import BlockHash, BlockRemoved, BlockStored, KVEventBatch
from . import queries, state
from ._core import Core, NogilLock, WireBatch, WireSink, extra_digest
from .counts import Counts, all_counts, fold
from .engine_ids import EngineIds
from .media import MediaItem, block_extras, tower_items
from .results import (
    best_of,
    ApplyStats,
    add_stats,
    BlockInfo,
    EventCount,
    IndexCounters,
    LookupResult,
    EngineMatch,
    PrefixInfo,
)

log = logging.getLogger(__name__)

_REFUSAL_LOG_INTERVAL_S = 60.0

# apply_batches releases the lock after about this many bytes of wire batches (~0.1 ms
# of core work here), so a lookup never waits behind a whole ingest group. A decoded
# batch counts as _DECODED_BATCH_BYTES.
_HOLD_BYTES = 16 << 10
_DECODED_BATCH_BYTES = 2048


class IndexBusy(RuntimeError):
    """``lookup(blocking=False)`` found the index lock taken."""


def feeds_prefix_matching(event: BlockStored | BlockRemoved) -> bool:
    """Whether an event belongs to the full-attention group prefix matching uses.

    ``kv_cache_spec_kind``, when present (stores only), decides; otherwise group 0 (or
    no group) does. Removals carry only ``group_idx``, so a hybrid engine's group-0
    removals always apply; a removal for a block we never stored is just counted.
    (The core applies the same rule; this is for callers that filter events.)
    """
    kind = getattr(event, "kv_cache_spec_kind", None)
    if kind is not None:
        return kind == "full_attention"
    return event.group_idx in (None, 0)


class PrefixIndex:
    """Exact prefix index over the KV blocks every engine announces.

    Lifecycle: create once; feed each engine's batches in seq order with
    :meth:`apply_batch`; call :meth:`drop_engine` when a publisher restarts, loses events
    beyond replay, or is unsubscribed; query from any thread.
    """

    def __init__(
        self,
        keep_tokens: bool = True,
        *,
        max_namespaces: int = 4096,
        max_namespaces_per_engine: int = 256,
        max_tiers: int = 8,
        max_block_sizes: int = 8,
        max_namespaces_per_pod: int | None = None,
    ) -> None:
        """``keep_tokens``: keep the tokens of the blocks within each sequence's first
        64 tokens (what ``top_prefixes`` and ``blocks_by_engine_hash`` show).
        ``max_namespaces`` / ``max_namespaces_per_engine``: caps on distinct (model, block
        size, LoRA) namespaces; ``max_tiers``: cap on distinct tiers (at most 8);
        ``max_block_sizes``: cap on block sizes per (model, LoRA), which bounds what a
        lookup tries. ``max_namespaces_per_pod``: deprecated old name of
        ``max_namespaces_per_engine`` (engines were called pods), used when given."""
        if max_namespaces_per_pod is not None:
            max_namespaces_per_engine = max_namespaces_per_pod
        self.lock = NogilLock()
        self._sinks: dict[str, WireSink] = {}
        self._limits = (keep_tokens, max_namespaces, max_namespaces_per_engine, max_tiers,
                        max_block_sizes)
        self._reset()

    def _reset(self) -> None:
        for sink in self._sinks.values():
            sink.invalidate()  # bound to the core being replaced
        self._sinks = {}
        self._core = Core(*self._limits)
        self._engines = EngineIds()
        # Counters of engines' past lives by name (monotonic, kept across drops); the live
        # engines' own are in the core, per id, and added in by counts.all_counts.
        self._counts = Counts()
        self._refusal_logged: dict[tuple[str, str], float] = {}
        # Lookup's namespace lists, extended as the core creates namespaces.
        self._ns_seen = 0
        self._by_model: dict[tuple[str | None, str | None, bool], list[tuple[int, int]]] = {}
        self._by_lora: dict[tuple[str | None, bool], list[tuple[int, int]]] = {}
        self._prefix_cache = queries.PrefixCache()

    # ------------------------------------------------------------------ ingest

    def apply_batch(
        self, engine: str, batch: KVEventBatch, model: str | None = None
    ) -> ApplyStats:
        """Apply one decoded batch of ``engine``'s events, in order.

        ``model`` names the engine's model (the namespace its blocks live in); the same engine
        should always be fed with the same model. Never raises on event content: bad
        events are refused and counted, the rest apply.
        """
        return self.apply_batches(engine, [batch], model)

    def apply_batches(
        self, engine: str, batches: list[KVEventBatch | WireBatch], model: str | None = None
    ) -> ApplyStats:
        """:meth:`apply_batch` for consecutive batches of ``engine``, in order (the
        ingest loop's path), in as few core calls as the lock's hold bound allows: the
        lock is released after about ``_HOLD_BYTES`` of batches, so a lookup waits for
        at most that much work however large the group (each batch is applied whole
        under one hold; readers may see a group's first batches before its last). The
        stats are their sum. An exception leaves the batches before the failing one
        applied. Accepts :class:`~kvevents.index.wire.WireBatch` (applied from its bytes
        without the GIL) as well as decoded batches."""
        total: ApplyStats | None = None
        start, n = 0, len(batches)
        while start < n:
            stop, size = start, 0
            while stop < n and (stop == start or size < _HOLD_BYTES):
                b = batches[stop]
                size += len(b.payload) if type(b) is WireBatch else _DECODED_BATCH_BYTES
                stop += 1
            part = batches if stop - start == n else batches[start:stop]
            with self.lock:
                pid = self._engines.get(engine)
                if pid is None:
                    pid, salt = self._engines.add(engine)
                    self._core.ensure_engine(pid, salt)
                stats = self._core.apply_batches(pid, part, model)
                if stats.refused_events:
                    self._log_refusal(engine)
            total = stats if total is None else add_stats(total, stats)
            start = stop
        return total if total is not None else ApplyStats()

    def sink(self, engine: str, model: str | None = None,
             lag_bounds: Sequence[float] = ()) -> WireSink:
        """``engine``'s :class:`~kvevents.index._core.WireSink` (made on first use,
        creating the engine's id like a first batch would): the lane's way in, and the
        keeper of the engine's anchor. ``model`` as for :meth:`apply_batches`;
        ``lag_bounds``: bucket bounds of the apply-lag histogram it keeps. Valid until
        the engine is dropped or the index replaced; call its ``refresh()`` before each
        drain (on the ingest thread)."""
        with self.lock:
            sink = self._sinks.get(engine)
            if sink is None:
                pid = self._engines.get(engine)
                if pid is None:
                    pid, salt = self._engines.add(engine)
                    self._core.ensure_engine(pid, salt)
                sink = self._sinks[engine] = WireSink(self._core, self.lock, pid, model,
                                                      tuple(lag_bounds))
            return sink

    def _log_refusal(self, engine: str) -> None:
        detail = self._core.last_refusal
        reason = detail[0] if detail else "refused"
        now = time.monotonic()
        last = self._refusal_logged.get((engine, reason))
        if last is None or now - last >= _REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged[(engine, reason)] = now
            log.warning("engine %s: refused %s event(s) (%s; next such message in %.0f s at "
                        "the earliest; counts in counters().refused_events)", engine, reason,
                        detail[1] if detail else reason, _REFUSAL_LOG_INTERVAL_S)

    def drop_engine(self, engine: str, *, forget: bool = False) -> None:
        """Forget everything ``engine`` announced (publisher restart, unrecoverable gap,
        unsubscribe). Its counters are kept, unless ``forget`` (unsubscribed: nothing of
        the name is kept, so engines that come and go leave no trace). Unknown engines
        are ignored."""
        with self.lock:
            sink = self._sinks.pop(engine, None)
            if sink is not None:
                sink.invalidate()
            pid = self._engines.get(engine)
            if pid is not None:
                if not forget:
                    fold(self._core, engine, pid, self._counts)  # its counters outlive its id
                self._core.reset_counters(pid)
                self._engines.remove(engine)
                self._core.clear_engine(pid)
                self._prefix_cache.clear()
            if forget:
                past = self._counts
                for key in [k for k in past.applied if k[0] == engine]:
                    del past.applied[key]
                for per_engine in (past.unknown, past.orphans, past.ignored, past.refused):
                    per_engine.pop(engine, None)
                for key in [k for k in self._refusal_logged if k[0] == engine]:
                    del self._refusal_logged[key]

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        token_ids: Sequence[int] | Any,
        model: str | None = None,
        lora_name: str | None = None,
        *,
        cache_salt: str | None = None,
        media: Sequence[MediaItem] = (),
        blocking: bool = True,
        timeout: float = -1,
    ) -> LookupResult:
        """Per engine, how many leading tokens of the prompt are cached (any tier, and per
        tier), best first. ``model=None`` searches every model's namespaces.

        The prompt's identity is the engines': ``lora_name`` the adapter it runs under,
        ``cache_salt`` its tenant's salt (vLLM keys the first block with it; an empty
        salt is none, as in vLLM). Only blocks stored under the same identity match:
        a salted lookup searches only salted sequences, an unsalted one never them.
        ``media``: the prompt's multimodal items (:func:`~kvevents.index.media.media_items`):
        the blocks they cover match only blocks stored under the same items at the same
        places (:mod:`kvevents.index.media`); under an adapter, also as an engine with
        ``--enable-tower-connector-lora`` keys them (a second pass over the blocks).

        ``token_ids``: a list of ints, or an int64 / int32 / uint32 buffer (numpy
        array, ``array('q')``); list items are converted (and checked) as matching
        reaches them. Raises ``ValueError`` for a token outside int64, and
        :class:`IndexBusy` when the lock is taken and ``blocking`` is false, or still
        taken after ``timeout`` seconds (-1: wait as long as it takes). The writer holds
        the lock for one part of a group at a time (see :meth:`apply_batches`), so waits
        are short while ingest runs."""
        if not (self.lock.acquire(True, timeout) if blocking else self.lock.acquire(False)):
            raise IndexBusy("index busy" if not blocking else f"index busy for {timeout} s")
        try:
            spaces = self._spaces(model, lora_name, bool(cache_salt))
            extras = None
            if media and spaces:
                n = len(token_ids)
                extras = {bs: block_extras(media, bs, n // bs, cache_salt) for bs in {b for _, b in spaces}}
            salt = extra_digest((cache_salt,)) if cache_salt else 0
            engines_out = self._core.lookup(
                token_ids, spaces, self._engines.names, self._engines.rank(), EngineMatch,
                salt, extras) if spaces else []
            if extras is not None and lora_name:
                # An engine with --enable-tower-connector-lora keys an adapter's items
                # as "<lora>:<identifier>"; each engine's blocks match under one of the
                # two forms only, so the longer run per engine is its own.
                tower = tower_items(media, lora_name)
                extras = {bs: block_extras(tower, bs, n // bs, cache_salt) for bs in extras}
                engines_out = best_of(engines_out, self._core.lookup(
                    token_ids, spaces, self._engines.names, self._engines.rank(), EngineMatch,
                    salt, extras))
        finally:
            self.lock.release()
        block_size = engines_out[0].block_size if engines_out else (spaces[0][1] if spaces else 0)
        return LookupResult(prompt_tokens=len(token_ids), block_size=block_size,
                            engines=engines_out, model=model, lora_name=lora_name)

    def _spaces(self, model: str | None, lora: str | None,
                private: bool = False) -> list[tuple[int, int]]:
        """(ns id, block size) of the namespaces a lookup searches, in creation order
        (``private``: those of salted sequences). Kept incrementally: a lookup never
        scans every namespace."""
        info = self._core.ns_info
        if self._ns_seen < len(info):
            for nid in range(self._ns_seen, len(info)):
                m, bs, lo, priv = info[nid]
                if bs > 0:
                    self._by_model.setdefault((m, lo, priv), []).append((nid, bs))
                    self._by_lora.setdefault((lo, priv), []).append((nid, bs))
            self._ns_seen = len(info)
        if model is None:
            return self._by_lora.get((lora, private), [])
        return self._by_model.get((model, lora, private), [])

    # ------------------------------------------------------------------ queries

    def blocks_by_engine_hash(self, block_hash: BlockHash) -> BlockInfo:
        """Where an engine block hash lives: every engine holding it (with per-tier reference
        counts) and, when known, its namespace, depth and (for blocks within a
        sequence's first 64 tokens) its tokens. Costs one probe per engine. Blocks of
        salted sequences are not shown (as if unknown): a salt is a tenant's."""
        return queries.blocks_by_engine_hash(self.lock, self._core, self._engines, block_hash)

    def top_prefixes(self, model: str | None = None, limit: int = 10) -> list[PrefixInfo]:
        """The most widely cached prefixes: ordered by number of engines holding them, then
        length. Salted sequences are never listed. A prefix is reported at its longest extent with that many holders; its
        shorter sub-prefixes are not repeated. Reads the index in short chunks (the lock
        is never held for long) and caches the answer for a second."""
        if limit <= 0:
            return []
        hit = self._prefix_cache.get(model, limit)
        if hit is not None:
            return hit
        out = queries.top_prefixes(self.lock, self._core, self._engines, model, limit)
        self._prefix_cache.put(model, limit, out)
        return out

    def engine_hashes(self, engine: str) -> dict[str, set[BlockHash]]:
        """Engine hashes ``engine`` holds now, per tier, as the engine sent them. For
        exactness checks against an engine's true cache contents (read in chunks: call
        it on a quiet index for an exact snapshot)."""
        return queries.engine_hashes(self.lock, self._core, self._engines, engine)

    def engine_block_counts(self, engine: str) -> dict[str, int]:
        """Resident blocks of ``engine`` per tier (e.g. "GPU", "CPU"); {} for an unknown
        engine."""
        with self.lock:
            pid = self._engines.get(engine)
            if pid is None:
                return {}
            tn = self._core.tier_name
            return {tn[t]: n for t, n in enumerate(self._core.engine_counts(pid)) if n}

    def engines(self) -> list[str]:
        """Engines with state in the index (fed at least once and not dropped)."""
        with self.lock:
            return sorted(self._engines.ids)

    def counters(self) -> IndexCounters:
        """Snapshot of the counters and sizes."""
        with self.lock:
            c = all_counts(self._core, self._engines, self._counts)
            return IndexCounters(
                applied=[
                    EventCount(engine=p, tier=t, type=k, events=v[0], blocks=v[1])
                    for (p, t, k), v in sorted(c.applied.items())
                ],
                unknown_removals=c.unknown,
                orphan_blocks=c.orphans,
                ignored_events=c.ignored,
                resident_entries=self._core.total_entries(),
                distinct_blocks=self._core.live_slots(),
                refused_events=c.refused,
                namespaces=len(self._core.ns_info),
                tiers=list(self._core.tier_name),
            )

    def memory_bytes(self) -> int:
        """Bytes held by the compiled core's tables (excludes Python object overhead)."""
        with self.lock:
            return self._core.nbytes()

    # ------------------------------------------------------------------ state

    def export_state(self) -> bytes:
        """The whole index (tables, engines, counters) as bytes, for snapshots."""
        return self.export_state_with_anchors()[0]

    def export_state_with_anchors(self) -> tuple[bytes, dict[str, tuple[int, float]]]:
        """:meth:`export_state` and every engine's anchor (seq and timestamp of the last
        batch applied, from its sink), read under one hold of the lock: they agree."""
        with self.lock:
            data = state.export_state(self._core, self._engines,
                                      all_counts(self._core, self._engines, self._counts),
                                      self._limits)
            anchors = {e: a for e, s in self._sinks.items() if (a := s.anchor) is not None}
            return data, anchors

    def import_state(self, data: bytes) -> None:
        """Replace the whole index with :meth:`export_state`'s bytes. Raises
        ``ValueError`` (and changes nothing) when the data is not a valid state."""
        loaded = state.import_state(data, self._limits)
        with self.lock:
            self._reset()
            self._core, self._engines, self._counts = loaded

