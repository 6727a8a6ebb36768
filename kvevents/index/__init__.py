"""The aggregator's reference-counted prefix index (no I/O, no torch).

Files, one concept each::

    _core.pyx     the compiled core: slots, residency masks, refcounts, hash tables;
                  applies whole batches and matches a whole prompt in one call each
    _tables.pxi   its open-addressing hash tables (included by _core.pyx)
    _wire.pxi     its reader of the common wire batch, applied from the bytes
    wire.py       IngestDecoder: common batches stay bytes (WireBatch), others decode
    registry.py   engine names <-> core ids
    index.py      PrefixIndex: the facade (lock, counters by name, lookup results)
    queries.py    inspection queries, read in short chunks (top prefixes, engine blocks)
    state.py      export / import of the whole index for snapshots
    results.py    query/result types (msgspec Structs)

    payload ─► IngestDecoder ─► PrefixIndex.apply_batches ─► Core.apply_batches
                                     Core.lookup ◄─ PrefixIndex.lookup ◄─ prompt
"""

from ._core import REASONS as REFUSAL_REASONS
from .index import IndexBusy, PrefixIndex, feeds_prefix_matching
from .wire import IngestDecoder, WireBatch
from .results import (
    ApplyStats,
    BlockHolder,
    BlockInfo,
    EventCount,
    IndexCounters,
    LookupResult,
    EngineMatch,
    PrefixInfo,
)

__all__ = [
    "REFUSAL_REASONS",
    "ApplyStats",
    "BlockHolder",
    "BlockInfo",
    "EventCount",
    "IndexBusy",
    "IndexCounters",
    "IngestDecoder",
    "LookupResult",
    "EngineMatch",
    "PrefixIndex",
    "PrefixInfo",
    "WireBatch",
    "feeds_prefix_matching",
]
