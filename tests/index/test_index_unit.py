"""Focused behaviours of the index and its hash table."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents.index import PrefixIndex
from kvevents.index.hashtable import U64Table
from kvevents.schema import BlockRemoved, BlockStored, KVEventBatch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 300), max_size=40)), max_size=30))
def test_u64table_matches_dict(ops):
    t = U64Table()
    ref: dict[int, int] = {}
    for is_put, keys in ops:
        keys = list(dict.fromkeys(k * 0x9E3779B97F4A7C15 % (1 << 64) for k in keys))
        arr = np.array(keys, dtype=np.uint64)
        if is_put:
            vals = np.arange(len(keys), dtype=np.int32) + len(ref)
            t.put(arr, vals)
            ref.update(zip(keys, vals.tolist()))
        else:
            found = t.delete(arr)
            assert found.tolist() == [k in ref for k in keys]
            for k in keys:
                ref.pop(k, None)
        assert len(t) == len(ref)
    probe = np.array(list(ref) + [12345, 67890], dtype=np.uint64)
    assert t.get(probe).tolist() == [ref.get(int(k), -1) for k in probe.tolist()]
    k, v = t.items()
    assert dict(zip(k.tolist(), v.tolist())) == ref


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
    assert [(p.pod, p.tokens, p.block_size) for p in r.pods] == [("a", 4, 4), ("b", 4, 2)]
    assert [p.pod for p in idx.lookup(toks, model="m").pods] == ["a"]
    assert idx.lookup(toks, model="nope").pods == []
    assert idx.lookup(toks, model="m", lora_name="x").pods == []


def test_queries_and_drop():
    idx = PrefixIndex()
    toks = list(range(12))
    for pod in ("a", "b"):
        idx.apply_batch(pod, KVEventBatch(0.0, [_stored([1, 2, 3], None, toks)]))
    idx.apply_batch("a", KVEventBatch(0.0, [_stored([4], 3, [7, 7, 7, 7], medium="CPU")]))
    info = idx.blocks_by_engine_hash(2)
    assert [(h.pod, h.tiers) for h in info.holders] == [("a", {"GPU": 1}), ("b", {"GPU": 1})]
    assert info.tokens == [4, 5, 6, 7] and info.depth == 2
    top = idx.top_prefixes()
    assert (top[0].tokens, top[0].pods, top[0].leading_tokens) == (12, ["a", "b"], toks)
    assert (top[1].tokens, top[1].pods) == (16, ["a"])
    assert idx.pod_block_counts("a") == {"GPU": 3, "CPU": 1}
    idx.drop_pod("a")
    assert idx.pods() == ["b"] and idx.pod_block_counts("a") == {}
    assert [p.pod for p in idx.lookup(toks).pods] == ["b"]
    assert idx.blocks_by_engine_hash(4).holders == []
    idx.drop_pod("b")
    assert idx.counters().distinct_blocks == 0


def test_u64table_large_batches_match_dict():
    # Event-/prompt-sized calls take the home-first path, the probe hints, claim
    # conflicts, tombstones and chunked rebuilds; sequential keys stress clustering.
    rng = np.random.default_rng(7)
    t = U64Table()
    ref: dict[int, int] = {}
    pool = np.concatenate([rng.integers(0, 1 << 63, 20_000).astype(np.uint64),
                           np.arange(1, 5_000, dtype=np.uint64)])
    for step in range(60):
        keys = np.unique(rng.choice(pool, int(rng.integers(1, 3_000))))
        rng.shuffle(keys)
        if step % 3 == 2:
            found = t.delete(keys)
            assert found.tolist() == [k in ref for k in keys.tolist()]
            for k in keys.tolist():
                ref.pop(k, None)
        else:
            vals = rng.integers(0, 1 << 30, keys.size).astype(np.int32)
            t.put(keys, vals)
            ref.update(zip(keys.tolist(), vals.tolist()))
        assert len(t) == len(ref)
        probe = rng.choice(pool, 1_000)
        assert t.get(probe).tolist() == [ref.get(k, -1) for k in probe.tolist()]
        k0 = int(probe[0])
        assert t.get_one(k0) == ref.get(k0, -1)
    k, v = t.items()
    assert dict(zip(k.tolist(), v.tolist())) == ref


def test_lookup_token_conversion_paths():
    from kvevents.index.index import _as_int64

    big = list(range(10_000))  # packed in pieces
    assert _as_int64(big).tolist() == big
    assert _as_int64([-5, 2**62]).tolist() == [-5, 2**62]
    assert _as_int64(np.arange(4, dtype=np.int32)).dtype == np.int64
    try:
        _as_int64([1.5])
    except TypeError:
        pass
    else:
        raise AssertionError("floats must be refused, as before")
