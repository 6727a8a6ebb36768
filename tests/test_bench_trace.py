"""The benchmark trace generator (benchmarks/kvtrace.py): deterministic, and shaped so
that both our index and Dynamo's radix tree index it exactly.

Replays a small trace through a plain model of each engine's cache and checks the promises
the side-by-side benchmarks rely on: parents cached before children, no block announced
twice while cached, only leaves evicted, pools never over capacity, the recorded truth
equal to the replayed state, and our ``PrefixIndex`` answering the truth on the trace's
own lookup prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kvtrace import BS, MODEL, TraceConfig, chain_hashes, expected_blocks, generate, load_truth, read  # noqa: E402

from kvevents.index import PrefixIndex  # noqa: E402
from kvevents.wire.schema import BatchDecoder, BlockRemoved, BlockStored  # noqa: E402

CFG = TraceConfig(engines=3, capacity=3000, steady=0.5, seed=5, lookup_prompts=16)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return generate(CFG, str(tmp_path_factory.mktemp("trace")), log=False)


def test_deterministic(trace, tmp_path):
    again = generate(CFG, str(tmp_path), log=False)
    assert Path(trace["trace"]).read_bytes() == Path(again["trace"]).read_bytes()
    metas = [json.loads(Path(t["meta"]).read_text()) for t in (trace, again)]
    for m in metas:
        m.pop("seconds")  # generation time
    assert metas[0] == metas[1]


def test_events_keep_dynamo_exact_invariants(trace):
    dec = BatchDecoder()
    cached: dict[str, dict[int, int]] = {}  # engine -> hash -> parent
    stats = {"stored": 0, "removed": 0, "one_block_stores": 0, "max_event_blocks": 0, "events": 0}
    for engine, payload in read(trace["trace"]):
        batch = dec.decode(payload).batch
        assert batch.data_parallel_rank == 0
        assert 1 <= len(batch.events) <= CFG.max_events_per_batch
        pool = cached.setdefault(engine, {})
        for ev in batch.events:
            stats["events"] += 1
            if isinstance(ev, BlockStored):
                assert ev.block_size == BS and len(ev.token_ids) == BS * len(ev.block_hashes)
                assert ev.parent_block_hash is None or ev.parent_block_hash in pool, "parent not cached"
                parent = ev.parent_block_hash or 0
                for i, h in enumerate(ev.block_hashes):
                    assert h not in pool, "announced twice while cached"
                    # Same hash for the same prefix everywhere: chained from the parent.
                    assert chain_hashes(_arr(ev.token_ids[i * BS:(i + 1) * BS]), parent) == [h]
                    pool[h] = parent
                    parent = h
                stats["stored"] += len(ev.block_hashes)
                stats["one_block_stores"] += len(ev.block_hashes) == 1
                stats["max_event_blocks"] = max(stats["max_event_blocks"], len(ev.block_hashes))
            else:
                assert isinstance(ev, BlockRemoved) and len(ev.block_hashes) == 1
                (h,) = ev.block_hashes
                assert h in pool, "removal of a block not cached"
                assert h not in pool.values(), "evicted a block with a cached child"
                del pool[h]
                stats["removed"] += 1
            assert len(pool) <= CFG.capacity
    meta = json.loads(Path(trace["meta"]).read_text())
    assert stats["stored"] + stats["removed"] == meta["block_events"]
    assert stats["events"] == meta["events"]
    assert stats["removed"] > 0 and stats["one_block_stores"] > 0
    assert stats["max_event_blocks"] == CFG.max_event_blocks  # 2,048-token prefill events occur
    resident, _ = load_truth(trace["truth"])
    assert {p: set(c) for p, c in cached.items()} == resident
    assert all(len(c) == CFG.capacity for c in cached.values())  # pools are full at the end


def test_our_index_answers_the_truth(trace):
    dec = BatchDecoder()
    idx = PrefixIndex()
    for engine, payload in read(trace["trace"]):
        idx.apply_batch(engine, dec.decode(payload).batch, model=MODEL)
    resident, prompts = load_truth(trace["truth"])
    assert idx.counters().resident_entries == sum(len(s) for s in resident.values())
    kinds = set()
    for n, arr in prompts.items():
        assert arr.shape == (CFG.lookup_prompts, n)
        for p in arr:
            exp = expected_blocks(resident, p)
            r = idx.lookup(p.tolist(), model=MODEL)
            assert {m.engine: m.tokens // BS for m in r.engines if m.tokens} == exp
            best = max(exp.values(), default=0)
            kinds.add("miss" if not best else "full" if best == n // BS else "partial")
    assert kinds == {"miss", "full", "partial"}


def _arr(tokens):
    import numpy as np

    return np.asarray(tokens, dtype=np.int32)
