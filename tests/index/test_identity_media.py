"""Images in a block's identity: vLLM 0.32 keys the blocks an image covers by the image's
identifier and offset, and a lookup with the prompt's items (``media``) must match
exactly the blocks vLLM would reuse.

Checked against vLLM's own code on the same inputs: its ``Request`` with
``MultiModalFeatureSpec`` items, its block hasher (``get_request_block_hasher``: the
engine hashes published), ``generate_block_hash_extra_keys`` and ``to_event_extra_keys``
(the events' extra keys), its event classes and msgpack encoder; the payloads go through
the aggregator's ingest decoder as any engine's would.
"""

from __future__ import annotations

import random

import pytest

from kvevents.index import PrefixIndex, media_items
from kvevents.index._core import extra_digest
from kvevents.index.media import block_extras

from index.test_identity import feed

BS = 4


def _vllm():
    pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
    from vllm.distributed import kv_events as ve
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    kcu.init_none_hash(sha256)

    def request(tokens, items, *, lora=None, salt=None):
        feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=i,
                                       mm_position=PlaceholderRange(offset=o, length=n), mm_hash=i)
                 for i, o, n in items]
        return Request(request_id="r", prompt_token_ids=list(tokens),
                       sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                       mm_features=feats or None, cache_salt=salt,
                       lora_request=LoRARequest(lora, 1, "/adapters/" + lora) if lora else None,
                       block_hasher=kcu.get_request_block_hasher(BS, sha256))
    return ve, kcu, request


def vllm_event_keys(tokens, items, *, lora=None, salt=None) -> list:
    """The per-block extra keys vLLM's BlockStored carries for the prompt."""
    _, kcu, request = _vllm()
    req = request(tokens, items, lora=lora, salt=salt)
    extra, idx = [], 0
    for b in range(len(tokens) // BS):
        keys, idx = kcu.generate_block_hash_extra_keys(req, b * BS, (b + 1) * BS, idx)
        extra.append(keys)
    return kcu.to_event_extra_keys(extra) or [None] * (len(tokens) // BS)


def vllm_payloads(tokens, items, *, lora=None, salt=None, split=None) -> list[bytes]:
    """What vLLM publishes for the prompt (its own block hashes, as ints), in one event
    or two (the second continuing the first, as a later prefill step's)."""
    ve, kcu, request = _vllm()
    req = request(tokens, items, lora=lora, salt=salt)
    hashes = [int.from_bytes(h[-8:], "big") for h in req.block_hashes]
    keys = vllm_event_keys(tokens, items, lora=lora, salt=salt)
    n = len(hashes)
    enc = ve.msgspec.msgpack.Encoder()
    out = []
    for lo, hi in ((0, n),) if split is None else ((0, split), (split, n)):
        ev = ve.BlockStored(block_hashes=hashes[lo:hi], parent_block_hash=hashes[lo - 1] if lo else None,
                            token_ids=list(tokens[lo * BS:hi * BS]), block_size=BS,
                            lora_id=1 if lora else None, medium="GPU", lora_name=lora,
                            extra_keys=None if all(k is None for k in keys[lo:hi]) else keys[lo:hi])
        out.append(enc.encode(ve.KVEventBatch(ts=1.0, events=[ev])))
    return out


def vllm_hashes(tokens, items, **kw) -> list[bytes]:
    _, _, request = _vllm()
    return list(request(tokens, items, **kw).block_hashes)


IMG = 9999  # the placeholder token: every image's tokens are the same ids
TEXT = list(range(100, 106))
# 6 text tokens, a 7-token image (blocks 1-3), 3 text, a 5-token image (blocks 4-5), 8 text
PROMPT = TEXT + [IMG] * 7 + [200, 201, 202] + [IMG] * 5 + list(range(300, 308))
ITEMS = [("img-a", 6, 7), ("img-b", 16, 5)]


def found(idx: PrefixIndex, items, **kw) -> dict[str, int]:
    return {m.engine: m.tokens for m in idx.lookup(PROMPT, media=media_items(items), **kw).engines}


@pytest.mark.parametrize("lora,salt", [(None, None), ("sql", None), (None, "tenant-a"), ("sql", "tenant-a")])
def test_block_extras_are_vllms_event_keys(lora, salt):
    """Per block, our digest of the prompt's items is the index's digest of vLLM's event
    keys (less the LoRA name), on random layouts; and two prompts' digests differ exactly
    where vLLM's block hashes start to differ."""
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randrange(BS, 12 * BS)
        tokens, items, pos = [], [], 0
        while pos < n:
            if rng.random() < 0.3:
                length = rng.randrange(1, 3 * BS)
                items.append((rng.choice(["a", "b", "c"]) + str(pos), pos, length))
                tokens += [IMG] * length
                pos += length
            else:
                tokens.append(rng.randrange(1000))
                pos += 1
        keys = vllm_event_keys(tokens, items, lora=lora, salt=salt)
        ours = block_extras(media_items(items), BS, len(tokens) // BS, salt)
        for b, k in enumerate(keys):
            k = tuple(k or ())[1 if lora else 0:]
            assert int(ours[b]) == (extra_digest(k) if k else 0), (items, b, k)


def test_blocks_match_up_to_where_vllm_hashes_differ():
    base = vllm_hashes(PROMPT, ITEMS)
    for other, first_diff in (([("img-x", 6, 7), ITEMS[1]], 1),   # another first image
                              ([ITEMS[0], ("img-x", 16, 5)], 4),  # another second image
                              ([("img-a", 5, 7), ITEMS[1]], 1)):  # the same image, elsewhere
        theirs = vllm_hashes(PROMPT, other)
        assert [a == b for a, b in zip(base, theirs)] == [i < first_diff for i in range(len(base))]
        ours = block_extras(media_items(ITEMS), BS, len(PROMPT) // BS)
        alt = block_extras(media_items(other), BS, len(PROMPT) // BS)
        assert next(b for b in range(len(ours)) if ours[b] != alt[b]) == first_diff


@pytest.fixture(scope="module")
def fleet() -> PrefixIndex:
    idx = PrefixIndex()
    feed(idx, "a", vllm_payloads(PROMPT, ITEMS, split=2))            # img-a then img-b
    feed(idx, "x", vllm_payloads(PROMPT, [("img-x", 6, 7), ITEMS[1]]))  # another first image
    feed(idx, "b2", vllm_payloads(PROMPT, [ITEMS[0], ("img-x", 16, 5)]))  # another second one
    feed(idx, "sql", vllm_payloads(PROMPT, ITEMS, lora="sql"))
    feed(idx, "ta", vllm_payloads(PROMPT, ITEMS, salt="tenant-a", split=3))
    feed(idx, "text", vllm_payloads(PROMPT, []))                       # the same ids, no items
    return idx


def test_lookup_with_the_items_finds_exactly_vllms_blocks(fleet):
    whole = len(PROMPT) // BS * BS
    # Each engine's run ends where its blocks' hashes stop being the prompt's.
    # The first block (text) is everyone's but the adapter's and the tenant's.
    head = {"a": 4, "b2": 4, "x": 4, "text": 4}
    assert found(fleet, ITEMS) == {**head, "a": whole, "b2": 16}
    assert found(fleet, [("img-x", 6, 7), ITEMS[1]]) == {**head, "x": whole}
    assert found(fleet, [ITEMS[0], ("img-x", 16, 5)]) == {**head, "b2": whole, "a": 16}
    assert found(fleet, [("img-a", 5, 7), ITEMS[1]]) == head  # the same image, moved
    assert found(fleet, ITEMS, lora_name="sql") == {"sql": whole}
    assert found(fleet, ITEMS, cache_salt="tenant-a") == {"ta": whole}
    assert found(fleet, ITEMS, cache_salt="tenant-b") == {}
    # Without items: the text blocks before the first image (and the item-less engine).
    assert found(fleet, []) == {**head, "text": whole}


def tower_identifier(identifier: str, lora: str) -> str:
    """The identifier a vLLM engine started with ``--enable-tower-connector-lora`` gives
    an adapter request's item (its own ``InputProcessor._get_mm_identifier``)."""
    from types import SimpleNamespace

    from vllm.config.lora import LoRAConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.input_processor import InputProcessor

    engine = SimpleNamespace(lora_config=LoRAConfig(enable_tower_connector_lora=True))
    return InputProcessor._get_mm_identifier(engine, identifier, LoRARequest(lora, 1, "/adapters/" + lora))


def test_an_adapters_items_match_on_tower_connector_engines_and_plain_ones():
    """The render answers an item's bare hash; an engine with tower-connector LoRA keys
    an adapter's item as ``sql:<hash>``. A lookup under the adapter with the bare items
    finds each engine's whole run, whichever form it keys by, and nothing under another
    adapter or without one."""
    _vllm()
    tower = [(tower_identifier(i, "sql"), o, n) for i, o, n in ITEMS]
    assert tower[0][0] != ITEMS[0][0]
    idx = PrefixIndex()
    feed(idx, "plain", vllm_payloads(PROMPT, ITEMS, lora="sql"))
    feed(idx, "tower", vllm_payloads(PROMPT, tower, lora="sql", split=2))
    feed(idx, "tower2", vllm_payloads(PROMPT, [tower[0], (tower_identifier("img-x", "sql"), 16, 5)], lora="sql"))
    feed(idx, "sql2", vllm_payloads(PROMPT, [(tower_identifier(i, "sql2"), o, n) for i, o, n in ITEMS], lora="sql2"))
    whole = len(PROMPT) // BS * BS
    assert found(idx, ITEMS, lora_name="sql") == {"plain": whole, "tower": whole, "tower2": 16}
    assert found(idx, ITEMS, lora_name="sql2") == {"sql2": whole}
    assert found(idx, ITEMS) == {}
    # the lookup's order: tokens descending, then the engine's name
    assert [m.engine for m in idx.lookup(PROMPT, media=media_items(ITEMS), lora_name="sql").engines] == \
        ["plain", "tower", "tower2"]


def test_items_are_checked():
    assert media_items([("b", 9, 2), ("a", 1, 3)]) == (("a", 1, 3), ("b", 9, 2))
    for bad in ([("", 0, 1)], [("a", -1, 2)], [("a", 0, 0)], [("a", 0, 4), ("b", 3, 2)]):
        with pytest.raises(ValueError):
            media_items(bad)
