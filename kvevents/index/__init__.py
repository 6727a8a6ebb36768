"""The aggregator's reference-counted prefix index (no I/O, no torch).

Files, one concept each::

    hashtable.py  U64Table: compact uint64 -> int32 open-addressing table, vectorised
    keys.py       content keys: chained hash over block tokens, LoRA, extra keys, model
    podmap.py     per-pod engine hash -> slot translation (removals, parents)
    store.py      Residency: slots, per-tier pod bitmasks, reference counts
    results.py    query/result types (msgspec Structs)
    index.py      PrefixIndex: apply_batch / drop_pod / lookup / queries, one lock

    batch ─► PrefixIndex.apply_batch ─► keys ─► store (+podmap) ◄─ lookup / queries
"""

from .index import PrefixIndex, feeds_prefix_matching
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

__all__ = [
    "ApplyStats",
    "BlockHolder",
    "BlockInfo",
    "EventCount",
    "IndexCounters",
    "LookupResult",
    "PodMatch",
    "PrefixIndex",
    "PrefixInfo",
    "feeds_prefix_matching",
]
