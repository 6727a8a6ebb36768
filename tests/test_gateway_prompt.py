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


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                  "{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
                  "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")


def test_the_fields_that_change_a_chats_ids_are_read_and_change_them(tmp_path):
    """tools, chat_template_kwargs, add_generation_prompt, add_special_tokens: read from
    the body, rendered as the engine renders them, and a conversation seen before with
    other fields is not taken from the recent ones."""
    path = build_bytelevel(tmp_path / "tok")
    tok = TextTokenizer("m", f"{path}", chat_template=TOOLS_TEMPLATE)
    tokens = PromptTokens(TokenizerRegistry([tok]), None)  # type: ignore[arg-type]
    convo = [{"role": "user", "content": "What is in the cache?"}]

    def ids(**fields) -> list[int]:
        req = parse_request(CHAT, json.dumps({"model": "m", "messages": convo, **fields}).encode())
        return asyncio.run(tokens.ids(req, None)).tolist()

    plain = ids()
    assert ids(stream=True, max_tokens=9) == plain  # fields that change nothing
    with_tools = ids(tools=TOOLS)
    text = tok.decode(with_tools)
    assert '"name": "lookup"' in text and text.endswith("<|im_start|>assistant\n")
    assert with_tools[len(with_tools) - len(plain):] == plain
    assert tok.decode(ids(chat_template_kwargs={"enable_thinking": False})).endswith("<think></think>")
    assert tok.decode(ids(reasoning_effort="none")).endswith("<think></think>")
    assert not tok.decode(ids(add_generation_prompt=False)).endswith("assistant\n")
    bos = tok.prompt_ids("x").tolist()[0]
    assert ids(add_special_tokens=True) == [bos, *plain]
    assert ids(tools=TOOLS) == with_tools and tokens.repeats >= 1  # the recent one, same fields


def test_chat_fields_the_gateway_cannot_read_leave_the_chat_to_the_engine():
    req = parse_request(CHAT, json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "tools": [{"type": "function"}]}).encode())
    assert req.chat is None and req.messages == [{"role": "user", "content": "x"}]
    assert json.loads(req.options_json) == {"tools": [{"type": "function"}]}  # sent to /tokenize as given


def test_a_completions_prompt_without_special_tokens(tmp_path):
    from kvevents.gateway.prompt import COMPLETIONS

    path = build_bytelevel(tmp_path / "tok")
    tokens = PromptTokens(TokenizerRegistry([TextTokenizer("m", path)]), None)  # type: ignore[arg-type]

    def ids(**fields) -> list[int]:
        req = parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": "hello there", **fields}).encode())
        return list(asyncio.run(tokens.ids(req, None)))

    assert ids()[1:] == ids(add_special_tokens=False) and len(ids()) == len(ids(add_special_tokens=False)) + 1


def test_tokenizer_options_name_the_engines_template_and_content_format(tmp_path):
    from kvevents.text.registry import TokenizerLoadError

    path = build_bytelevel(tmp_path / "tok")
    (tmp_path / "engine.jinja").write_text(TOOLS_TEMPLATE)
    reg = TokenizerRegistry.load([("m", f"{path},chat_template={tmp_path / 'engine.jinja'},content_format=string")])
    tok = reg.get("m")
    assert tok is not None and tok.chat is not None
    assert tok.chat.source == TOOLS_TEMPLATE and tok.chat.content_format == "string"
    assert TokenizerRegistry.load([("m", str(path))]).get("m").chat.content_format == "openai"  # its own
    with pytest.raises(TokenizerLoadError, match="content_format"):
        TokenizerRegistry.load([("m", f"{path},content_format=xml")])
    assert not tok.exclude_tools_when_tool_choice_none  # vLLM's default
    drops = TokenizerRegistry.load([("m", f"{path},exclude_tools_when_tool_choice_none=true")]).get("m")
    assert drops.drops_tools("none") and not drops.drops_tools("auto") and not tok.drops_tools("none")
    with pytest.raises(TokenizerLoadError, match="exclude_tools_when_tool_choice_none must be true or false"):
        TokenizerRegistry.load([("m", f"{path},exclude_tools_when_tool_choice_none=maybe")])
