"""A block's identity is the engine's: adapter, cache salt, tier, as vLLM and SGLang
send them, matched only under the same identity and never shown without it.

The vLLM payloads are built with vLLM's own code (``Request``,
``generate_block_hash_extra_keys``, ``to_event_extra_keys``, its event classes and
msgpack encoder) on the same inputs, and fed through the aggregator's ingest decoder
(so both the compiled wire lane and the general path are exercised).
"""

from __future__ import annotations

import pytest

from kvevents.index import PrefixIndex
from kvevents.index.wire import IngestDecoder, WireBatch
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch

BS = 4
TOKS = list(range(100, 116))  # 4 blocks


def _vllm():
    pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
    from vllm.distributed import kv_events as ve
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    from vllm.v1.request import Request
    return ve, LoRARequest, SamplingParams, generate_block_hash_extra_keys, to_event_extra_keys, Request


def vllm_payloads(hashes: list[int], *, lora: str | None = None, salt: str | None = None,
                  split: int = 2) -> list[bytes]:
    """What vLLM 0.32 publishes for a prompt of TOKS under (lora, salt), in two events
    (the second continuing the first, as a later prefill step's): extra keys from its
    own functions, encoded by its own event classes."""
    ve, LoRARequest, SamplingParams, gen, to_event, Request = _vllm()
    req = Request(request_id="r", prompt_token_ids=TOKS, sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, cache_salt=salt,
                  lora_request=LoRARequest(lora, 1, "/adapters/" + lora) if lora else None)
    extra = [gen(req, i * BS, (i + 1) * BS, 0)[0] for i in range(len(TOKS) // BS)]
    enc = ve.msgspec.msgpack.Encoder()
    out = []
    for lo, hi in ((0, split), (split, len(extra))):
        ev = ve.BlockStored(block_hashes=hashes[lo:hi], parent_block_hash=hashes[lo - 1] if lo else None,
                            token_ids=TOKS[lo * BS:hi * BS], block_size=BS, lora_id=1 if lora else None,
                            medium="GPU", lora_name=lora, extra_keys=to_event(extra[lo:hi]))
        out.append(enc.encode(ve.KVEventBatch(ts=1.0, events=[ev])))
    return out


def feed(idx: PrefixIndex, engine: str, payloads: list[bytes]) -> list[bool]:
    """Apply through the ingest decoder; which batches took the compiled wire path."""
    dec = IngestDecoder()
    lanes = []
    for p in payloads:
        b = dec.decode(p).batch
        lanes.append(type(b) is WireBatch)
        idx.apply_batches(engine, [b])
    return lanes


def tokens(idx: PrefixIndex, **kw) -> dict[str, int]:
    return {m.engine: m.tokens for m in idx.lookup(TOKS, **kw).engines}


@pytest.fixture(scope="module")
def fleet() -> PrefixIndex:
    """One engine per identity, each holding TOKS as vLLM publishes it."""
    idx = PrefixIndex()
    assert feed(idx, "plain", vllm_payloads([1, 2, 3, 4])) == [True, True]
    assert feed(idx, "sql", vllm_payloads([11, 12, 13, 14], lora="sql")) == [False, False]
    assert feed(idx, "chat", vllm_payloads([21, 22, 23, 24], lora="chat")) == [False, False]
    # A salted sequence: only its first event has an extra key; the continuation is of
    # the common shape (the wire lane) and must stay the tenant's.
    assert feed(idx, "ta", vllm_payloads([31, 32, 33, 34], salt="tenant-a")) == [False, True]
    assert feed(idx, "tb", vllm_payloads([41, 42, 43, 44], salt="tenant-b")) == [False, True]
    feed(idx, "sql-ta", vllm_payloads([51, 52, 53, 54], lora="sql", salt="tenant-a"))
    return idx


def test_each_identity_matches_only_its_own_blocks(fleet):
    assert tokens(fleet) == {"plain": 16}
    assert tokens(fleet, lora_name="sql") == {"sql": 16}
    assert tokens(fleet, lora_name="chat") == {"chat": 16}
    assert tokens(fleet, lora_name="other") == {}
    assert tokens(fleet, cache_salt="tenant-a") == {"ta": 16}
    assert tokens(fleet, cache_salt="tenant-b") == {"tb": 16}
    assert tokens(fleet, cache_salt="tenant-c") == {}
    assert tokens(fleet, lora_name="sql", cache_salt="tenant-a") == {"sql-ta": 16}
    assert tokens(fleet, model="m", cache_salt="tenant-a") == {}  # fed without a model
    # vLLM: an empty salt is no salt.
    assert tokens(fleet, cache_salt="") == {"plain": 16}


def test_salted_blocks_are_never_shown(fleet):
    shown = fleet.top_prefixes(limit=100)
    assert sorted(e for p in shown for e in p.engines) == ["chat", "plain", "sql"]
    for h in (31, 32, 33, 34, 41, 51, 54):
        info = fleet.blocks_by_engine_hash(h)
        assert info.holders == [] and info.tokens is None, h
    assert fleet.blocks_by_engine_hash(1).tokens == TOKS[:BS]
    # Still resident, counted per tier like any block.
    assert fleet.engine_block_counts("ta") == {"GPU": 4}


def test_identity_survives_a_snapshot(fleet):
    again = PrefixIndex()
    again.import_state(fleet.export_state())
    assert tokens(again, cache_salt="tenant-a") == {"ta": 16}
    assert tokens(again, lora_name="sql") == {"sql": 16}
    assert tokens(again) == {"plain": 16}
    assert not any("ta" in p.engines for p in again.top_prefixes(limit=100))


def test_salted_removals_and_continuations():
    idx = PrefixIndex()
    feed(idx, "ta", vllm_payloads([31, 32, 33, 34], salt="tenant-a"))
    idx.apply_batch("ta", KVEventBatch(1.0, [BlockRemoved(block_hashes=[33, 34], medium="GPU")]))
    assert tokens(idx, cache_salt="tenant-a") == {"ta": 8}
    assert idx.engine_block_counts("ta") == {"GPU": 2}


def sgl_page(h: int, parent: int | None, first: int, **kw) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=parent,
                       token_ids=TOKS[first:first + BS], block_size=BS, lora_id=None, **kw)


def test_sglang_salt_and_adapter_key_like_vllm():
    """SGLang names the salt on every page of a salted sequence and the adapter only as
    ``lora_name``: the same identity as vLLM's keys, so one lookup finds both."""
    idx = PrefixIndex()
    feed(idx, "vllm-ta", vllm_payloads([31, 32, 33, 34], salt="tenant-a"))
    feed(idx, "vllm-sql", vllm_payloads([11, 12, 13, 14], lora="sql"))
    pages = [sgl_page(-5, None, 0, cache_salt="tenant-a"), sgl_page(-6, -5, 4, cache_salt="tenant-a"),
             sgl_page(-7, None, 0, lora_name="sql"), sgl_page(-8, -7, 4, lora_name="sql"),
             sgl_page(-9, None, 0, lora_name="sql", cache_salt="tenant-a")]
    idx.apply_batch("sg", KVEventBatch(1.0, pages))
    assert tokens(idx, cache_salt="tenant-a") == {"vllm-ta": 16, "sg": 8}
    assert tokens(idx, lora_name="sql") == {"vllm-sql": 16, "sg": 8}
    assert tokens(idx, lora_name="sql", cache_salt="tenant-a") == {"sg": 4}
    assert tokens(idx) == {}
    assert idx.top_prefixes(limit=100) and all("vllm-ta" not in p.engines and p.lora_name == "sql"
                                                for p in idx.top_prefixes(limit=100))
    assert idx.blocks_by_engine_hash(-5).holders == []


def test_mediums_are_normalised_and_remote_is_its_own_tier():
    idx = PrefixIndex()
    media = [("cpu", None), ("CPU_PINNED", None), ("cpu_pinned", None), ("disk", None),
             ("EXTERNAL", None), ("gpu", None), ("STORAGE", "REMOTE")]
    evs = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[h] * BS, block_size=BS,
                       medium=medium, locality=loc) for h, (medium, loc) in enumerate(media, 1)]
    idx.apply_batch("e", KVEventBatch(1.0, evs))
    assert idx.engine_block_counts("e") == {"CPU": 3, "DISK": 1, "EXTERNAL": 1, "GPU": 1, "REMOTE": 1}
    idx.apply_batch("e", KVEventBatch(2.0, [BlockRemoved(block_hashes=[7], medium="STORAGE",
                                                         locality="remote"),
                                            BlockRemoved(block_hashes=[2], medium="cpu")]))
    assert idx.engine_block_counts("e") == {"CPU": 2, "DISK": 1, "EXTERNAL": 1, "GPU": 1}
    assert idx.counters().unknown_removals == {}
