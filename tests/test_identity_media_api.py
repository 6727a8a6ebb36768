"""Chats with images matched block by block beyond the first image: ``/v1/lookup``,
``/v1/route`` and the gateway, on a real server.

The engines publish with vLLM's own code: its ``Request`` with ``MultiModalFeatureSpec``
items, its block hasher, ``generate_block_hash_extra_keys`` / ``to_event_extra_keys``,
its ``BlockStored`` and its ``ZmqEventPublisher``. Their OpenAI side is the fake engine
(``tests/hostile_engine.py``) answering ``/v1/chat/completions/render`` in vLLM's shape
(token ids, ``mm_hashes``, ``mm_placeholders``): what a real engine's render would say
is what its events say, by construction here (a real engine's render and events:
tests/test_vllm_media_engine.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import httpx
import pytest

from hostile_engine import EngineThread
from support import ServerThread, free_port, wait_until
from kvevents.api import create_app
from kvevents.gateway.media import parse_render, render_body
from kvevents.service.settings import AggregatorSettings, EngineSpec

BS = 16
IMG = 7  # the placeholder token
IMG_LEN = 40  # placeholder tokens per image (2.5 blocks)
SYSTEM = {"role": "system", "content": "You describe pictures for a careful reader, in one line."}


def image(name: str, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": f"https://example.com/{name}.png"}}
    return {**part, "uuid": uuid} if uuid else part


def chat(*parts) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Compare these two:"}, *parts,
                                                 {"type": "text", "text": "Which one is brighter?"}]}]


def fake_render(body: dict) -> dict:
    """A render in vLLM's shape: a token per character of text, IMG_LEN placeholder
    tokens per image; the identifier is the part's uuid, else a digest of its URL."""
    ids, hashes, places = [1], [], []
    for m in body["messages"]:
        ids.append(2)
        content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        for p in content:
            if p["type"] == "text":
                ids += [100 + ord(c) % 200 for c in p["text"]]
            else:
                hashes.append(p.get("uuid") or hashlib.sha256(p["image_url"]["url"].encode()).hexdigest())
                places.append({"offset": len(ids), "length": IMG_LEN})
                ids += [IMG] * IMG_LEN
        ids.append(3)
    return {"token_ids": ids, "sampling_params": {},
            "features": {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": places}}
            if hashes else None}


def vllm_batch(messages: list[dict], hashes: list[int]):
    """vLLM's own KVEventBatch for the chat's rendered prompt, and its block count."""
    from vllm.distributed import kv_events as ve
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    kcu.init_none_hash(sha256)
    doc = fake_render({"messages": messages})
    feats = doc["features"] or {"mm_hashes": {"image": []}, "mm_placeholders": {"image": []}}
    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=h,
                                mm_position=PlaceholderRange(offset=p["offset"], length=p["length"]), mm_hash=h)
          for h, p in zip(feats["mm_hashes"]["image"], feats["mm_placeholders"]["image"])]
    req = Request(request_id="r", prompt_token_ids=doc["token_ids"], sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, mm_features=mm or None)
    n = len(doc["token_ids"]) // BS
    extra, idx = [], 0
    for b in range(n):
        keys, idx = kcu.generate_block_hash_extra_keys(req, b * BS, (b + 1) * BS, idx)
        extra.append(keys)
    ev = ve.BlockStored(block_hashes=hashes[:n], parent_block_hash=None, token_ids=doc["token_ids"][:n * BS],
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=kcu.to_event_extra_keys(extra))
    return ve.KVEventBatch(ts=time.time(), events=[ev]), n


A, B, C = chat(image("cat"), image("dog")), chat(image("cat"), image("owl")), chat(image("fox"), image("dog"))


@pytest.fixture(scope="module")
def fleet():
    """e0 holds A (cat, dog), e1 holds B (cat, owl): the same text, the same first image."""
    pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
    from vllm.distributed import kv_events as ve

    ports = [free_port(), free_port()]
    eng = EngineThread([free_port(), free_port()], render=fake_render)
    pubs = [ve.ZmqEventPublisher(0, endpoint=f"tcp://*:{p}") for p in ports]
    settings = AggregatorSettings(engines=tuple(
        EngineSpec(f"e{i}", f"tcp://127.0.0.1:{p}", model="m", http=eng.urls[i]) for i, p in enumerate(ports)))
    try:
        with ServerThread(create_app(settings)) as srv:
            assert wait_until(lambda: all(e["connected"] for e in
                                          httpx.get(f"{srv.url}/v1/engines").json()["engines"]), 10)
            blocks = []
            for i, (pub, msgs) in enumerate(zip(pubs, (A, B))):
                batch, n = vllm_batch(msgs, list(range(1000 * i + 1, 1000 * i + 100)))
                pub.publish(batch)
                blocks.append(n)
            assert wait_until(lambda: all(e["blocks"] for e in
                                          httpx.get(f"{srv.url}/v1/engines").json()["engines"]), 10)
            yield srv, eng, blocks
    finally:
        for pub in pubs:
            pub.shutdown()
        eng.close()


def post(srv, path, body):
    return httpx.post(f"{srv.url}{path}", json=body, timeout=10)


def first_image_block(messages) -> int:
    return fake_render({"messages": messages})["features"]["mm_placeholders"]["image"][0]["offset"] // BS


def second_image_block(messages) -> int:
    return fake_render({"messages": messages})["features"]["mm_placeholders"]["image"][1]["offset"] // BS


def test_lookup_matches_beyond_the_first_image(fleet):
    srv, eng, blocks = fleet
    whole = blocks[0] * BS
    second = second_image_block(A) * BS  # A and B part at the second image's first block
    got = post(srv, "/v1/lookup", {"messages": A, "model": "m"}).json()
    assert "engines" in got, got
    assert got["engines"] == [{"engine": "e0", "matched_tokens": whole, "tiers": {"GPU": whole}},
                              {"engine": "e1", "matched_tokens": second, "tiers": {"GPU": second}}]
    got = post(srv, "/v1/lookup", {"messages": B, "model": "m"}).json()
    assert [(e["engine"], e["matched_tokens"]) for e in got["engines"]] == [("e1", blocks[1] * BS), ("e0", second)]
    # Another first image: only the text blocks before it.
    head = first_image_block(C) * BS
    got = post(srv, "/v1/lookup", {"messages": C, "model": "m"}).json()
    assert [(e["engine"], e["matched_tokens"]) for e in got["engines"]] == [("e0", head), ("e1", head)]
    assert head < second < whole
    # The render was asked with the body's own fields, without tensors.
    assert eng.stats.rendered[-1]["mm_payload"] == "none" and eng.stats.rendered[-1]["model"] == "m"
    # The same image under the client's uuid is another item (vLLM keys it by the uuid).
    got = post(srv, "/v1/lookup", {"messages": chat(image("cat", uuid="u-1"), image("dog")), "model": "m"}).json()
    assert [e["matched_tokens"] for e in got["engines"]] == [head, head]


def test_route_follows_the_images(fleet):
    srv, _, blocks = fleet
    assert post(srv, "/v1/route", {"messages": A, "model": "m"}).json()["engine"] == "e0"
    got = post(srv, "/v1/route", {"messages": B, "model": "m"}).json()
    assert got["engine"] == "e1" and got["matched_tokens"] == blocks[1] * BS


def test_gateway_routes_image_chats_by_their_images(fleet):
    srv, eng, blocks = fleet
    before = len(eng.stats.rendered)
    for msgs, engine in ((A, "e0"), (B, "e1"), (A, "e0"), (B, "e1")):
        resp = httpx.post(f"{srv.url}/v1/chat/completions", timeout=10,
                          json={"model": "m", "messages": msgs, "max_tokens": 2, "stream": True})
        assert resp.status_code == 200 and resp.headers["x-kvevents-engine"] == engine, resp.text
    rendered = eng.stats.rendered[before:]
    assert len(rendered) == 4 and all("stream" not in r and r["mm_payload"] == "none" for r in rendered)
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'kvevents_gateway_partial_prompts_total{reason="image"} 0.0' in text


@pytest.mark.parametrize("part,field", [
    ({"type": "image_url"}, "messages[0].content[0].image_url"),
    ({"type": "image_url", "image_url": {"url": "x"}, "bogus": 1}, "messages[0].content[0].bogus"),
    ({"type": "file", "file": {}}, "messages[0].content[0].type"),
    ({"type": "image_url", "image_url": {"url": "x"}, "uuid": 5}, "messages[0].content[0].uuid"),
    ({"type": "input_audio"}, "messages[0].content[0].input_audio"),
])
def test_bad_media_parts_are_422s_naming_the_field(fleet, part, field):
    srv, _, _ = fleet
    for path in ("/v1/lookup", "/v1/route"):
        resp = post(srv, path, {"messages": [{"role": "user", "content": [part]}], "model": "m"})
        assert resp.status_code == 422 and resp.json()["field"] == field, resp.text


def test_media_chat_without_render_or_tokenizer_is_a_422(fleet):
    srv, _, _ = fleet
    resp = post(srv, "/v1/lookup", {"messages": chat(image("cat")), "model": "nobody-serves-it"})
    assert resp.status_code == 422 and resp.json()["field"] == "messages", resp.text
    resp = post(srv, "/v1/lookup", {"messages": chat(image("cat")), "token_ids": [1], "model": "m"})
    assert resp.status_code == 422, resp.text


def test_render_answers_are_read_as_vllm_gives_them():
    doc = fake_render({"messages": A})
    ids, media = parse_render(doc)
    assert ids == doc["token_ids"] and [m.offset for m in media] == sorted(m.offset for m in media)
    assert [m.identifier for m in media] == doc["features"]["mm_hashes"]["image"]
    # Modalities are merged in prompt order (vLLM sorts items by offset).
    two = {"token_ids": [1] * 30, "features": {
        "mm_hashes": {"audio": ["a"], "image": ["i"]},
        "mm_placeholders": {"audio": [{"offset": 20, "length": 4}], "image": [{"offset": 2, "length": 4}]}}}
    assert [m.identifier for m in parse_render(two)[1]] == ["i", "a"]
    assert parse_render({"token_ids": [1, 2]}) == ([1, 2], ())
    for bad in ({}, {"token_ids": []}, {"token_ids": [1, -2]}, {"token_ids": [1], "features": {"mm_hashes": {}}},
                {"token_ids": [1], "features": {"mm_hashes": {"image": ["a"]},
                                                "mm_placeholders": {"image": []}}}):
        assert parse_render(bad) is None, bad
    assert render_body({"model": "m", "stream": True, "stream_options": {}, "messages": []}) == {
        "model": "m", "messages": [], "mm_payload": "none"}


def test_render_answers_of_vllms_own_models_are_read():
    """The answer as vLLM's render builds it (its ``GenerateRequest`` and
    ``MultiModalFeatures`` models, ``mm_payload="none"``: no tensors), dumped as its
    router dumps it."""
    pytest.importorskip("vllm", reason="needs the vllm extra (make vllm)")
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (GenerateRequest, MultiModalFeatures,
                                                                        PlaceholderRangeInfo)
    from vllm.sampling_params import SamplingParams

    feats = MultiModalFeatures(
        mm_hashes={"image": ["h-dog", "h-cat"], "audio": ["h-bark"]},
        mm_placeholders={"image": [PlaceholderRangeInfo(offset=40, length=8), PlaceholderRangeInfo(offset=3, length=8)],
                         "audio": [PlaceholderRangeInfo(offset=20, length=5)]})
    doc = GenerateRequest(token_ids=list(range(1, 60)), features=feats, sampling_params=SamplingParams()).model_dump()
    ids, media = parse_render(doc)
    assert ids == list(range(1, 60))
    assert media == (("h-cat", 3, 8), ("h-bark", 20, 5), ("h-dog", 40, 8))
    plain = GenerateRequest(token_ids=[5, 6], sampling_params=SamplingParams()).model_dump()
    assert parse_render(plain) == ([5, 6], ())


def test_lookup_by_token_ids_with_a_renders_features(fleet):
    """A client that rendered the chat itself sends the render's ids and features."""
    srv, _, blocks = fleet
    doc = fake_render({"messages": A})
    got = post(srv, "/v1/lookup", {"token_ids": doc["token_ids"], "features": doc["features"], "model": "m"}).json()
    assert [(e["engine"], e["matched_tokens"]) for e in got["engines"]] == [
        ("e0", blocks[0] * BS), ("e1", second_image_block(A) * BS)]
    route = post(srv, "/v1/route", {"token_ids": doc["token_ids"], "features": doc["features"], "model": "m"})
    assert route.json()["engine"] == "e0"
    # Without them: the text blocks before the first image only.
    got = post(srv, "/v1/lookup", {"token_ids": doc["token_ids"], "model": "m"}).json()
    assert [e["matched_tokens"] for e in got["engines"]] == [first_image_block(A) * BS] * 2
    bad = [({"mm_hashes": {"image": ["a"]}, "mm_placeholders": {}}, "features"),
           ({"mm_hashes": {"image": ["a", "b"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 2}]}},
            "features"),
           ({"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 0}]}},
            "features.mm_placeholders[...][0].length"),  # (msgspec: a dict value's path)
           ({"mm_hashes": {"image": ["a", "b"]},
             "mm_placeholders": {"image": [{"offset": 0, "length": 4}, {"offset": 2, "length": 4}]}}, "features")]
    for features, field in bad:
        resp = post(srv, "/v1/lookup", {"token_ids": doc["token_ids"], "features": features, "model": "m"})
        assert resp.status_code == 422 and resp.json()["field"] == field, (features, resp.text)
    resp = post(srv, "/v1/lookup", {"prompt": "hi", "features": doc["features"], "model": "m"})
    assert resp.status_code == 422 and resp.json()["field"] == "features", resp.text


@pytest.mark.parametrize("part,field", [
    ({"type": "refusal", "refusal": "no", "uuid": "u"}, "messages[0].content[0].uuid"),
    ({"text": "x", "image_url": {"url": "x"}}, "messages[0].content[0].image_url"),
])
def test_media_fields_on_text_parts_are_422s(fleet, part, field):
    srv, _, _ = fleet
    resp = post(srv, "/v1/lookup", {"messages": [{"role": "user", "content": [part]}], "model": "m"})
    assert resp.status_code == 422 and resp.json()["field"] == field, resp.text
