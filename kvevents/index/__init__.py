"""The aggregator's reference-counted prefix index (no I/O, no torch).

Files, one concept each::

    _core.pyx     the compiled core: slots, residency masks, refcounts, hash tables;
                  applies whole batches and matches a whole prompt in one call each
    _tables.pxi   its open-addressing hash tables (included by _core.pyx)
    _wire.pxi     its reader of the common wire batch, applied from the bytes
    _sink.pxi     NogilLock (the facade's lock) and WireSink: an engine's handle for the
                  ingest lane (applies its batches without the GIL; keeps its anchor)
    wire.py       IngestDecoder: common batches stay bytes (WireBatch), others decode
    engine_ids.py EngineIds: engine names <-> core ids (and each id's hash salt)
    counts.py     counters by engine name, kept across drops (the core counts per id)
    index.py      PrefixIndex: the facade (lock, engine ids, counters, caches, results)
    queries.py    inspection queries over (core, engine ids, lock), read in short chunks
                  (top prefixes, engine blocks), and the top-prefix answer cache
    state.py      export / import of (core, engine ids, counters) for snapshots
    media.py      a prompt's multimodal items as vLLM keys their blocks (lookup's extras)
    results.py    query/result types (msgspec Structs; PodMatch, .pods, .pod: deprecated)
    README.md     the data model, what is refused, lock discipline, the state format

    Imports point one way (nothing imports index.py but this package):
    index.py ─► queries.py / state.py ─► counts.py / engine_ids.py ─► _core

    payload ─► IngestDecoder ─► PrefixIndex.apply_batches ─► Core.apply_batches
                                     Core.lookup ◄─ PrefixIndex.lookup ◄─ prompt
"""

from ._core import REASONS as REFUSAL_REASONS
from ._core import NogilLock, WireSink
from .index import IndexBusy, PrefixIndex, feeds_prefix_matching
from .wire import IngestDecoder, WireBatch
from .media import MediaItem, media_items
from .results import (
    ApplyStats,
    BlockHolder,
    BlockInfo,
    EventCount,
    IndexCounters,
    LookupResult,
    EngineMatch,
    PodMatch,
    PrefixInfo,
)

__all__ = [
    "WireSink",
    "REFUSAL_REASONS",
    "ApplyStats",
    "BlockHolder",
    "BlockInfo",
    "EventCount",
    "IndexBusy",
    "IndexCounters",
    "IngestDecoder",
    "NogilLock",
    "LookupResult",
    "MediaItem",
    "EngineMatch",
    "PodMatch",
    "PrefixIndex",
    "PrefixInfo",
    "WireBatch",
    "feeds_prefix_matching",
    "media_items",
]
