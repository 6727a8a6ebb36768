"""Focused behaviours of the index and its hash table."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index import IndexBusy, PrefixIndex
from kvevents.index.wire import IngestDecoder
from kvevents.wire.schema import AllBlocksCleared, BatchEncoder, BlockRemoved, BlockStored, KVEventBatch


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3000), max_size=200)), max_size=30))
def test_tables_under_churn_match_a_set(ops):
    """Store / remove one-block sequences with clustered (sequential) hashes: the engine
    tables and the content table (linear probing, backward-shift deletion) must agree
    with a plain set through growth and heavy deletion."""
    idx = PrefixIndex()
    ref: set[int] = set()
    for is_store, keys in ops:
        keys = list(dict.fromkeys(keys))
        if is_store:
            new = [k for k in keys if k not in ref]
            evs = [_stored([k], None, [k, k + 1, k + 2, k + 3]) for k in new]
            ref.update(new)
        else:
            evs = [BlockRemoved(block_hashes=keys, medium=None)] if keys else []
            ref.difference_update(keys)
        idx.apply_batch("a", KVEventBatch(0.0, evs))
        assert idx.engine_block_counts("a") == ({"GPU": len(ref)} if ref else {})
    assert idx.engine_hashes("a") == ({"GPU": ref} if ref else {})
    assert idx.counters().distinct_blocks == len(ref)
    for k in list(ref)[:20]:
        assert [p.tokens for p in idx.lookup([k, k + 1, k + 2, k + 3]).engines] == [4]


def _mix64(x: int) -> int:
    """The core's key mixer (splitmix64's finaliser), to aim hashes at buckets."""
    m = (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


# Engine hashes whose home in an 8-bucket table (a new engine's) is one of its last
# three buckets: six of them fill a cluster that wraps past the table's end.
_TAIL_HASHES = [h for h in range(1, 400) if (_mix64(h) * 8) >> 64 >= 5][:6]


@settings(max_examples=60, deadline=None)
@given(st.permutations(_TAIL_HASHES), st.permutations(_TAIL_HASHES), st.integers(1, 6))
def test_deletes_across_the_table_end_keep_every_hash_reachable(put_order, del_order, keep):
    """Backward-shift deletion in a cluster that wraps from the last bucket to the first:
    after each removal every remaining hash must still be found from its home (a wrong
    cyclic distance leaves one behind a hole, where lookups and removals miss it)."""
    idx = PrefixIndex()
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([h], None, [h, h, 0, 1]) for h in put_order]))
    # The premise, so a change of mixer or first size fails here rather than quietly
    # testing less: an 8-bucket table whose cluster holds its last bucket and its first.
    core, pid = idx._core, idx._engines.get("a")
    assert core.engine_entries(pid, 7, 1)[0] == -1
    assert core.engine_entries(pid, 7, 1)[1] and core.engine_entries(pid, 0, 1)[1]
    left = set(put_order)
    for h in del_order[: len(del_order) - keep]:
        idx.apply_batch("a", KVEventBatch(0.0, [BlockRemoved(block_hashes=[h], medium=None)]))
        left.discard(h)
        assert {h for h in _TAIL_HASHES if idx.blocks_by_engine_hash(h).holders} == left
    assert idx.engine_hashes("a") == {"GPU": left}


def _stored(hashes, parent, tokens, bs=4, **kw):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, lora_id=None, medium=kw.pop("medium", None),
                       lora_name=kw.pop("lora_name", None), **kw)


def test_hybrid_groups_ignored_and_model_none_searches_all_models():
    idx = PrefixIndex()
    toks = list(range(8))
    s = idx.apply_batch("a", KVEventBatch(0.0, [
        _stored([1, 2], None, toks, group_idx=1, kv_cache_spec_kind="sliding_window"),
        _stored([3], None, toks[:4], group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[1], medium=None, group_idx=1),
    ]), model="m")
    assert s.ignored_events == 2
    idx.apply_batch("b", KVEventBatch(0.0, [_stored([9, 10], None, toks, bs=2)]), model="other")
    r = idx.lookup(toks)
    assert [(p.engine, p.tokens, p.block_size) for p in r.engines] == [("a", 4, 4), ("b", 4, 2)]
    assert [p.engine for p in idx.lookup(toks, model="m").engines] == ["a"]
    assert idx.lookup(toks, model="nope").engines == []
    assert idx.lookup(toks, model="m", lora_name="x").engines == []


def test_queries_and_drop():
    idx = PrefixIndex()
    toks = list(range(12))
    for engine in ("a", "b"):
        idx.apply_batch(engine, KVEventBatch(0.0, [_stored([1, 2, 3], None, toks)]))
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([4], 3, [7, 7, 7, 7], medium="CPU")]))
    info = idx.blocks_by_engine_hash(2)
    assert [(h.engine, h.tiers) for h in info.holders] == [("a", {"GPU": 1}), ("b", {"GPU": 1})]
    assert info.tokens == [4, 5, 6, 7] and info.depth == 2
    top = idx.top_prefixes()
    assert (top[0].tokens, top[0].engines, top[0].leading_tokens) == (12, ["a", "b"], toks)
    assert (top[1].tokens, top[1].engines) == (16, ["a"])
    assert idx.engine_block_counts("a") == {"GPU": 3, "CPU": 1}
    idx.drop_engine("a")
    assert idx.engines() == ["b"] and idx.engine_block_counts("a") == {}
    assert [p.engine for p in idx.lookup(toks).engines] == ["b"]
    assert idx.blocks_by_engine_hash(4).holders == []
    idx.drop_engine("b")
    assert idx.counters().distinct_blocks == 0


def test_lookup_token_inputs():
    """Lists and int64 / int32 / uint32 buffers give the same answer; a token outside
    int64 or a non-int is a ValueError, not a crash or a silent truncation."""
    import array

    idx = PrefixIndex()
    toks = list(range(16))
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([1, 2, 3, 4], None, toks)]))
    want = [("a", 16)]
    for form in (toks, np.array(toks, dtype=np.int64), np.array(toks, dtype=np.int32),
                 np.array(toks, dtype=np.uint32), array.array("q", toks)):
        assert [(p.engine, p.tokens) for p in idx.lookup(form).engines] == want
    for bad in ([1, 2, 2**63, 4], [1.5, 2, 3, 4], ["x"] * 4):
        with pytest.raises(ValueError):
            idx.lookup(bad)
    with pytest.raises(ValueError):
        idx.lookup(np.zeros(4, dtype=np.float64))


def test_bad_events_are_refused_whole_and_counted():
    """Each bad event is skipped before it changes anything, counted by reason; the
    rest of its batch applies (ISSUE: tokens >= 2^63 used to drop the batch's rest)."""
    idx = PrefixIndex()
    good = _stored([1], None, [1, 2, 3, 4])
    batch = KVEventBatch(0.0, [
        _stored([9], None, [1, 2, 2**63, 4]),                 # token outside int64
        _stored([8], None, [[1, 2], [3, 4], [5, 6], [7, 8]]),  # bigram pairs (EAGLE)
        _stored([1.5], None, [1, 2, 3, 4]),                   # hash of a wrong type
        good,
        BlockRemoved(block_hashes=["x"], medium=None),
    ])
    st_ = idx.apply_batch("a", batch)
    assert st_.refused_events == 4 and st_.stored_blocks == 1
    assert idx.counters().refused_events == {"a": {"bad_tokens": 1, "unsupported_tokens": 1,
                                                   "bad_hash": 2}}
    assert idx.engine_hashes("a") == {"GPU": {1}}
    assert idx.counters().distinct_blocks == 1


def test_namespace_and_tier_caps():
    """Namespaces (model, block size, LoRA) and tiers are capped: beyond a cap events
    are refused and counted; nothing overflows and lookups stay on their namespace."""
    idx = PrefixIndex(max_namespaces=8, max_namespaces_per_engine=4, max_tiers=3)
    for i in range(10):  # ten LoRA names on one engine: 4 fit
        idx.apply_batch("a", KVEventBatch(0.0, [_stored([i], None, [1, 2, 3, 4], lora_name=f"l{i}")]))
    assert idx.counters().refused_events["a"] == {"namespace_limit": 6}
    for engine in ("b", "c", "d"):  # total cap: 8
        idx.apply_batch(engine, KVEventBatch(0.0, [_stored([1], None, [1, 2, 3, 4], lora_name=f"x{engine}"),
                                                   _stored([2], None, [1, 2, 3, 4], lora_name=f"y{engine}")]))
    c = idx.counters()
    assert c.namespaces == 8 and c.refused_events["d"] == {"namespace_limit": 2}
    assert [p.engine for p in idx.lookup([1, 2, 3, 4], lora_name="l2").engines] == ["a"]
    assert idx.lookup([1, 2, 3, 4], lora_name="l7").engines == []
    for tier in ("CPU", "DISK", "EXTERNAL", "X"):  # GPU + 2 more fit
        idx.apply_batch("b", KVEventBatch(0.0, [_stored([1], None, [1, 2, 3, 4], medium=tier,
                                                        lora_name="xb")]))
    assert idx.counters().refused_events["b"] == {"tier_limit": 2}
    assert idx.counters().tiers == ["GPU", "CPU", "DISK"]


def test_old_per_pod_namespace_cap_keyword_still_applies():
    """``max_namespaces_per_pod`` (documented before engines were called engines) is
    still accepted and caps like ``max_namespaces_per_engine``."""
    idx = PrefixIndex(max_namespaces_per_pod=2)
    for i in range(5):
        idx.apply_batch("a", KVEventBatch(0.0, [_stored([i], None, [1, 2, 3, 4], lora_name=f"l{i}")]))
    assert idx.counters().refused_events["a"] == {"namespace_limit": 3}


def test_sglang_shapes_signed_hashes_and_pinned_cpu():
    """SGLang sends signed int64 hashes and CPU_PINNED for its host tier: the index
    folds CPU_PINNED into the CPU tier and hands hashes back as sent."""
    idx = PrefixIndex()
    toks = list(range(8))
    idx.apply_batch("s", KVEventBatch(0.0, [
        _stored([-5], None, toks[:4]), _stored([7], -5, toks[4:]),
        _stored([-5], None, toks[:4], medium="CPU_PINNED"),
    ]))
    assert idx.engine_hashes("s") == {"GPU": {-5, 7}, "CPU": {-5}}
    r = idx.lookup(toks)
    assert [(p.engine, p.tokens, p.tiers) for p in r.engines] == [("s", 8, {"GPU": 8, "CPU": 4})]
    assert [h.engine for h in idx.blocks_by_engine_hash(-5).holders] == ["s"]
    idx.apply_batch("s", KVEventBatch(0.0, [BlockRemoved(block_hashes=[-5], medium="CPU_PINNED")]))
    assert idx.engine_block_counts("s") == {"GPU": 2}


def test_more_than_64_engines_and_id_reuse():
    idx = PrefixIndex()
    toks = list(range(8))
    for i in range(150):
        idx.apply_batch(f"p{i:03d}", KVEventBatch(0.0, [_stored([1, 2], None, toks)]))
    r = idx.lookup(toks)
    assert len(r.engines) == 150 and r.engines[0].engine == "p000" and {p.tokens for p in r.engines} == {8}
    for i in range(0, 150, 2):
        idx.drop_engine(f"p{i:03d}")
    idx.apply_batch("zz", KVEventBatch(0.0, [_stored([1], None, toks[:4])]))
    r = idx.lookup(toks)
    assert [p.engine for p in r.engines][:3] == ["p001", "p003", "p005"] and r.engines[-1].engine == "zz"
    assert r.engines[-1].tokens == 4 and len(r.engines) == 76


def test_hostile_block_size_costs_only_its_own_event():
    """A 262,144-token block is hashed and indexed, but keeps no tokens and widens no
    storage for other blocks."""
    idx = PrefixIndex()
    before = idx.memory_bytes()
    big = list(range(262_144))
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([1], None, big, bs=262_144)]))
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([2], None, list(range(16)), bs=16)]))
    grown = idx.memory_bytes() - before
    assert grown < 4 * 262_144 * 8  # scratch buffers only; no per-block widening
    assert idx.blocks_by_engine_hash(1).tokens is None
    assert idx.blocks_by_engine_hash(2).tokens == list(range(16))
    assert [p.tokens for p in idx.lookup(big).engines] == [262_144]


def test_export_import_round_trip_and_corruption():
    idx = PrefixIndex()
    toks = list(range(12))
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([1, 2, 3], None, toks),
                                            _stored([b"\\x01" * 32], 3, [9, 9, 9, 9], medium="CPU")]))
    idx.apply_batch("b", KVEventBatch(0.0, [_stored([1, 2], None, toks[:8]), _stored([1], None, toks[:4])]))
    data = idx.export_state()
    fresh = PrefixIndex()
    fresh.import_state(data)
    for engine in ("a", "b"):
        assert fresh.engine_hashes(engine) == idx.engine_hashes(engine)
        assert fresh.engine_block_counts(engine) == idx.engine_block_counts(engine)
    assert fresh.lookup(toks + [9, 9, 9, 9]) == idx.lookup(toks + [9, 9, 9, 9])
    assert fresh.counters() == idx.counters()
    # Refcounts survive: b's block 1 was announced twice.
    fresh.apply_batch("b", KVEventBatch(0.0, [BlockRemoved(block_hashes=[1], medium=None)]))
    assert fresh.engine_block_counts("b") == {"GPU": 2}
    # A damaged document raises ValueError and leaves the index as it was.
    for bad in (data[: len(data) // 2], b"\\x00" + data[1:], b"", data.replace(b"version", b"versiom")):
        with pytest.raises(ValueError):
            fresh.import_state(bad)
        assert fresh.engine_block_counts("a") == idx.engine_block_counts("a")


def test_lookup_nonblocking_raises_when_busy():
    from kvevents.index import IndexBusy

    idx = PrefixIndex()
    with idx.lock:
        with pytest.raises(IndexBusy):
            idx.lookup([1, 2, 3, 4], blocking=False)
    assert idx.lookup([1, 2, 3, 4], blocking=False).engines == []


def test_raw_token_arrays_every_msgpack_int_width():
    """The ingest decoder leaves token ids as raw msgpack; the core reads every int
    width (fixint, uint8..64, int8..64, negative fixint) exactly as the list path
    does, refuses what is not an int64 and counts bigram pairs as unsupported."""
    from kvevents.wire.schema import BatchDecoder, BatchEncoder

    enc, raw = BatchEncoder(), BatchDecoder(raw_tokens=True)
    toks = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**62,
            -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
    toks += [7] * (-len(toks) % 4)
    ev = _stored(list(range(1, len(toks) // 4 + 1)), None, toks)
    a, b = PrefixIndex(), PrefixIndex()
    a.apply_batch("p", KVEventBatch(0.0, [ev]))
    b.apply_batch("p", raw.decode(enc.encode(KVEventBatch(0.0, [ev]))).batch)
    assert a.lookup(toks) == b.lookup(toks) and b.lookup(toks).engines[0].tokens == len(toks)
    bad = KVEventBatch(0.0, [_stored([50], None, [1, 2, 3, 2**63]),
                             _stored([51], None, [[1, 2], [3, 4], [5, 6], [7, 8]]),
                             _stored([52], None, [1, 2, 3, 4])])
    st_ = b.apply_batch("q", raw.decode(enc.encode(bad)).batch)
    assert st_.refused_events == 2 and st_.stored_blocks == 1
    assert b.counters().refused_events["q"] == {"bad_tokens": 1, "unsupported_tokens": 1}


def test_block_sizes_per_model_are_capped_so_lookups_stay_cheap():
    """2,048 distinct block sizes for one model would make every lookup try 2,048
    namespaces; beyond ``max_block_sizes`` they are refused and counted."""
    idx = PrefixIndex(max_block_sizes=3)
    for bs in range(1, 11):
        idx.apply_batch("a", KVEventBatch(0.0, [_stored([bs], None, list(range(bs)), bs=bs)]), model="m")
    assert idx.counters().refused_events["a"] == {"namespace_limit": 7}
    assert len(idx._spaces("m", None)) == 3
    # Another model has its own allowance.
    idx.apply_batch("b", KVEventBatch(0.0, [_stored([1], None, [1, 2, 3, 4], bs=4)]), model="n")
    assert [p.engine for p in idx.lookup([1, 2, 3, 4], model="n").engines] == ["b"]


def test_top_prefixes_cache_stays_bounded_whatever_is_asked():
    """Its keys come from the query string (model, limit): any number of distinct
    queries keeps at most PREFIX_CACHE_KEYS answers."""
    from kvevents.index.queries import PREFIX_CACHE_KEYS

    idx = PrefixIndex()
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([1], None, [1, 2, 3, 4])]), model="m")
    for i in range(5 * PREFIX_CACHE_KEYS):
        idx.top_prefixes(model=f"model-{i}", limit=1 + i % 7)
    assert len(idx._prefix_cache) <= PREFIX_CACHE_KEYS
    assert [p.tokens for p in idx.top_prefixes(model="m")] == [4]


def test_lookup_waits_for_the_lock_at_most_its_timeout():
    """The HTTP handlers wait on the event loop for at most a timeout, then hand the
    wait to a thread: IndexBusy says the timeout passed."""
    idx = PrefixIndex()
    with idx.lock:
        with pytest.raises(IndexBusy):
            idx.lookup([1, 2, 3], blocking=False)
        t0 = time.monotonic()
        with pytest.raises(IndexBusy):
            idx.lookup([1, 2, 3], timeout=0.05)
        assert 0.04 <= time.monotonic() - t0 < 1.0
    assert idx.lookup([1, 2, 3], timeout=0.05).engines == []


@pytest.mark.parametrize("path", ["decoded", "wire"])
def test_clearing_a_large_pod_lets_other_threads_run(path):
    """AllBlocksCleared (and a dropped engine) clears the pod without holding the GIL:
    it took ~2.5 ms per 20k blocks holding it, a stall for every HTTP request of the
    process. Here a Python thread keeps ticking while a 400k-block pod is cleared on
    another thread; with the GIL held the longest gap between its ticks would be the
    whole clear."""
    n = 400_000
    idx = PrefixIndex()
    idx.apply_batch("a", KVEventBatch(0.0, [_stored(list(range(1, n + 1)), None, list(range(n)), bs=1)]))
    assert idx.engine_block_counts("a") == {"GPU": n}
    batch = KVEventBatch(0.0, [AllBlocksCleared()])
    if path == "wire":
        batch = IngestDecoder().decode(BatchEncoder().encode(batch)).batch
        assert type(batch).__name__ == "WireBatch"
    span: list[float] = []

    def clear() -> None:
        span.append(time.perf_counter())
        idx.apply_batch("a", batch)
        span.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # the server's order of magnitude (0.25 ms)
    try:
        t = threading.Thread(target=clear)
        ticks = []
        t.start()
        while t.is_alive():
            ticks.append(time.perf_counter())
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert idx.engine_block_counts("a") == {}
    t0, t1 = span
    inside = [x for x in ticks if t0 <= x <= t1]
    gaps = [b - a for a, b in zip([t0, *inside], [*inside, t1])]
    assert t1 - t0 > 0.002, "the clear was too quick to tell"
    assert max(gaps) < 0.5 * (t1 - t0), (max(gaps), t1 - t0)
