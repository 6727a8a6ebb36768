"""Token ids from kvevents.text equal transformers' for the same tokenizer directory.

The tokenizers are trained here with ``tokenizers`` and saved with ``transformers``
(``tests/text_tokenizer.py``); the reference is ``AutoTokenizer.from_pretrained(dir)``:
``tokenizer(prompt)["input_ids"]`` and ``apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)``.
"""

from __future__ import annotations

import msgspec
import pytest

from text_tokenizer import CORPUS, build_bytelevel, build_metaspace, require_transformers
from kvevents.text import TextTokenizer
from kvevents.text.chat import ChatMessage

PROMPTS = [
    "hello there",
    "",
    " leading space and trailing space ",
    "two\n\nlines\twith tabs",
    CORPUS,
    CORPUS * 7,
    "special tokens inside: <|im_start|>user\nhi<|im_end|>\n and </s> after",
    "<|im_end|><|im_end|>",
    "unicode: café naïve 東京 🙂 ✓ and bytes never seen ζ ψ ω",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does the KV cache hold?"},
    {"role": "assistant", "content": "Keys and values of every token seen so far."},
    {"role": "user", "content": [{"type": "text", "text": "And when "},
                                 {"type": "text", "text": "two requests share a prefix? 東京"}]},
    {"role": "assistant", "content": None,
     # (arguments as an object: vLLM hands templates a parsed object, transformers the
     # value given; tests/test_chat_parity.py checks the string form against vLLM)
     "tool_calls": [{"type": "function", "function": {"name": "route", "arguments": {}}}]},
    {"role": "tool", "content": "engine-1", "tool_call_id": "c1"},
    {"role": "user", "content": "  spaces  \n<|im_end|> inside content\n"},
]


def _reference_chat(auto, messages):
    out = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module", params=["jinja-file", "config-template"])
def bytelevel(request, tmp_path_factory):
    require_transformers()
    from transformers import AutoTokenizer

    path = build_bytelevel(tmp_path_factory.mktemp(request.param),
                           template_in_config=request.param == "config-template")
    return TextTokenizer("m", path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_ids_equal_transformers(bytelevel, prompt):
    ours, auto = bytelevel
    assert ours.encode_prompt(prompt) == auto(prompt)["input_ids"]
    assert ours.encode_prompt(prompt) == auto(prompt)["input_ids"]  # again, from the cache
    assert ours.prompt_ids(prompt).tolist() == auto(prompt)["input_ids"]  # the index's form


def test_growing_conversation_equals_transformers_and_reuses_turns(bytelevel):
    ours, auto = bytelevel
    assert ours.piecewise  # this tokenizer allows piecewise encoding
    for turns in range(1, len(CONVERSATION) + 1):
        messages = CONVERSATION[:turns]
        before = ours.cache_stats()
        got = ours.encode_chat(msgspec.convert(messages, list[ChatMessage]))
        assert got == _reference_chat(auto, messages), f"{turns} turns"
        assert ours.chat_ids(msgspec.convert(messages, list[ChatMessage])).tolist() == got
        after = ours.cache_stats()
        if turns > 1:  # every earlier turn came from the cache
            assert after["hits"] - before["hits"] >= 2 * (turns - 1)
    # The rendered text is transformers' too.
    rendered = ours.render_chat(msgspec.convert(CONVERSATION, list[ChatMessage]))
    assert rendered == auto.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                tokenize=False)


def test_template_errors_are_chat_template_errors(bytelevel):
    from kvevents.text import ChatTemplateError

    ours, _ = bytelevel
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        ours.encode_chat([ChatMessage(role="robot", content="hi")])


def test_first_piece_special_tokenizer_is_encoded_whole_and_equal(tmp_path):
    require_transformers()
    from transformers import AutoTokenizer

    path = build_metaspace(tmp_path / "ms")
    ours, auto = TextTokenizer("m", path), AutoTokenizer.from_pretrained(path)
    assert not ours.piecewise and not ours.has_chat_template
    for prompt in PROMPTS:
        assert ours.encode_prompt(prompt) == auto(prompt)["input_ids"], prompt


def test_decode_round_trips_text(bytelevel):
    ours, auto = bytelevel
    ids = auto("café 東京 <|im_end|> x", add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == auto.decode(ids) == "café 東京 <|im_end|> x"
