"""Stock SGLang 0.5.x publishers: SGLang's own ZmqEventPublisher and event classes,
followed by our aggregator over real loopback sockets, checked block by block.

Needs ``sglang`` importable (``make test`` installs it with --no-deps plus the modules
its ``kv_events`` imports); skipped with a clear reason otherwise.
"""

from __future__ import annotations

import time

import pytest

from support import free_port, wait_until
from kvevents.service.aggregator import Aggregator
from kvevents.service.settings import AggregatorSettings, EngineSpec

try:
    from sglang.srt.disaggregation import kv_events as sgl
except Exception as exc:  # ImportError, or a missing transitive module
    pytest.skip(f"sglang not importable ({type(exc).__name__}: {exc}); "
                "`make test` installs sglang==0.5.23", allow_module_level=True)

PAGE = 4


def page(h, parent, first, **kw):
    """One SGLang page: one hash per BlockStored, as SGLang's radix cache emits."""
    return sgl.BlockStored(block_hashes=[h], parent_block_hash=parent,
                           token_ids=list(range(first, first + PAGE)), block_size=PAGE,
                           lora_id=None, **kw)


@pytest.fixture
def setup():
    live, replay = free_port(), free_port()
    pub = sgl.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{live}",
                                replay_endpoint=f"tcp://127.0.0.1:{replay}", bind=True,
                                buffer_steps=100)
    agg = Aggregator(AggregatorSettings(engines=(EngineSpec(
        "sg", f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}"),)))
    agg.start()
    yield pub, agg
    agg.stop()
    pub.shutdown()


def tier_hashes(agg, *tiers):
    got = agg.index.engine_hashes("sg")
    return set().union(*(set(got.get(t, ())) for t in tiers))


def test_sglang_publisher_is_indexed_exactly(setup):
    pub, agg = setup
    n = -(2**63) + 5  # signed int64 hashes, as SGLang sends them
    a, b, c = n, -42, 7
    batches = [
        [page(a, None, 0), page(b, a, PAGE), page(c, b, 2 * PAGE)],  # GPU (medium omitted)
        [page(a, None, 0, medium="CPU_PINNED"), page(b, a, PAGE, medium="CPU_PINNED")],
        [page(-9, None, 100, lora_name="adapter-x")],
        [sgl.BlockRemoved(block_hashes=[c])],
    ]
    for events in batches:
        pub.publish(sgl.KVEventBatch(ts=time.time(), events=events))
    assert wait_until(lambda: agg.engine_statuses()[0]["batches"] == 4, 10), agg.engine_statuses()
    st = agg.engine_statuses()[0]
    assert st["malformed"] == 0 and st["lost_batches"] == 0
    assert tier_hashes(agg, "GPU") == {a, b, -9}
    assert tier_hashes(agg, "CPU", "CPU_PINNED") == {a, b}
    hit = agg.lookup(list(range(0, 3 * PAGE)))
    assert [(p.engine, p.tokens) for p in hit.engines] == [("sg", 2 * PAGE)]
    assert agg.lookup(list(range(100, 100 + PAGE)), lora_name="adapter-x").engines[0].tokens == PAGE
    assert agg.lookup(list(range(100, 100 + PAGE))).engines == []

    pub.publish(sgl.KVEventBatch(ts=time.time(), events=[sgl.AllBlocksCleared()]))
    assert wait_until(lambda: agg.engine_statuses()[0]["batches"] == 5, 10)
    assert agg.index.engine_hashes("sg") in ({}, {"GPU": set()}) or not any(
        agg.index.engine_hashes("sg").values())


def test_salted_and_adapter_pages_keep_their_identity(setup):
    """SGLang's own recorder names the salt on every page of a salted sequence and the
    adapter as ``lora_name``: matched only under that identity, never shown without it,
    and the batch's ``attn_dp_rank`` is read."""
    pub, agg = setup
    salted = [page(-11, None, 0, cache_salt="tenant-a"), page(-12, -11, PAGE, cache_salt="tenant-a")]
    adapter = [page(-21, None, 0, lora_name="sql"), page(-22, -21, PAGE, lora_name="sql"),
               page(-23, -22, 2 * PAGE, lora_name="sql")]
    both = [page(-31, None, 0, lora_name="sql", cache_salt="tenant-a")]
    pub.publish(sgl.KVEventBatch(ts=time.time(), events=salted + adapter + both))
    assert wait_until(lambda: agg.engine_statuses()[0]["batches"] == 1, 10), agg.engine_statuses()
    ids = list(range(0, 3 * PAGE))
    got = lambda **kw: [(m.engine, m.tokens) for m in agg.lookup(ids, **kw).engines]  # noqa: E731
    assert got() == []
    assert got(cache_salt="tenant-a") == [("sg", 2 * PAGE)]
    assert got(cache_salt="tenant-b") == []
    assert got(lora_name="sql") == [("sg", 3 * PAGE)]
    assert got(lora_name="sql", cache_salt="tenant-a") == [("sg", PAGE)]
    shown = agg.index.top_prefixes(limit=50)
    assert shown and all(p.lora_name == "sql" for p in shown)
    assert agg.index.blocks_by_engine_hash(-11).holders == []
    assert agg.index.blocks_by_engine_hash(-21).holders != []


def test_bigram_pages_decode_without_losing_the_batch(setup):
    pub, agg = setup
    from kvevents.wire.schema import BatchDecoder, tokens_are_pairs

    bigram = sgl.BlockStored(block_hashes=[-77], parent_block_hash=None,
                             token_ids=[[1, 2], [2, 3], [3, 4], [4, 5]], block_size=PAGE,
                             lora_id=None)
    batch = sgl.KVEventBatch(ts=time.time(), events=[bigram, page(5, None, 0)])
    payload = sgl.msgspec.msgpack.Encoder().encode(batch)
    got = BatchDecoder().decode(payload)
    assert got.skipped_events == 0 and len(got.batch.events) == 2
    assert tokens_are_pairs(got.batch.events[0]) and not tokens_are_pairs(got.batch.events[1])
    assert got.batch.events[0].block_hashes == [-77]
