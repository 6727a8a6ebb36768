"""The aggregator's reference-counted prefix index (no I/O, no torch).

Files, one concept each::

    _core.pyx     the compiled core: slots, residency masks, refcounts, hash tables;
                  applies a whole batch and matches a whole prompt in one call each
    _tables.pxi   its open-addressing hash tables (included by _core.pyx)
    registry.py   engine names <-> core ids
    index.py      PrefixIndex: the facade (lock, counters by name, lookup results)
    queries.py    inspection queries, read in short chunks (top prefixes, engine blocks)
    state.py      export / import of the whole index for snapshots
    results.py    query/result types (msgspec Structs)

    batch ─► PrefixIndex.apply_batch ─► Core.apply ◄─ Core.match ◄─ PrefixIndex.lookup
"""

from ._core import REASONS as REFUSAL_REASONS
from .index import IndexBusy, PrefixIndex, feeds_prefix_matching
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
    "LookupResult",
    "EngineMatch",
    "PrefixIndex",
    "PrefixInfo",
    "feeds_prefix_matching",
]
