"""Export and import of a whole :class:`~kvevents.index.PrefixIndex` (for snapshots).

The state is one msgpack document: a format version, the compiled core's tables as
raw little-endian arrays, the engine-id table and the counters by engine name. Import
builds a complete new core first and validates it (sizes, ranges, table shapes) before
the facade swaps it in under the lock, so a bad document raises ``ValueError`` and
leaves the index as it was. Integrity against bit rot (checksums) and atomic files are
the snapshot writer's job; this module guarantees only that nothing is half-loaded.

Works over what it is handed (a core, its engine ids, the counters by name, the
limits); it knows nothing of the facade, which holds the lock and stores the result.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from ._core import Core
from .counts import Counts
from .engine_ids import EngineIds

FORMAT_VERSION = 1
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict)


class State(NamedTuple):
    """A loaded, validated state: what the facade swaps in."""

    core: Core
    engines: EngineIds
    counts: Counts


def export_state(core: Core, engines: EngineIds, counts: Counts, limits: tuple) -> bytes:
    """The state document of ``core`` and ``engines``, with ``counts`` the counters by
    name, live engines' included (the core starts at 0 on import). The caller holds
    the index lock for the whole call."""
    doc = {
        "version": FORMAT_VERSION,
        "limits": list(limits),
        "core": core.export_state(),
        "engines": engines.export(),
        "applied": [[p, t, k, c[0], c[1]] for (p, t, k), c in counts.applied.items()],
        "unknown": counts.unknown,
        "orphans": counts.orphans,
        "ignored": counts.ignored,
        "refused": counts.refused,
    }
    return _enc.encode(doc)


def import_state(data: bytes, limits: tuple) -> State:
    """A new core (built with ``limits``), engine ids and counters from
    :func:`export_state`'s bytes. Raises ``ValueError`` when the data is not a valid
    state. Touches no index: needs no lock."""
    try:
        doc = _dec.decode(data)
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"index state version {doc.get('version')!r}, "
                             f"expected {FORMAT_VERSION}")
        core = Core(*limits)
        core.import_state(doc["core"])
        # "pods": the key of states written before engines were called engines.
        engines = EngineIds.restore(doc["engines"] if "engines" in doc else doc["pods"])
        for pid, name in enumerate(engines.names):
            if name is not None and (pid >= len(core.engine_orig) or core.engine_orig[pid] is None
                                     or pid >= 64 * core.W):
                raise ValueError(f"index state: engine {name!r} has no tables")
        applied: dict[tuple[str, str, str], list[int]] = {
            (str(p), str(t), str(k)): [int(e), int(b)] for p, t, k, e, b in doc["applied"]
        }
        counters: list[dict[str, Any]] = [
            {str(k): int(v) for k, v in doc[name].items()} for name in ("unknown", "orphans", "ignored")
        ]
        refused = {str(p): {str(r): int(n) for r, n in v.items()} for p, v in doc["refused"].items()}
    except ValueError:
        raise
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise ValueError(f"index state: malformed ({type(exc).__name__}: {exc})") from None
    return State(core, engines, Counts(applied, *counters, refused))
