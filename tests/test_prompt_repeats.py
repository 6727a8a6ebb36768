"""A conversation sent again as it was (``kvevents/gateway/prompt.py``): its ids come
from the recent conversations, equal to ``transformers``' and to encoding it anew; a
changed message, another model or a template that reads the clock is encoded again."""

from __future__ import annotations

import asyncio
import json

from text_tokenizer import CHAT_TEMPLATE, build_bytelevel, require_transformers
from kvevents.gateway.prompt import CHAT, PromptTokens, parse_request
from kvevents.text import TextTokenizer, TokenizerRegistry


def _body(messages: list[dict]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_a_repeated_conversation_skips_template_and_encoder_and_keeps_its_ids(tmp_path):
    require_transformers()
    from transformers import AutoTokenizer

    path = build_bytelevel(tmp_path / "tok")
    auto = AutoTokenizer.from_pretrained(path)
    tokens = PromptTokens(TokenizerRegistry([TextTokenizer("m", path)]), None)  # type: ignore[arg-type]
    convo = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "What does the KV cache hold?"}]

    async def ids(messages):
        return await tokens.ids(parse_request(CHAT, _body(messages)), None)

    async def go():
        first = await ids(convo)
        reference = auto.apply_chat_template(convo, add_generation_prompt=True, tokenize=True)
        reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
        assert first.tolist() == reference and tokens.repeats == 0
        again = await ids(convo)
        assert again.tolist() == reference and tokens.repeats == 1
        again.append(7)  # a caller's change does not reach the kept ids
        assert (await ids(convo)).tolist() == reference and tokens.repeats == 2
        changed = convo[:1] + [{"role": "user", "content": "What does the KV cache hold!"}]
        assert (await ids(changed)).tolist() != reference and tokens.repeats == 2

    asyncio.run(go())


def test_a_template_that_reads_the_clock_is_rendered_every_time(tmp_path):
    require_transformers()
    path = build_bytelevel(tmp_path / "tok")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = "{{ strftime_now('%Y') }}" + CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = TextTokenizer("m", path)
    assert not tok.repeatable_chat
    tokens = PromptTokens(TokenizerRegistry([tok]), None)  # type: ignore[arg-type]
    req = parse_request(CHAT, _body([{"role": "user", "content": "hi"}]))

    async def go():
        for _ in range(3):
            await tokens.ids(req, None)
        assert tokens.repeats == 0

    asyncio.run(go())
