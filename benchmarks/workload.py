"""Synthetic, realistic KV event workloads (shared by the index and ingest benchmarks).

A fleet of ``engines`` engines, each with a prefix cache of ``capacity`` 16-token blocks,
serves requests made of: one of 16 shared system prompts (1,024 tokens), often a shared
document drawn Zipf-like from a pool (1-4k tokens), and a unique user tail (128-1k
tokens); a few engines also serve long-context requests (~32k tokens) over shared long
documents. Like vLLM, an engine announces only blocks it did not already hold (one
``BlockStored`` per request, parent = last cached block) and, once full, evicts its
oldest announcements with ``BlockRemoved``. Engine hashes are per-engine (no shared hash
seed), as with vLLM's random ``NONE_HASH``.

These are the old, flattering shapes (large events, per-engine hashes); the realistic
trace of the side-by-side benchmarks is benchmarks/kvtrace.py.

``generate()`` yields ``(engine_name, KVEventBatch)`` in publishing order; ``write()``
stores them msgpack-encoded (length-prefixed) so a measuring process can replay them
without carrying the generator's state in its RSS.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvevents.wire.schema import BatchEncoder, BlockRemoved, BlockStored, KVEventBatch

BS = 16
VOCAB = 128_000
MODEL = "bench-model"
_MULT = np.random.default_rng(12345).integers(1, 2**63, BS, dtype=np.uint64) | np.uint64(1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _keys(toks: np.ndarray) -> np.ndarray:
    """A 64-bit key per full block identifying its whole prefix (this generator's own
    bookkeeping; the index hashes tokens itself). Whole-array numpy, no per-block loop."""
    n = len(toks) // BS
    with np.errstate(over="ignore"):
        blocks = toks[: n * BS].astype(np.uint64).reshape(n, BS)
        content = _mix((blocks * _MULT).sum(axis=1, dtype=np.uint64))
        pos = np.arange(1, n + 1, dtype=np.uint64)
        return _mix(np.cumsum(_mix(content ^ pos), dtype=np.uint64) + pos)


@dataclass
class Workload:
    engines: int = 64
    capacity: int = 100_000  # resident GPU blocks per engine once full
    steady_fraction: float = 0.25  # extra blocks stored after the fill (with evictions)
    events_per_batch: int = 16
    seed: int = 0

    def prompts(self, n_tokens: int, count: int = 50) -> list[list[int]]:
        """Lookup prompts of ``n_tokens``: cached request prefixes (full hits on a few
        engines, the shared system prompt on many), like a router sees."""
        rng = np.random.default_rng(self.seed + 99)
        sysp, docs, longs = _corpus(self)
        out = []
        for i in range(count):
            if n_tokens > 8192:
                base = np.concatenate([sysp[i % len(sysp)], longs[i % len(longs)]])
            else:
                base = np.concatenate([sysp[i % len(sysp)], docs[i % 8]])
            if base.size < n_tokens:
                base = np.concatenate([base, rng.integers(0, VOCAB, n_tokens - base.size)])
            out.append(base[:n_tokens].tolist())
        return out


def _corpus(w: Workload):
    rng = np.random.default_rng(w.seed)
    sysp = [rng.integers(0, VOCAB, 1024) for _ in range(16)]
    n_docs = max(32, w.capacity // 64)
    docs = [rng.integers(0, VOCAB, int(rng.integers(64, 256)) * BS) for _ in range(n_docs)]
    longs = [rng.integers(0, VOCAB, 31 * 1024) for _ in range(4)]
    return sysp, docs, longs


def generate(w: Workload) -> Iterator[tuple[str, KVEventBatch]]:
    rng = np.random.default_rng(w.seed + 1)
    sysp, docs, longs = _corpus(w)
    zipf_p = 1.0 / np.arange(1, len(docs) + 1)
    zipf_p /= zipf_p.sum()
    engines = [f"engine-{i:02d}" for i in range(w.engines)]
    salts = [np.uint64(rng.integers(1, 2**63)) for _ in engines]
    cached: list[set[int]] = [set() for _ in engines]
    fifo: list[deque] = [deque() for _ in engines]
    resident = [0] * w.engines
    stored = [0] * w.engines
    target = int(w.capacity * (1 + w.steady_fraction))
    pending: list[list] = [[] for _ in engines]
    active = list(range(w.engines))
    while active:
        nxt = []
        for p in active:
            parts = [sysp[int(rng.integers(len(sysp)))]]
            if p < 8 and rng.random() < 0.05 and w.capacity >= 8192:
                parts.append(longs[int(rng.integers(len(longs)))])
            elif rng.random() < 0.7:
                parts.append(docs[int(rng.choice(len(docs), p=zipf_p))])
            parts.append(rng.integers(0, VOCAB, int(rng.integers(8, 64)) * BS))
            toks = np.concatenate(parts)
            keys = _keys(toks)
            hashes = (keys ^ salts[p]).tolist()  # per-engine hashes
            kl = keys.tolist()
            c = cached[p]
            first = 0
            while first < len(kl) and kl[first] in c:
                first += 1
            if first < len(kl):
                new = kl[first:]
                c.update(new)
                ev = BlockStored(
                    block_hashes=hashes[first:],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=toks[first * BS :].tolist(),
                    block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                )
                pending[p].append(ev)
                fifo[p].append((new, hashes[first:]))
                resident[p] += len(new)
                stored[p] += len(new)
            while resident[p] > w.capacity:
                old_keys, old_hashes = fifo[p].popleft()
                for k in old_keys:
                    c.discard(k)
                resident[p] -= len(old_keys)
                pending[p].append(BlockRemoved(block_hashes=old_hashes, medium="GPU"))
            if len(pending[p]) >= w.events_per_batch:
                yield engines[p], KVEventBatch(0.0, pending[p])
                pending[p] = []
            if stored[p] < target:
                nxt.append(p)
        active = nxt
    for p in range(w.engines):
        if pending[p]:
            yield engines[p], KVEventBatch(0.0, pending[p])


def write(w: Workload, path: str) -> dict[str, int]:
    """Write the workload as length-prefixed records: engine name, payload."""
    enc = BatchEncoder()
    n_batches = 0
    with open(path, "wb") as f:
        for engine, batch in generate(w):
            pb = engine.encode()
            payload = enc.encode(batch)
            f.write(struct.pack("<HI", len(pb), len(payload)))
            f.write(pb)
            f.write(payload)
            n_batches += 1
    return {"batches": n_batches}


def read(path: str) -> Iterator[tuple[str, bytes]]:
    """Records written by :func:`write`, as (engine, msgpack payload)."""
    hdr = struct.Struct("<HI")
    # Streamed record by record so a reader's RSS holds one payload at a time.
    with open(path, "rb") as f:
        while True:
            h = f.read(hdr.size)
            if len(h) < hdr.size:
                return
            lp, ln = hdr.unpack(h)
            engine = f.read(lp).decode()
            yield engine, f.read(ln)
