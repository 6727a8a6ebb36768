"""Image chats matched block by block past the image, on a real vLLM 0.32 engine (CPU).

One module-scoped stack: ``kvevents serve`` (a subprocess, binding the engine's live
event endpoint) and one ``vllm serve`` of a tiny random Idefics3 model
(:func:`kvevents.demo.tiny_model.make_tiny_vlm`: an image processor with a PIL backend,
so no ``torchvision``) with ``--enable-scale-out`` (its render endpoint). The blocks are
the engine's own: its ``BlockStored`` events, hashed by vLLM with the image's
``mm_hash`` in the extra keys of every block the image's placeholder touches. Proved:

- a chat of text, an image (inline PNG), then text over more blocks, sent once to the
  engine, is found by ``POST /v1/lookup`` of the same messages (kvevents renders them
  with the engine's ``/v1/chat/completions/render``) up to its last full block, blocks
  after the image included;
- the same chat with another image matches only up to the block holding the image's
  first placeholder token;
- through the gateway, the repeat of the chat and the one with the other image are
  routed by their render (no partial prompt), and the ``cached_tokens`` the engine
  reports are the tokens the index predicted, request by request.

Where vLLM is not installed these tests skip; under ``CI=true`` a missing vLLM fails.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import free_port, require_vllm, stop_process, wait_gateway_engines, wait_serving, wait_until

ROOT = Path(__file__).resolve().parent.parent
require_vllm()

import httpx  # noqa: E402
from PIL import Image  # noqa: E402 (installed with vLLM)

from kvevents.demo.vllm_server import BLOCK_SIZE as BS  # noqa: E402
from kvevents.demo.vllm_server import VllmServer, server_env  # noqa: E402

MODEL = "tiny"
STARTUP = 300.0  # one engine on 2 cores: 40-90 s
pytestmark = pytest.mark.timeout(600)
BEFORE = ("You are a helpful assistant. Hello! How are you today? The cache holds key and value "
          "tensors for every token the model has already seen. Look at this picture:")
AFTER = ("When two requests share a prefix, the engine can reuse those blocks instead of recomputing "
         "them. A router that knows where each prefix lives sends a conversation back to the engine "
         "that still holds it: the answer starts sooner and costs less. Tell me a story about a cat.")


def png(color: str) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(color: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": BEFORE},
                                         {"type": "image_url", "image_url": {"url": png(color)}},
                                         {"type": "text", "text": AFTER}]}]


A, B = chat("red"), chat("blue")  # the same text, another image


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvevents.demo.tiny_model import make_tiny_vlm

    tmp = tmp_path_factory.mktemp("vllm-media")
    model = make_tiny_vlm(tmp / "tiny-vlm")
    port, http = free_port(), free_port()
    live, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--tokenizer", f"{MODEL}={model}", "--engine-poll-interval", "0.5", "--endpoint",
           f"e0={live},replay={replay},model={MODEL},http=http://127.0.0.1:{http},bind=1"]
    serve_log = tmp / "serve.log"
    with open(serve_log, "w") as log:
        serve = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    engine = VllmServer(model, port=http, endpoint=live, replay_endpoint=replay, served_model_name=MODEL,
                        log=tmp / "vllm.log", extra_args=["--enable-scale-out"]).start()
    gw = f"http://127.0.0.1:{port}"
    try:
        wait_serving(gw, serve, serve_log)
        t0 = time.monotonic()
        engine.wait_ready(STARTUP)
        print(f"\nengine ready in {time.monotonic() - t0:.0f} s")
        wait_gateway_engines(gw, 1, serve, serve_log, timeout=30)
        yield {"gw": gw, "engine": engine}
    finally:
        engine.stop()
        stop_process(serve, timeout=20)


def render(engine: VllmServer, messages: list[dict]) -> tuple[int, int, int]:
    """The engine's own render of the chat: (prompt tokens, the image's placeholder
    offset, its length)."""
    resp = httpx.post(engine.url + "/v1/chat/completions/render", timeout=60,
                      json={"model": MODEL, "messages": messages, "mm_payload": "none"})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    [place] = doc["features"]["mm_placeholders"]["image"]
    assert len(doc["features"]["mm_hashes"]["image"]) == 1, doc["features"]
    return len(doc["token_ids"]), place["offset"], place["length"]


def matched(gw: str, messages: list[dict]) -> int:
    resp = httpx.post(gw + "/v1/lookup", json={"messages": messages, "model": MODEL}, timeout=60)
    assert resp.status_code == 200, resp.text
    return sum(e["matched_tokens"] for e in resp.json()["engines"] if e["engine"] == "e0")


def metric(gw: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(gw + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_lookup_matches_the_engines_blocks_past_the_image(stack):
    gw, engine = stack["gw"], stack["engine"]
    n, offset, length = render(engine, A)
    assert render(engine, B)[0] == n  # the other image: as many tokens, in the same place
    whole, head = n // BS * BS, offset // BS * BS
    image_end = -(-(offset + length) // BS) * BS  # the end of the last block the image touches
    assert 0 < head and image_end + BS <= whole, (n, offset, length)  # text blocks on both sides
    resp = httpx.post(engine.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": A, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == n and usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    # The engine's events reach the index: the whole chat, to its last full block.
    assert wait_until(lambda: matched(gw, A) == whole, timeout=15, interval=0.2), (matched(gw, A), whole)
    # Another image: the blocks before the one its placeholder starts in.
    assert matched(gw, B) == head
    stack["figures"] = n, whole, head, image_end
    print(f"{n} prompt tokens, image at {offset}..{offset + length}: matched {whole} (same image), "
          f"{head} (another image)")


def test_gateway_predicts_the_engines_cached_tokens(stack):
    gw = stack["gw"]
    n, whole, head, image_end = stack["figures"]
    assert n % BS, n  # not a whole number of blocks: vLLM may serve every full block from cache
    partial0 = metric(gw, "kvevents_gateway_partial_prompts_total")
    for messages, want in ((A, whole), (B, head)):
        predicted0 = metric(gw, "kvevents_gateway_predicted_cached_tokens_total", engine="e0")
        reported0 = metric(gw, "kvevents_gateway_reported_cached_tokens_total", engine="e0")
        resp = httpx.post(gw + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200 and resp.headers["x-kvevents-engine"] == "e0", resp.text
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted = metric(gw, "kvevents_gateway_predicted_cached_tokens_total", engine="e0") - predicted0
        reported = metric(gw, "kvevents_gateway_reported_cached_tokens_total", engine="e0") - reported0
        assert cached == reported == predicted == want, (cached, reported, predicted, want)
    assert whole >= image_end + BS and head < image_end  # past the image, and not into it
    assert metric(gw, "kvevents_gateway_partial_prompts_total") == partial0  # both routed by their render
