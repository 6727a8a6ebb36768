"""The gateway's render request against a real vLLM 0.32 server (CPU, the tiny text
model, ``--enable-scale-out``): the body the gateway sends
(:func:`kvevents.gateway.media.render_body`: the chat request's own fields,
``mm_payload: "none"``, not streamed) is accepted, and the answer's ids are the engine's
own (its ``/tokenize``); a server without the endpoint is remembered as such.

An image model is served in tests/test_vllm_media_engine.py (a tiny Idefics3: its
render's ``mm_hashes`` and placeholders, and the engine's own events, matched past the
image); image identity is also checked against vLLM's own hashing and event code in
tests/index/test_identity_media.py and tests/test_identity_media_api.py.

Where vLLM is not installed these tests skip; under ``CI=true`` a missing vLLM fails.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

HOW = "vLLM is not installed: run `make test CI=true` (installs the vllm extra) or pip install -e '.[vllm]'"
if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but vLLM is missing: " + HOW)
    pytest.skip(HOW, allow_module_level=True)

import httpx  # noqa: E402

from kvevents.demo.vllm_server import VllmServer  # noqa: E402
from kvevents.gateway.media import Renderer  # noqa: E402

pytestmark = pytest.mark.timeout(600)
CHAT = [{"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kvevents.demo.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("vllm-render")
    model = make_tiny_model(tmp / "tiny-llama", tokenizer=True)
    server = VllmServer(model, served_model_name="tiny", log=tmp / "vllm.log",
                        extra_args=["--enable-scale-out"]).start()
    try:
        server.wait_ready(420)
        yield server
    finally:
        server.stop()


def test_render_of_the_gateways_body_is_the_engines_ids(engine):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}

    async def run():
        async with httpx.AsyncClient() as client:
            renderer = Renderer(client)
            got = await renderer.render(engine.url, body)
            tok = await client.post(engine.url + "/tokenize", json={"model": "tiny", "messages": CHAT})
            gone = await renderer.render("http://127.0.0.1:9", body)  # nothing listens there
            return got, tok.json()["tokens"], gone
    got, tokens, gone = asyncio.run(run())
    assert got is not None and got[0] == tokens and got[1] == ()
    assert gone is None


def test_an_image_part_the_model_cannot_take_is_no_render(engine):
    """A text-only model refuses an image chat (400): no render, so the gateway falls
    back to the text before the image."""
    msgs = [*CHAT[:1], {"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]

    async def run():
        async with httpx.AsyncClient() as client:
            return await Renderer(client).render(engine.url, {"model": "tiny", "messages": msgs})
    assert asyncio.run(run()) is None
