"""How the gateway reads a chat body (kvevents/gateway/prompt.py): messages that are
ChatMessages are typed in one decode and rendered as they are; any other messages are
kept as plain JSON (the engine's ``/tokenize``, or load alone, routes them), and the
body the engine gets is the client's either way."""

from __future__ import annotations

import asyncio
import json

import pytest

from text_tokenizer import build_bytelevel, require_transformers
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.prompt import CHAT, PromptTokens, parse_request
from kvevents.text import TextTokenizer, TokenizerRegistry
from kvevents.text.chat import ChatMessage, TextPart

CONVO = [{"role": "system", "content": "You are terse.", "name": None},
         {"role": "user", "content": [{"type": "text", "text": "What is in the cache?"}]}]


def _body(messages: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_chat_messages_are_typed_and_their_json_kept():
    req = parse_request(CHAT, _body(CONVO))
    assert req.chat == [ChatMessage("system", "You are terse."),
                        ChatMessage("user", [TextPart("What is in the cache?")])]
    assert req.messages is None
    assert req.plain_messages() == CONVO  # as the body wrote them (nulls too)
    assert json.loads(req.messages_json) == CONVO


def test_other_messages_stay_plain_and_are_not_tokenized_here(tmp_path):
    odd = [{"role": "user", "content": "hi", "audio": {"id": "a1"}}]  # not a ChatMessage
    req = parse_request(CHAT, _body(odd))
    assert req.chat is None and req.messages == odd and req.plain_messages() == odd
    path = build_bytelevel(tmp_path / "tok")
    tokens = PromptTokens(TokenizerRegistry([TextTokenizer("m", path)]), None)  # type: ignore[arg-type]
    # No engine to ask: routed by load alone, and counted.
    assert asyncio.run(tokens.ids(req, None)) is None and tokens.failures == 1


@pytest.mark.parametrize("messages", [[], {}, "hi", [1, 2], [None], [[]]])
def test_messages_that_are_not_an_array_of_objects_are_a_400(messages):
    with pytest.raises(OpenAIError) as exc:
        parse_request(CHAT, _body(messages))
    assert exc.value.status == 400 and exc.value.param == "messages"


def test_typed_messages_render_as_transformers_does(tmp_path):
    require_transformers()
    from transformers import AutoTokenizer

    path = build_bytelevel(tmp_path / "tok")
    tokens = PromptTokens(TokenizerRegistry([TextTokenizer("m", path)]), None)  # type: ignore[arg-type]
    convo = [{"role": "system", "content": "You are terse.", "name": None},
             {"role": "user", "content": "What is in the cache?"}]
    ids = asyncio.run(tokens.ids(parse_request(CHAT, _body(convo)), None))
    plain = [{k: v for k, v in m.items() if v is not None} for m in convo]
    reference = AutoTokenizer.from_pretrained(path).apply_chat_template(
        plain, add_generation_prompt=True, tokenize=True)
    reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    assert ids is not None and ids.tolist() == reference
