"""The live page shows the text of the most shared prefixes where the model has a
tokenizer (real Chromium, real server, real publisher, tokenizer built locally)."""

from __future__ import annotations

import shutil
import time

import httpx

from browser import Browser
from support import ServerThread, free_port, require_binary, wait_until
from text_tokenizer import build_bytelevel, require_transformers
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec
from kvevents.text import TextTokenizer
from kvevents.text.chat import ChatMessage

BS = 16
READ_PREFIXES = """[...document.querySelectorAll('#prefixes tr[data-prefix] td.toks')].map(
  (td) => ({text: td.dataset.text ?? null, shown: td.textContent, title: td.title}))"""


def test_live_page_shows_prefix_text(tmp_path):
    chromium = require_binary("chromium")
    require_transformers()
    tokdir = build_bytelevel(tmp_path / "tok")
    ids = TextTokenizer("m", tokdir).encode_chat(
        [ChatMessage(role="system", content="Answer <b>briefly</b>.\nBe kind."),
         ChatMessage(role="user", content="Where is the KV cache of this conversation? " * 3)])
    full = len(ids) // BS * BS
    live, replay, plain_live = free_port(), free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://*:{replay}"))
    plain = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{plain_live}"))
    settings = AggregatorSettings(
        engines=(EngineSpec("engine-0", f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                            model="m"),
              EngineSpec("engine-1", f"tcp://127.0.0.1:{plain_live}", model="other")),
        tokenizers=(("m", str(tokdir)),))
    browser = None
    try:
        with ServerThread(create_app(settings)) as srv:
            assert wait_until(lambda: all(p["connected"] for p in httpx.get(f"{srv.url}/v1/engines").json()["engines"]), 10)
            pub.publish(KVEventBatch(time.time(), [BlockStored(
                list(range(1, full // BS + 1)), None, ids[:full], BS, None, "GPU", None)]))
            plain.publish(KVEventBatch(time.time(), [BlockStored(
                [9001], None, list(range(500, 500 + BS)), BS, None, "GPU", None)]))
            assert wait_until(lambda: len(httpx.get(f"{srv.url}/v1/prefixes").json()["prefixes"]) == 2, 10)
            api = {p["model"]: p for p in httpx.get(f"{srv.url}/v1/prefixes").json()["prefixes"]}
            assert api["other"]["text"] is None and api["m"]["text"].startswith("<s><|im_start|>system")

            browser = Browser(chromium, f"{srv.url}/", tmp_path / "profile")
            assert wait_until(lambda: len(browser.tools.evaluate(READ_PREFIXES) or []) == 2, 20, 0.2)
            cells = browser.tools.evaluate(READ_PREFIXES)
            with_text = [c for c in cells if c["text"] is not None]
            assert len(with_text) == 1
            cell = with_text[0]
            assert cell["text"] == api["m"]["text"]
            # Shown as text (never as markup), line breaks as ⏎; the ids stay in the tooltip.
            assert "Answer <b>briefly</b>.⏎Be kind." in cell["shown"]
            assert " ".join(map(str, api["m"]["leading_tokens"])) in cell["title"]
            ids_only = next(c for c in cells if c["text"] is None)
            assert ids_only["shown"].startswith("500 501 502")
    finally:
        if browser is not None:
            browser.close()
            shutil.rmtree(tmp_path / "profile", ignore_errors=True)
        pub.shutdown(0.5)
        plain.shutdown(0.5)
