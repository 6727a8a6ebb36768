"""Prompts in flight per engine: what the index cannot know yet.

A request the gateway sent to an engine and whose answer has not finished holds its
prompt's blocks there: while it runs they are allocated to it (not evictable), and
while it waits in the engine's queue they are about to be computed. A new request that
shares its prefix finds those blocks cached when the engine schedules it. The index
learns of them only from the engine's ``BlockStored`` events, after the prefill, which
under load is seconds after routing; two requests with the same new prefix sent
together would otherwise be split across engines and both pay for it.

:class:`InflightPrompts` keeps each in-flight prompt's token ids (one array per
request), bucketed by engine and by the prompt's first :data:`HEAD` tokens, and answers
"how many leading tokens of this prompt does each engine have in flight": one
vectorised comparison per in-flight prompt of the same bucket (at most
:data:`PER_BUCKET`, the most recent), never a loop per token or block.

The event loop's thread only (no locks). Lifecycle: :meth:`add` when a request is sent,
:meth:`remove` with the handle it returned when its answer ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["HEAD", "PER_BUCKET", "InflightPrompts"]

#: Tokens of a prompt's head that select its bucket: prompts that differ there share
#: no block with it (a block is at least this long in every engine we follow).
HEAD = 16
#: In-flight prompts compared per (engine, head): the most recent ones. A hot prefix
#: with thousands in flight costs at most this many comparisons per request.
PER_BUCKET = 32


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = a[:m] != b[:m]
    first = int(diff.argmax())
    return first if diff[first] else m


class InflightPrompts:
    """See the module docstring."""

    def __init__(self) -> None:
        # engine -> head bytes -> {handle: ids}; dicts keep insertion order (most recent last)
        self._by_engine: dict[str, dict[bytes, dict[int, np.ndarray]]] = {}
        self._next = 0

    @staticmethod
    def _head(ids: np.ndarray) -> bytes:
        return ids[:HEAD].tobytes()

    def add(self, engine: str, ids: np.ndarray, identity: bytes = b"") -> tuple[str, bytes, int]:
        """Record ``ids`` in flight on ``engine`` under the prompt's cache ``identity``
        (adapter and salt, digested: prompts of other identities share no block with it);
        returns the handle for :meth:`remove`."""
        self._next += 1
        head = self._head(ids) + identity
        self._by_engine.setdefault(engine, {}).setdefault(head, {})[self._next] = ids
        return engine, head, self._next

    def remove(self, handle: tuple[str, bytes, int]) -> None:
        engine, head, key = handle
        buckets = self._by_engine.get(engine)
        bucket = buckets.get(head) if buckets else None
        if bucket is None:
            return
        bucket.pop(key, None)
        if not bucket:
            del buckets[head]
            if not buckets:
                del self._by_engine[engine]

    def matches(self, ids: np.ndarray, engines: Iterable[str], identity: bytes = b"") -> dict[str, int]:
        """Per engine of ``engines`` with something in flight that shares ``ids``' head:
        the longest prefix of ``ids`` some in-flight prompt of the same ``identity`` there
        starts with."""
        head = self._head(ids) + identity
        out: dict[str, int] = {}
        for engine in engines:
            bucket = self._by_engine.get(engine, {}).get(head)
            if not bucket:
                continue
            recent: Sequence[np.ndarray] = list(bucket.values())[-PER_BUCKET:]
            out[engine] = max(common_prefix(ids, other) for other in recent)
        return out

    def count(self, engine: str) -> int:
        """Prompts in flight on ``engine`` (for tests and the live page)."""
        return sum(len(b) for b in self._by_engine.get(engine, {}).values())

    def forget(self, keep: set[str]) -> None:
        """Drop engines no longer targets."""
        for name in [n for n in self._by_engine if n not in keep]:
            del self._by_engine[name]
