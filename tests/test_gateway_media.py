"""Prompts routed by less than their whole identity (kvevents/gateway/media.py): chats
with images that no engine renders (the fake engine here has no render endpoint; the
rendered case: tests/test_identity_media_api.py) routed by the ids of the text before
the first image, completions of
prompt embeddings routed by load alone instead of refused; both counted in
``kvevents_gateway_partial_prompts_total{reason}``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hostile_engine import EngineThread
from hostile_support import GatewayProcess, wait_for
from support import free_port
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.media import SENTINEL, before_media, first_media
from kvevents.gateway.prompt import CHAT, COMPLETIONS, PromptTokens, parse_request

# A vision template of the openai content format (it walks the parts, as Qwen2-VL's
# does): an image part renders as special tokens, the text parts in place.
VISION = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
          "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'image' %}"
          "<|im_start|><|im_end|>{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}"
          "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")
# A template of the string content format (it prints the content whole).
STRING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
HISTORY = [{"role": "system", "content": "You are a careful assistant. Answer in one line."},
           {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from text_tokenizer import build_bytelevel, require_transformers

    require_transformers()
    d = build_bytelevel(tmp_path_factory.mktemp("tok"))
    (d.parent / "vision.jinja").write_text(VISION)
    (d.parent / "string.jinja").write_text(STRING)
    return d


def _ids(tok_dir, body: dict, template: str | None = None) -> tuple[object, list[int] | None]:
    from kvevents.text import TokenizerRegistry

    spec = str(tok_dir) + (f",chat_template={tok_dir.parent / template}" if template else "")
    reg = TokenizerRegistry.load([("m", spec)])
    req = parse_request(CHAT, json.dumps({"model": "m", **body}).encode())

    async def run():
        async with httpx.AsyncClient() as client:
            return await PromptTokens(reg, client).ids(req, None)
    got = asyncio.run(run())
    return req, None if got is None else list(got)


def _engine_text(tok_dir, messages: list, template: str | None) -> str:
    """The whole chat as transformers renders it, its image parts handed over as vLLM
    hands them to an openai-format template (``{"type": "image"}``)."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    conv = [{**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]
    return auto.apply_chat_template(conv, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_media_found_and_cut_where_the_first_one_is():
    msgs = [*HISTORY, {"role": "user", "content": [{"type": "text", "text": "what is"}, IMAGE,
                                                   {"type": "text", "text": "and"}, IMAGE]}]
    assert first_media(msgs) == "image" and first_media(HISTORY) is None
    assert first_media([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]) == "audio"
    cut = before_media(msgs, "openai")
    assert cut[:3] == HISTORY and cut[3]["content"] == [{"type": "text", "text": "what is"},
                                                        {"type": "text", "text": SENTINEL}]
    assert before_media(msgs, "string")[3]["content"] == [{"type": "text", "text": SENTINEL}]
    assert before_media(HISTORY, "openai") is None


def test_image_chat_routes_by_the_engines_ids_of_the_text_before_the_image(tok_dir):
    """Openai-format template: the ids are the engine's ids of its rendered prompt up to
    the first image's placeholder (special tokens: the text before is tokenized alone)."""
    from transformers import AutoTokenizer

    msgs = [*HISTORY, {"role": "user", "content": [{"type": "text", "text": "Describe this picture:"},
                                                   IMAGE, {"type": "text", "text": "in detail"}]}]
    req, ids = _ids(tok_dir, {"messages": msgs}, template="vision.jinja")
    assert req.partial == "image"
    text = _engine_text(tok_dir, msgs, VISION)
    head = text[:text.index("<|im_start|><|im_end|>")]
    assert head.endswith("Describe this picture:")
    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    assert ids == auto(head, add_special_tokens=False)["input_ids"]
    full = auto(text, add_special_tokens=False)["input_ids"]
    assert full[:len(ids)] == ids and len(ids) < len(full)  # a prefix of the whole prompt's


def test_string_format_template_cuts_before_the_message(tok_dir):
    """A string-format template: vLLM puts the image placeholder before the message's
    text, so the text before the image ends where that message's content starts."""
    from transformers import AutoTokenizer

    msgs = [*HISTORY, {"role": "user", "content": [{"type": "text", "text": "Describe:"}, IMAGE]}]
    req, ids = _ids(tok_dir, {"messages": msgs}, template="string.jinja")
    assert req.partial == "image"
    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    marker = "\ue123"
    text = auto.apply_chat_template([*HISTORY, {"role": "user", "content": marker}], chat_template=STRING,
                                    tokenize=False, add_generation_prompt=True)
    assert ids == auto(text[:text.index(marker)], add_special_tokens=False)["input_ids"]


def test_text_only_chat_is_whole(tok_dir):
    req, ids = _ids(tok_dir, {"messages": HISTORY})
    assert req.partial is None and ids


def test_prompt_embeds_parse_without_ids():
    req = parse_request(COMPLETIONS, b'{"model": "m", "prompt_embeds": "AAAA"}')
    assert req.partial == "prompt_embeds" and req.prompt is None
    for body in (b'{"model": "m", "prompt": null, "prompt_embeds": ["AAAA"]}',):
        assert parse_request(COMPLETIONS, body).partial == "prompt_embeds"
    both = parse_request(COMPLETIONS, b'{"model": "m", "prompt": "hi", "prompt_embeds": "AAAA"}')
    assert both.partial is None and both.prompt == "hi"  # (a prompt: routed by it)
    with pytest.raises(OpenAIError) as err:
        parse_request(COMPLETIONS, b'{"model": "m", "prompt_embeds": 5}')
    assert err.value.status == 400 and err.value.param == "prompt_embeds"
    with pytest.raises(OpenAIError) as err:
        parse_request(COMPLETIONS, b'{"model": "m"}')
    assert err.value.status == 400 and err.value.param == "prompt"


def test_gateway_routes_them_and_counts_them(tok_dir):
    eng = EngineThread([free_port(), free_port()])
    try:
        with GatewayProcess(eng.urls, "--tokenizer",
                            f"fake={tok_dir},chat_template={tok_dir.parent / 'vision.jinja'}") as g:
            resp = httpx.post(g.url + "/v1/completions", timeout=20,
                              json={"model": "fake", "prompt_embeds": "AAAA", "max_tokens": 2})
            assert resp.status_code == 200, resp.text  # (was a 400)
            resp = httpx.post(g.url + "/v1/chat/completions", timeout=20, json={
                "model": "fake", "max_tokens": 2,
                "messages": [*HISTORY, {"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]})
            assert resp.status_code == 200, resp.text
            resp = httpx.post(g.url + "/v1/completions", timeout=20, json={"model": "fake", "prompt_embeds": {}})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_embeds", resp.text
            assert wait_for(lambda: g.metric("kvevents_gateway_partial_prompts_total", reason="image") == 1, 5)
            assert g.metric("kvevents_gateway_partial_prompts_total", reason="prompt_embeds") == 1
            assert g.metric("kvevents_gateway_untokenized_total") == 0
    finally:
        eng.close()
