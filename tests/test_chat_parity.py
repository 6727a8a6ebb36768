"""Token parity with vLLM 0.32: every chat request shape, rendered and tokenized by us and
by vLLM's own OpenAI request handling, gives the same ids.

The reference is vLLM's code, in this process: the request validated as vLLM's server
validates it (``ChatCompletionRequest``: ``reasoning_content`` renamed, tools dumped), its
chat parameters built by the request (``build_chat_params``, the tools as the server's
defaults), and rendered by vLLM's ``HfRenderer`` (content format detection, message
parsing, developer roles, ``apply_chat_template`` with vLLM's kwargs filter), then
tokenized with the request's ``add_special_tokens``. Ours: :class:`TextTokenizer` with
the template as the engine's (``chat_template=``, vLLM's ``--chat-template``) and the
request's :class:`ChatOptions` as the gateway reads them from the body.

Four templates (``tests/parity_corpus.py`` and the tiny model's own ChatML-like one)
times the request shapes there (``SHAPES``: contents as strings and parts, several
and empty parts, null contents, system / developer / tool / assistant messages with
``tool_calls``, tools with nested JSON schemas, ``chat_template_kwargs``,
``continue_final_message``, ``add_generation_prompt: false``, ``add_special_tokens``,
``documents``, ``reasoning_effort``, unicode and whitespace edges). A shape vLLM
refuses must be refused by us too (an error, not other ids).

Needs the ``vllm`` extra; skips without it, fails under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from parity_corpus import SHAPES, TEMPLATES

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but vLLM is missing: run `make test CI=true` (installs the vllm extra)")
    pytest.skip("vLLM is not installed (the vllm extra)", allow_module_level=True)

TEMPLATE_NAMES = [*TEMPLATES, "tiny"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from kvevents.demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("parity") / "tiny", tokenizer=True)


@pytest.fixture(scope="module")
def vllm_render(model_dir):
    """vLLM's own request handling for a chat body and a server template: ids or the
    error it answers with."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.hf import HfRenderer
    from vllm.tokenizers import get_tokenizer

    t0 = time.monotonic()
    config = VllmConfig(model_config=ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                                                 max_model_len=4096))
    tokenizer = get_tokenizer(str(model_dir))
    renderer = HfRenderer(config, tokenizer)
    print(f"\nvLLM's renderer ready in {time.monotonic() - t0:.1f} s")

    def render(body: dict, template: str | None, exclude_tools_when_tool_choice_none: bool = False
               ) -> list[int] | Exception:
        try:
            req = ChatCompletionRequest.model_validate({"model": "tiny", **body})
            # the server's rule (vllm/renderers/online_renderer.py, its flag of that name)
            excluded = req.tool_choice == "none" and exclude_tools_when_tool_choice_none
            tools = None if req.tools is None or excluded else [t.model_dump() for t in req.tools]
            # as the server's preprocess_chat: the tools and tokenize=False as defaults
            params = req.build_chat_params(template, "auto").with_defaults({"tools": tools, "tokenize": False})
            _, prompt = renderer.render_messages(req.messages, params)
            return tokenizer(prompt["prompt"], add_special_tokens=req.add_special_tokens)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - what vLLM answers 400 with
            return exc

    return render


@pytest.fixture(scope="module")
def ours(model_dir):
    from kvevents.demo.tiny_model import CHAT_TEMPLATE
    from kvevents.text import TextTokenizer

    return {name: TextTokenizer("tiny", model_dir, chat_template=TEMPLATES.get(name, CHAT_TEMPLATE))
            for name in TEMPLATE_NAMES}


def _our_ids(tok, body: dict) -> list[int] | Exception:
    """Our ids as the gateway computes them from the body."""
    from kvevents.gateway.prompt import CHAT, parse_request
    from kvevents.text import ChatTemplateError

    req = parse_request(CHAT, json.dumps({"model": "tiny", **body}).encode())
    if req.chat is None:  # not a chat the gateway tokenizes: the engine's /tokenize does
        return ValueError("left to the engine")
    try:
        return tok.chat_ids(req.chat, req.options).tolist()
    except ChatTemplateError as exc:
        return exc


@pytest.mark.parametrize("template", TEMPLATE_NAMES)
def test_every_request_shape_gives_vllms_ids(template, vllm_render, ours):
    from kvevents.demo.tiny_model import CHAT_TEMPLATE

    source = TEMPLATES.get(template, CHAT_TEMPLATE)
    differ, refused_both = [], 0
    for name, body in SHAPES:
        want, got = vllm_render(body, source), _our_ids(ours[template], body)
        if isinstance(want, Exception) or isinstance(got, Exception):
            if isinstance(want, Exception) and isinstance(got, Exception):
                refused_both += 1
                continue
            differ.append((name, f"vLLM: {want!r:.200}", f"ours: {got!r:.200}"))
        elif got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            differ.append((name, f"first difference at id {at} of {len(want)}"))
    assert not differ, differ
    assert refused_both <= 3, refused_both  # (the shapes are meant to render)
    print(f"{template}: {len(SHAPES)} shapes, ids equal to vLLM's ({refused_both} refused by both)")


def test_an_engine_that_drops_the_tools_of_tool_choice_none_is_matched(model_dir, vllm_render):
    """``exclude_tools_when_tool_choice_none=true`` (``--tokenizer``): the shapes with a
    ``tool_choice`` rendered as an engine started with that flag renders them; only
    ``"none"`` drops the tools, and it does change the ids."""
    from kvevents.text.registry import split_options
    from kvevents.text import TextTokenizer

    directory, options = split_options(f"{model_dir},exclude_tools_when_tool_choice_none=true")
    tok = TextTokenizer("tiny", directory, chat_template=TEMPLATES["tools"], **options)
    shapes = [(name, body) for name, body in SHAPES if body.get("tools") and "tool_choice" in body]
    assert {json.dumps(b["tool_choice"]) for _, b in shapes} >= {'"none"', json.dumps(
        {"type": "function", "function": {"name": "get_weather"}})}
    for name, body in shapes:
        want = vllm_render(body, TEMPLATES["tools"], exclude_tools_when_tool_choice_none=True)
        assert _our_ids(tok, body) == want, name
        if body["tool_choice"] == "none":
            assert want != vllm_render(body, TEMPLATES["tools"]), name  # the flag matters here


def test_the_corpus_is_large_and_covers_the_formats(ours):
    from kvevents.text.chat_format import OPENAI, STRING

    assert len(SHAPES) >= 60
    formats = {name: ours[name].chat.content_format for name in TEMPLATE_NAMES}
    assert formats["parts"] == OPENAI and formats["tools"] == STRING and formats["thinking"] == STRING, formats


DETECTION = [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ p.text }}{% endfor %}{% endfor %}",
    "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% set loop_messages = messages | list %}{% for m in loop_messages %}{{ m.content }}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.role) }}{% endfor %}",
    "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{{ m.content[0].text }}{% endfor %}",
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{% for m in messages %}{{ m.content }",  # does not parse
]


@pytest.mark.parametrize("source", DETECTION)
def test_content_format_is_detected_as_vllm_detects_it(source):
    from vllm.renderers.hf import _detect_content_format

    from kvevents.text.chat_format import content_format

    assert content_format(source) == _detect_content_format(source, default="string")
