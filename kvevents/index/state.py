"""Export and import of a whole :class:`~kvevents.index.PrefixIndex` (for snapshots).

The state is one msgpack document: a format version, the compiled core's tables as
raw little-endian arrays, the engine registry and the counters by engine name. Import builds
a complete new core first and validates it (sizes, ranges, table shapes) before
swapping it in under the lock, so a bad document raises ``ValueError`` and leaves the
index as it was. Integrity against bit rot (checksums) and atomic files are the
snapshot writer's job; this module guarantees only that nothing is half-loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ._core import Core
from .registry import EngineRegistry

if TYPE_CHECKING:
    from .index import PrefixIndex

FORMAT_VERSION = 1
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict)


def export_state(index: PrefixIndex) -> bytes:
    with index.lock:
        counts = index._all_counts()
        doc = {
            "version": FORMAT_VERSION,
            "limits": list(index._limits),
            "core": index._core.export_state(),
            "engines": index._engines.export(),
            # Counters by name, live engines' included (the core starts at 0 on import).
            "applied": [[p, t, k, c[0], c[1]] for (p, t, k), c in counts.applied.items()],
            "unknown": counts.unknown,
            "orphans": counts.orphans,
            "ignored": counts.ignored,
            "refused": counts.refused,
        }
        return _enc.encode(doc)


def import_state(index: PrefixIndex, data: bytes) -> None:
    from .index import _Counts

    try:
        doc = _dec.decode(data)
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"index state version {doc.get('version')!r}, "
                             f"expected {FORMAT_VERSION}")
        core = Core(*index._limits)
        core.import_state(doc["core"])
        # "pods": the key of states written before engines were called engines.
        engines = EngineRegistry.restore(doc["engines"] if "engines" in doc else doc["pods"])
        for pid, name in enumerate(engines.names):
            if name is not None and (pid >= len(core.pod_orig) or core.pod_orig[pid] is None
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
    with index.lock:
        index._reset()
        index._core = core
        index._engines = engines
        index._counts = _Counts(applied, *counters, refused)
