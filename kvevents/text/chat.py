"""Chat messages and the model's chat template.

:class:`ChatMessage` is the request shape (OpenAI chat messages, text only), decoded
and validated by msgspec with the rest of the body, so a bad message is a 422 naming
``messages[i].field``. :class:`ChatTemplate` renders a conversation the way
``transformers``' ``apply_chat_template(messages, add_generation_prompt=True)`` does:
a sandboxed jinja2 environment (templates come from model repositories: untrusted
code), ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, with the
tokenizer's special tokens (``bos_token``, ``eos_token``...) as variables and keys
whose value is null left out of each message.

Failure: a template that raises (``raise_exception``, a wrong type in a message) gives
:class:`ChatTemplateError`, which the API answers with 422 on ``messages``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

import msgspec


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (bad input, not a server fault)."""


class TextPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """One text part of a message's content (``{"type": "text", "text": ...}``)."""

    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One OpenAI chat message. Null and absent fields are left out when rendering."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; build once per tokenizer, render from any thread.

    Raises :class:`ChatTemplateError` at construction on a template that does not
    compile (the registry reports it with the model's name).
    """

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._errors = (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
                        IndexError, AttributeError)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        # A plain dict, not jinja's ChainMap over the environment's globals: every render
        # copies the globals into a new context and iterates them once more for its keys,
        # which through a ChainMap took half of a two-turn render. The environment's
        # globals are not changed after this, so the flat copy reads the same.
        self._template.globals = dict(self._template.globals)
        self._variables = dict(special_tokens)
        # The one input besides the messages a template can read: the date.
        self.timeless = "strftime_now" not in source

    def render(self, messages: list[ChatMessage]) -> str:
        """The conversation's prompt text, generation prompt added."""
        plain = msgspec.to_builtins(messages)
        try:
            return self._template.render(
                messages=plain, tools=None, documents=None, add_generation_prompt=True,
                **self._variables)
        except self._errors as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
