"""Result types of :class:`~kvevents.index.PrefixIndex` queries (msgspec Structs, so the
HTTP layer can encode them to JSON directly). All are plain snapshots: they hold no
reference into the index and stay valid after the index changes."""

from __future__ import annotations

import warnings

import msgspec

from ..wire.schema import BlockHash


class EngineMatch(msgspec.Struct, gc=False):
    """How much of a prompt one engine holds.

    ``tokens``: leading prompt tokens whose blocks the engine holds in *some* tier (a block
    counts when any tier has it). ``tiers``: per tier (vLLM's ``medium``, e.g. "GPU", "CPU"),
    that tier's own leading run in tokens; only tiers with a run > 0 appear.
    ``block_size``: the block size of the namespace that matched.
    """

    engine: str
    tokens: int
    tiers: dict[str, int]
    block_size: int

    @property
    def pod(self) -> str:
        """Deprecated: 0.1.0's name of :attr:`engine` (read-only; not encoded)."""
        _renamed("EngineMatch.pod", "EngineMatch.engine")
        return self.engine


#: Deprecated: 0.1.0's name of :class:`EngineMatch` (the same class).
PodMatch = EngineMatch


def best_of(a: list[EngineMatch], b: list[EngineMatch]) -> list[EngineMatch]:
    """Two lookups' answers as one: per engine the longer run, best first (tokens
    descending, then engine name, as a lookup orders them)."""
    best = {m.engine: m for m in a}
    for m in b:
        if m.engine not in best or m.tokens > best[m.engine].tokens:
            best[m.engine] = m
    return sorted(best.values(), key=lambda m: (-m.tokens, m.engine))


class LookupResult(msgspec.Struct, gc=False):
    """Answer of :meth:`PrefixIndex.lookup`.

    ``engines``: engines with ``tokens > 0``, best first (tokens descending, then engine name).
    ``prompt_tokens``: length of the prompt looked up. ``block_size``: block size of the
    best match (or of the first namespace tried when nothing matched; 0 when the index
    knows no namespace for the model). ``model`` / ``lora_name``: as asked.
    """

    prompt_tokens: int
    block_size: int
    engines: list[EngineMatch]
    model: str | None = None
    lora_name: str | None = None

    @property
    def pods(self) -> list[EngineMatch]:
        """Deprecated: 0.1.0's name of :attr:`engines` (read-only; not encoded)."""
        _renamed("LookupResult.pods", "LookupResult.engines")
        return self.engines


def _renamed(old: str, new: str) -> None:
    warnings.warn(f"{old} is renamed to {new}; {old} will be removed in 0.3.0",
                  DeprecationWarning, stacklevel=3)


class ApplyStats(msgspec.Struct, gc=False):
    """What one :meth:`PrefixIndex.apply_batch` call did.

    ``stored_blocks`` / ``removed_blocks``: block entries named by applied BlockStored /
    BlockRemoved events (removals include unknown ones). ``unknown_removals``: removals
    of (engine, tier, hash) entries that were not present. ``orphan_blocks``: stored blocks
    that could not be placed on a chain from the sequence start (unknown parent, or a
    token-less event with a hash never seen with tokens). ``ignored_events``: events not
    feeding prefix matching (non-full-attention groups of hybrid models).
    """

    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    unknown_removals: int = 0
    orphan_blocks: int = 0
    ignored_events: int = 0
    refused_events: int = 0


def add_stats(a: ApplyStats, b: ApplyStats) -> ApplyStats:
    """The field-wise sum of two :class:`ApplyStats`."""
    return ApplyStats(*(x + y for x, y in zip(msgspec.structs.astuple(a),
                                               msgspec.structs.astuple(b))))


class BlockHolder(msgspec.Struct, gc=False):
    """One engine holding an engine block: its tiers and reference count per tier."""

    engine: str
    tiers: dict[str, int]


class BlockInfo(msgspec.Struct, gc=False):
    """Answer of :meth:`PrefixIndex.blocks_by_engine_hash`.

    ``holders``: engines that hold the block now (empty when nobody does).
    ``tokens``: the block's tokens when the index keeps them: for blocks within a
    sequence's first 64 tokens announced by a self-describing event; else None.
    ``depth``: 1-based position of the block in its sequence; 0 when unknown (orphan or
    token-less). ``model`` / ``block_size`` / ``lora_name``: the block's namespace.
    """

    engine_hash: BlockHash
    holders: list[BlockHolder]
    tokens: list[int] | None = None
    depth: int = 0
    model: str | None = None
    block_size: int = 0
    lora_name: str | None = None


class PrefixInfo(msgspec.Struct, gc=False):
    """One widely cached prefix (answer item of :meth:`PrefixIndex.top_prefixes`).

    ``tokens``: prefix length in tokens (``blocks * block_size``); ``leading_tokens``:
    up to the first 64 token ids; ``engines``: engines holding the whole prefix in some tier.
    """

    tokens: int
    blocks: int
    block_size: int
    leading_tokens: list[int]
    engines: list[str]
    model: str | None = None
    lora_name: str | None = None


class EventCount(msgspec.Struct, gc=False):
    """Applied events and their block entries for one (engine, tier, event type)."""

    engine: str
    tier: str
    type: str
    events: int
    blocks: int


class IndexCounters(msgspec.Struct, gc=False):
    """Monotonic counters since the index was created (kept across engine drops), plus
    current sizes. Per-engine dicts are keyed by engine name. ``applied`` has one row per
    (engine, tier, event type); AllBlocksCleared rows have tier "*". ``refused_events``:
    per engine, events refused by reason (see ``kvevents.index.REFUSAL_REASONS``).
    ``namespaces`` / ``tiers``: namespaces and tiers known (both capped)."""

    applied: list[EventCount]
    unknown_removals: dict[str, int]
    orphan_blocks: dict[str, int]
    ignored_events: dict[str, int]
    resident_entries: int
    distinct_blocks: int
    refused_events: dict[str, dict[str, int]] = {}
    namespaces: int = 0
    tiers: list[str] = []
