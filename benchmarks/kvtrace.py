"""A realistic, deterministic KV event trace: vLLM-like engines with LRU block pools.

Each of ``engines`` engines owns a block pool of ``capacity`` 16-token blocks. A seeded
request stream is spread over them: shared system prompts, Zipf-popular documents,
conversations that grow turn by turn (sticky to their engine), and 32k-token long
contexts. Each engine serves a request like vLLM's prefix cache does:

* it hits the longest cached prefix of the prompt (and refreshes those blocks' LRU time);
* it stores the prompt's missing full blocks as ``BlockStored`` events of at most
  ``max_event_blocks`` (128 blocks = 2,048 tokens, one chunked-prefill step each);
* it stores every block completed during decode as its own one-block ``BlockStored``;
* when the pool is full it evicts the least recently used *leaf* (a block with no cached
  child in that pool), one ``BlockRemoved`` per block, as vLLM's pool emits them.

Engine hashes are a chained 64-bit hash of (parent hash, block tokens) with the same
root on every engine (no per-engine seed), so the same prefix has the same hash everywhere.
The trace is shaped so that Dynamo 1.6.1's radix tree indexes it exactly too: only
leaves are evicted (removal never orphans a cached descendant), a block is never
announced twice on one engine while cached, and a stored block's parent is always cached.

:func:`generate` writes three files into a directory and returns their paths:

* ``trace.bin``: length-prefixed records ``(engine, msgpack payload)`` in publishing
  order (vLLM's current map encoding, via :class:`kvevents.wire.schema.BatchEncoder`;
  a few events per batch, like an engine step), read back with :func:`read`;
* ``truth.npz``: each engine's resident engine hashes at the end, and lookup prompts of
  2,048 and 32,768 tokens drawn from the trace (full hits, partial hits, misses);
* ``meta.json``: the configuration and per-engine counts (batches, events, block events).

Generation is Python (minutes for 64 engines x 50k blocks); results are cached by
configuration in the directory, so a benchmark pays for it once.
"""

from __future__ import annotations

import heapq
import json
import os
import struct
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from hashlib import blake2b

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvevents.wire.schema import BatchEncoder, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

BS = 16
VOCAB = 32_000  # a Llama-2-sized vocabulary: every token fits msgpack's uint16
MODEL = "bench-model"
ROOT = 0  # parent of a sequence's first block, identical on every engine
_REC = struct.Struct("<HI")


@dataclass(frozen=True)
class TraceConfig:
    """What to generate. ``steady``: blocks stored after the pools fill, as a fraction
    of ``engines * capacity`` (each costs an eviction)."""

    engines: int = 16
    capacity: int = 20_000
    steady: float = 0.25
    seed: int = 0
    max_event_blocks: int = 128
    max_events_per_batch: int = 8
    lookup_prompts: int = 64

    @classmethod
    def from_args(cls, a) -> TraceConfig:
        """The trace named by the options :func:`add_trace_args` added."""
        return cls(a.engines, a.capacity, a.steady, a.seed)

    def name(self) -> str:
        return (f"trace-p{self.engines}-c{self.capacity}-s{self.steady}-seed{self.seed}"
                f"-e{self.max_event_blocks}-b{self.max_events_per_batch}-v7")


def add_trace_args(ap, workdir: str = "/tmp/kvevents-traces") -> None:
    """The options that name a trace (``TraceConfig.from_args``) and where it is kept:
    every script replaying one takes the same ones."""
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--steady", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=workdir)


def block_hash(parent: int, tokens: np.ndarray) -> int:
    """The engine hash of one block: 64 bits of blake2b over (parent, int32 tokens)."""
    d = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    d.update(tokens.tobytes())
    return int.from_bytes(d.digest(), "little")


def chain_hashes(tokens: np.ndarray, parent: int = ROOT) -> list[int]:
    """Engine hashes of every full block of ``tokens`` (int32), chained from ``parent``."""
    out = []
    n = len(tokens) // BS
    for i in range(n):
        parent = block_hash(parent, tokens[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


class _Engine:
    """One engine's block pool: cached blocks, child counts, LRU times, pending events."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.parent: dict[int, int] = {}
        self.children: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.leaves: list[tuple[int, int]] = []  # (last use, hash); stale entries skipped
        self.pending: list = []
        self.stored = 0

    def _evict(self, tick: int) -> int:
        while self.leaves:
            t, h = heapq.heappop(self.leaves)
            if self.last.get(h) != t or self.children[h]:
                continue  # stale: touched since, evicted, or has a child now
            if t >= tick:
                raise RuntimeError(f"{self.name}: pool too small for one request")
            p = self.parent.pop(h)
            del self.children[h], self.last[h]
            if p != ROOT:
                self.children[p] -= 1
                if not self.children[p]:
                    heapq.heappush(self.leaves, (self.last[p], p))
            return h
        raise RuntimeError(f"{self.name}: nothing evictable")

    def _add(self, h: int, parent: int, tick: int) -> None:
        self.parent[h] = parent
        self.children[h] = 0
        self.last[h] = tick
        if parent != ROOT:
            self.children[parent] += 1
        self.stored += 1

    def _store(self, tick: int, hashes: list[int], first: int, end: int, tokens: np.ndarray) -> None:
        """Store blocks ``first..end-1`` of a sequence as one event, evicting first."""
        need = len(self.parent) + (end - first) - self.capacity
        for _ in range(max(0, need)):
            self.pending.append(BlockRemoved(block_hashes=[self._evict(tick)], medium="GPU"))
        parent = hashes[first - 1] if first else ROOT
        for j in range(first, end):
            self._add(hashes[j], hashes[j - 1] if j else ROOT, tick)
        self.pending.append(BlockStored(
            block_hashes=hashes[first:end], parent_block_hash=None if parent == ROOT else parent,
            token_ids=tokens[first * BS:end * BS].tolist(), block_size=BS, lora_id=None,
            medium="GPU", lora_name=None))

    def serve(self, tick: int, tokens: np.ndarray, hashes: list[int], n_prompt: int,
              max_event_blocks: int) -> int:
        """Serve one request whose prompt holds ``n_prompt`` full blocks and whose whole
        sequence (prompt + output) has block hashes ``hashes``. Returns blocks hit."""
        hit = 0
        parent_of = self.parent
        while hit < n_prompt and hashes[hit] in parent_of:
            hit += 1
        if hit:
            self.last.update(dict.fromkeys(hashes[:hit], tick))
        j = hit
        while j < n_prompt:  # prefill, in chunks
            end = min(n_prompt, j + max_event_blocks)
            self._store(tick, hashes, j, end, tokens)
            j = end
        for j in range(max(hit, n_prompt), len(hashes)):  # decode: one block per event
            self._store(tick, hashes, j, j + 1, tokens)
        # The sequence's last block is now a leaf used at ``tick`` (the blocks before it
        # have a cached child; their older heap entries are skipped as stale).
        if len(hashes) > hit:
            heapq.heappush(self.leaves, (tick, hashes[-1]))
        elif hit:
            heapq.heappush(self.leaves, (tick, hashes[hit - 1]))
        return hit


class _Corpus:
    """Shared content: system prompts, Zipf-popular documents, long documents."""

    def __init__(self, cfg: TraceConfig, rng: np.random.Generator) -> None:
        def blocks(lo: int, hi: int) -> np.ndarray:
            return rng.integers(0, VOCAB, int(rng.integers(lo, hi + 1)) * BS, dtype=np.int32)

        self.sys = [blocks(16, 128) for _ in range(16)]  # 256 .. 2,048 tokens
        n_docs = max(64, cfg.engines * cfg.capacity // 2000)
        self.docs = [blocks(32, 384) for _ in range(n_docs)]  # 512 .. 6,144 tokens
        self.longs = [rng.integers(0, VOCAB, 32_768, dtype=np.int32) for _ in range(8)]
        p = 1.0 / np.arange(1, n_docs + 1) ** 1.1
        self.doc_p = p / p.sum()
        self._memo: dict[tuple, list[int]] = {}

    def prefix(self, key: tuple, parts: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
        """Tokens and hashes of shared block-aligned parts, memoised by ``key``."""
        toks = np.concatenate(parts)
        h = self._memo.get(key)
        if h is None:
            h = self._memo[key] = chain_hashes(toks)
        return toks, h


class _Conversation:
    def __init__(self, engine: int, tokens: np.ndarray, hashes: list[int], turns: int) -> None:
        self.engine = engine
        self.tokens = tokens
        self.hashes = hashes
        self.turns_left = turns


def _requests(cfg: TraceConfig, rng: np.random.Generator, corpus: _Corpus):
    """Endless stream of (engine, tokens, hashes, n_prompt_blocks, kind)."""
    convs: list[_Conversation] = []
    max_convs = 32 * cfg.engines
    while True:
        r = rng.random()
        out_len = int(rng.integers(32, 513))
        if r < 0.03:  # long context: system prompt + long document, cut at 32k
            # Each long document comes with its own system prompt, so it is re-read.
            d = int(rng.integers(len(corpus.longs)))
            s = d % len(corpus.sys)
            base, bh = corpus.prefix(("L", s, d), [corpus.sys[s], corpus.longs[d]])
            prompt = base[:32_768 - 64]
            q = rng.integers(0, VOCAB, 64, dtype=np.int32)
            toks = np.concatenate([prompt, q, rng.integers(0, VOCAB, out_len // 4, dtype=np.int32)])
            n_pre = len(prompt) // BS
            hashes = bh[:n_pre] + chain_hashes(toks[n_pre * BS:], bh[n_pre - 1])
            # A KV-aware router keeps sending a long document where it is cached.
            home = d * cfg.engines // len(corpus.longs)
            engine = home if rng.random() < 0.8 else int(rng.integers(cfg.engines))
            yield engine, toks, hashes, 32_768 // BS, "long"
        elif r < 0.43:  # document question
            s = int(rng.integers(len(corpus.sys)))
            d = int(rng.choice(len(corpus.docs), p=corpus.doc_p))
            base, bh = corpus.prefix(("D", s, d), [corpus.sys[s], corpus.docs[d]])
            q = rng.integers(0, VOCAB, int(rng.integers(16, 257)), dtype=np.int32)
            out = rng.integers(0, VOCAB, out_len, dtype=np.int32)
            toks = np.concatenate([base, q, out])
            hashes = bh + chain_hashes(toks[len(base):], bh[-1])
            yield int(rng.integers(cfg.engines)), toks, hashes, (len(base) + len(q)) // BS, "doc"
        else:  # conversation: a new one, or the next turn of an active one
            if convs and (len(convs) >= max_convs or rng.random() < 0.75):
                i = int(rng.integers(len(convs)))
                c = convs[i]
                engine = c.engine if rng.random() < 0.9 else int(rng.integers(cfg.engines))
                msg = rng.integers(0, VOCAB, int(rng.integers(16, 513)), dtype=np.int32)
                prompt = np.concatenate([c.tokens, msg])
                kind = "turn"
            else:
                s = int(rng.integers(len(corpus.sys)))
                base, _ = corpus.prefix(("S", s), [corpus.sys[s]])
                msg = rng.integers(0, VOCAB, int(rng.integers(16, 513)), dtype=np.int32)
                prompt = np.concatenate([base, msg])
                engine = int(rng.integers(cfg.engines))
                c = _Conversation(engine, base, corpus.prefix(("S", s), [corpus.sys[s]])[1],
                                  int(rng.integers(2, 12)))
                convs.append(c)
                i = len(convs) - 1
                kind = "conv"
            out = rng.integers(0, VOCAB, out_len, dtype=np.int32)
            toks = np.concatenate([prompt, out])
            known = len(c.hashes)
            hashes = c.hashes + chain_hashes(toks[known * BS:], c.hashes[-1] if known else ROOT)
            c.tokens, c.hashes, c.engine = toks, hashes, engine
            c.turns_left -= 1
            if c.turns_left <= 0 or len(toks) > 24_000:
                convs[i] = convs[-1]
                convs.pop()
            yield engine, toks, hashes, len(prompt) // BS, kind


def _lookup_prompts(cfg: TraceConfig, rng: np.random.Generator, recent: deque,
                    n_tokens: int) -> np.ndarray:
    """``lookup_prompts`` prompts of ``n_tokens``: cut from the most recent sequences
    (full hits where still cached), a recent head with a fresh tail (partial hits),
    and one in eight entirely fresh (misses)."""
    seqs = [t for t in recent if len(t) >= n_tokens][-48:] or list(recent)
    out = np.empty((cfg.lookup_prompts, n_tokens), dtype=np.int32)
    for i in range(cfg.lookup_prompts):
        # Full cuts from the 8 most recent sequences (most likely still cached).
        s = seqs[-1 - int(rng.integers(min(8, len(seqs))))] if i % 2 == 0 else seqs[int(rng.integers(len(seqs)))]
        if i % 8 == 7:
            out[i] = rng.integers(0, VOCAB, n_tokens, dtype=np.int32)
        elif i % 2 == 0 and len(s) >= n_tokens:
            out[i] = s[:n_tokens]
        else:
            keep = min(len(s), int(rng.integers(n_tokens // 8, n_tokens)))
            out[i, :keep] = s[:keep]
            out[i, keep:] = rng.integers(0, VOCAB, n_tokens - keep, dtype=np.int32)
    return out


def generate(cfg: TraceConfig, workdir: str, log: bool = True) -> dict[str, str]:
    """Generate the trace for ``cfg`` into ``workdir`` unless already there; returns
    the paths of ``trace``, ``truth`` and ``meta``."""
    base = os.path.join(workdir, cfg.name())
    paths = {"trace": base + ".bin", "truth": base + ".npz", "meta": base + ".json"}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    corpus = _Corpus(cfg, rng)
    engines = [_Engine(f"engine-{i:02d}", cfg.capacity) for i in range(cfg.engines)]
    enc = BatchEncoder()
    target = int(cfg.engines * cfg.capacity * (1 + cfg.steady))
    per_engine = {e.name: {"batches": 0, "events": 0, "stored_blocks": 0, "removed_blocks": 0}
                  for e in engines}
    recent: deque = deque(maxlen=400)
    recent_long: deque = deque(maxlen=64)
    kinds: dict[str, int] = {}
    total_stored = tick = 0
    hit_blocks = prompt_blocks = 0
    with open(paths["trace"] + ".tmp", "wb") as f:
        def flush(e: _Engine, n: int) -> None:
            batch, e.pending = e.pending[:n], e.pending[n:]
            # vLLM's publisher always sets the rank (Dynamo's listener needs all 3 fields).
            payload = enc.encode(KVEventBatch(ts=float(tick), events=batch, data_parallel_rank=0))
            name = e.name.encode()
            f.write(_REC.pack(len(name), len(payload)))
            f.write(name)
            f.write(payload)
            c = per_engine[e.name]
            c["batches"] += 1
            c["events"] += len(batch)
            for ev in batch:
                key = "stored_blocks" if isinstance(ev, BlockStored) else "removed_blocks"
                c[key] += len(ev.block_hashes)

        for engine, toks, hashes, n_prompt, kind in _requests(cfg, rng, corpus):
            tick += 1
            e = engines[engine]
            before = e.stored
            hit_blocks += e.serve(tick, toks, hashes, n_prompt, cfg.max_event_blocks)
            prompt_blocks += n_prompt
            total_stored += e.stored - before
            kinds[kind] = kinds.get(kind, 0) + 1
            (recent_long if kind == "long" else recent).append(toks)
            while len(e.pending) >= cfg.max_events_per_batch:
                flush(e, int(rng.integers(1, cfg.max_events_per_batch + 1)))
            if total_stored >= target:
                break
        for e in engines:
            while e.pending:
                flush(e, cfg.max_events_per_batch)
    truth: dict[str, np.ndarray] = {
        f"resident/{e.name}": np.fromiter(e.parent, dtype=np.uint64, count=len(e.parent))
        for e in engines}
    truth["prompts_2048"] = _lookup_prompts(cfg, rng, recent, 2048)
    truth["prompts_32768"] = _lookup_prompts(cfg, rng, [*recent, *recent_long], 32_768)
    np.savez(paths["truth"] + ".tmp.npz", **truth)
    meta = {
        "config": asdict(cfg), "model": MODEL, "block_size": BS, "requests": tick,
        "request_kinds": kinds, "prompt_hit_fraction": round(hit_blocks / max(1, prompt_blocks), 3),
        "resident_entries": sum(len(e.parent) for e in engines),
        "batches": sum(c["batches"] for c in per_engine.values()),
        "events": sum(c["events"] for c in per_engine.values()),
        "block_events": sum(c["stored_blocks"] + c["removed_blocks"] for c in per_engine.values()),
        "per_engine": per_engine, "seconds": round(time.perf_counter() - t0, 1),
    }
    with open(paths["meta"] + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(paths["trace"] + ".tmp", paths["trace"])
    os.replace(paths["truth"] + ".tmp.npz", paths["truth"])
    os.replace(paths["meta"] + ".tmp", paths["meta"])
    if log:
        print(f"generated {paths['trace']}: {meta['requests']:,} requests, {meta['events']:,} events, "
              f"{meta['block_events']:,} block events, {meta['resident_entries']:,} resident, "
              f"{meta['seconds']}s", file=sys.stderr)
    return paths


def read(path: str) -> Iterator[tuple[str, bytes]]:
    """Records of a trace file, as (engine, msgpack payload), streamed one at a time."""
    with open(path, "rb") as f:
        while True:
            h = f.read(_REC.size)
            if len(h) < _REC.size:
                return
            lp, ln = _REC.unpack(h)
            engine = f.read(lp).decode()
            yield engine, f.read(ln)


def load_truth(path: str) -> tuple[dict[str, set[int]], dict[int, np.ndarray]]:
    """(engine -> resident engine hashes, prompt length -> lookup prompts) of a trace."""
    z = np.load(path)
    resident = {k.split("/", 1)[1]: set(z[k].tolist()) for k in z.files if k.startswith("resident/")}
    prompts = {int(k.split("_")[1]): z[k] for k in z.files if k.startswith("prompts_")}
    return resident, prompts


def expected_blocks(resident: dict[str, set[int]], tokens: np.ndarray) -> dict[str, int]:
    """Per engine, the leading blocks of ``tokens`` it holds (engines holding none omitted)."""
    hashes = chain_hashes(np.asarray(tokens, dtype=np.int32))
    out = {}
    for engine, res in resident.items():
        n = 0
        while n < len(hashes) and hashes[n] in res:
            n += 1
        if n:
            out[engine] = n
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="generate a realistic KV event trace")
    add_trace_args(ap)
    a = ap.parse_args()
    paths = generate(TraceConfig.from_args(a), a.workdir)
    print(json.dumps(paths))


if __name__ == "__main__":
    main()
