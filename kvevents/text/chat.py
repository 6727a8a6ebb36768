"""Chat messages and the model's chat template.

:class:`ChatMessage` is the request shape (OpenAI chat messages, text only), decoded
and validated by msgspec with the rest of the body, so a bad message is a 422 naming
``messages[i].field``. :class:`ChatTemplate` renders a conversation the way vLLM 0.32's
OpenAI server does (:mod:`.chat_inputs` builds what the template is handed: content in
the template's format, tool calls, reasoning, the request's ``tools``, ``documents``,
``chat_template_kwargs``...), through ``transformers``' ``apply_chat_template``: a
sandboxed jinja2 environment (templates come from model repositories: untrusted
code), ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text,
``raise_exception`` and ``strftime_now``, with the tokenizer's special tokens
(``bos_token``, ``eos_token``...) as variables.

Failure: a template that raises (``raise_exception``, a wrong type in a message) gives
:class:`ChatTemplateError`, which the API answers with 422 on ``messages``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from kvevents.text.chat_format import OPENAI, STRING, generation_tag
from kvevents.text.chat_format import content_format as detect_format
from kvevents.text.chat_inputs import (CONTINUE_TAG, PLAIN, ChatOptions, ChatTemplateError, conversation,
                                       template_variables)

__all__ = ["ChatMessage", "ChatTemplate", "ChatTemplateError", "TextPart"]


class TextPart(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One text part of a message's content: ``{"type": "text", "text": ...}``, or the
    other parts vLLM's chat requests read as text (``refusal`` with ``refusal``,
    ``thinking`` with ``thinking``). Any other part (an image...) or field fails to
    decode: such a chat is the engine's to tokenize (or to refuse)."""

    text: str | None = None
    type: Literal["text", "refusal", "thinking"] = "text"
    refusal: str | None = None
    thinking: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One OpenAI chat message; what the template is handed is built from it as vLLM
    builds it (:func:`kvevents.text.chat_inputs.conversation`)."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None




def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; build once per tokenizer, render from any thread.

    ``content_format``: ``"auto"`` (decided from the source as vLLM decides it:
    :func:`~kvevents.text.chat_format.content_format`), ``"string"`` or ``"openai"``
    (an engine's ``--chat-template-content-format``). Raises :class:`ChatTemplateError`
    at construction on a template that does not compile (the registry reports it with
    the model's name).
    """

    def __init__(self, source: str, special_tokens: dict[str, str], content_format: str = "auto") -> None:
        import jinja2
        from jinja2 import meta
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, generation_tag()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._errors = (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
                        IndexError, AttributeError)
        try:
            self._template = env.from_string(source)
            #: The variables the template reads: the request's template kwargs it is handed.
            self.reads = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        if content_format not in ("auto", STRING, OPENAI):
            raise ChatTemplateError(f"content format must be auto, string or openai, got {content_format!r}")
        self.source = source
        self.content_format = detect_format(source) if content_format == "auto" else content_format
        self.names_developer = '"developer"' in source or "'developer'" in source
        # A plain dict, not jinja's ChainMap over the environment's globals: every render
        # copies the globals into a new context and iterates them once more for its keys,
        # which through a ChainMap took half of a two-turn render. The environment's
        # globals are not changed after this, so the flat copy reads the same.
        self._template.globals = dict(self._template.globals)
        self._variables = dict(special_tokens)
        # The one input besides the request a template can read: the date.
        self.timeless = "strftime_now" not in source

    def render(self, messages: list[ChatMessage], options: ChatOptions | None = None) -> str:
        """The conversation's prompt text, as vLLM renders it for a request with
        ``options`` (default: a plain request, generation prompt added)."""
        opts = options or PLAIN
        try:
            conv = conversation(msgspec.to_builtins(messages), self.content_format, self.names_developer)
            if opts is PLAIN:  # (most requests: nothing to merge)
                tools = documents = None
                generation, cont, variables = True, False, None
            else:
                tools, documents, generation, cont, variables = template_variables(opts, self.reads)
            if cont:
                if generation:
                    raise ChatTemplateError("continue_final_message and add_generation_prompt are not "
                                            "compatible")
                final = _tag_last(conv, self.source)
            text = self._template.render(
                messages=conv, tools=tools, documents=documents, add_generation_prompt=generation,
                **(self._variables if not variables else {**self._variables, **variables}))
        except self._errors as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
        return _cut_at_tag(text, final) if cont else text


def _tag_last(conv: list[dict[str, Any]], source: str) -> str:
    """``continue_final_message`` as ``transformers`` applies it: the tag appended to the
    last message's text (its last text part); that text, untagged."""
    last = conv[-1] if conv else {}
    content = last.get("content")
    if content is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content"')
    if "content" not in source:
        raise ChatTemplateError("continue_final_message is set but the template has no content field")
    if isinstance(content, list):
        for part in reversed(content):
            if "text" in part:
                final = part["text"]
                part["text"] = final + CONTINUE_TAG
                return final
        raise ChatTemplateError("continue_final_message is set but the final message has no text")
    last["content"] = content + CONTINUE_TAG
    return content


def _cut_at_tag(text: str, final: str) -> str:
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear "
                                "in the rendered chat")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
