"""What a chat template is handed for a request, built as vLLM 0.32's OpenAI server
builds it, so the rendered text (and so the ids) are the engine's.

:class:`ChatOptions` holds the request fields besides ``messages`` that change the
prompt: ``tools`` (and ``tool_choice``, for an engine that drops the tools of a
``"none"`` choice), ``documents``, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``, ``add_special_tokens``, ``reasoning_effort`` and a request's
own ``chat_template``. :func:`conversation` rebuilds each message as vLLM does:

* content in the template's format (:mod:`.chat_format`): for ``"string"``, the text of
  the parts joined with ``"\\n"`` (empty parts left out; no content is ``""``); for
  ``"openai"``, a list of ``{"type": "text", "text": ...}`` (a string wrapped as one
  part; no content is ``[]``). Text parts are ``text``, ``refusal`` and ``thinking``
  (:class:`~kvevents.text.chat.TextPart`). A ``tool`` message's all-text list is joined with
  ``"\\n"`` in either format;
* only ``role`` and ``content``, then for an assistant its ``tool_calls`` (each call's
  ``arguments`` parsed into an object: ``{}`` when empty, not JSON or not an object; an
  empty list dropped) and its reasoning (``reasoning_content`` or ``reasoning``, handed
  as both), for a tool message its ``tool_call_id``, and a string ``name``; nothing else;
* ``developer`` messages become ``system`` ones when the template never names the
  ``developer`` role, and then every system message is merged into one at the start
  (joined with ``"\\n\\n"``) when there is more than one or one not first.

:func:`template_variables` merges the keyword arguments as vLLM does (the request's
``chat_template_kwargs`` over ``tools``; ``add_generation_prompt``,
``continue_final_message``, ``documents`` and ``reasoning_effort``'s ``enable_thinking``
over those; a null never overrides) and keeps only those the template reads.
``continue_final_message`` is applied as ``transformers`` applies it (the render is cut
where the last message's text ends). Pure functions: they raise
:class:`~kvevents.text.chat.ChatTemplateError` where vLLM answers 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from kvevents.text.chat_format import OPENAI

__all__ = ["CONTINUE_TAG", "ChatOptions", "ChatTemplateError", "Tool", "conversation", "template_variables"]


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (bad input, not a server fault)."""


#: What ``transformers`` appends to the last message to find where it ends in the render.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# apply_chat_template's own parameters: never template variables.
_NAMED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class Function(msgspec.Struct, forbid_unknown_fields=False):
    """A tool's function as vLLM hands it to the template (its pydantic dump: ``name``,
    ``description`` and ``parameters`` always, ``strict`` and ``defer_loading`` when set)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=False):
    """One of a request's ``tools`` (other keys are dropped, as vLLM drops them)."""

    function: Function
    type: Literal["function"] = "function"
    defer_loading: bool | None = None

    def as_template_dict(self) -> dict[str, Any]:
        f = self.function
        fn: dict[str, Any] = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            fn["strict"] = f.strict
        if f.defer_loading is not None:
            fn["defer_loading"] = f.defer_loading
        out: dict[str, Any] = {"type": self.type, "function": fn}
        if self.defer_loading is not None:
            out["defer_loading"] = self.defer_loading
        return out


class ChatOptions(msgspec.Struct, omit_defaults=True):
    """The request fields besides ``messages`` that change a chat's prompt (see the
    module docstring); the defaults are a plain request's."""

    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: the API's default (chat: false)
    reasoning_effort: str | None = None
    chat_template: str | None = None
    # "none", "auto", "required" or a named tool: changes the prompt only for an engine
    # started with --exclude-tools-when-tool-choice-none (then "none" drops the tools)
    tool_choice: str | dict[str, Any] | None = None


#: A plain request's options (shared: never mutated).
PLAIN = ChatOptions()

# The key that holds each text part's text (TextPart: no other part decodes).
_TEXT_KEY = {"text": "text", "refusal": "refusal", "thinking": "thinking"}


def _texts(content: list[dict[str, Any]]) -> list[str]:
    """The text of each part of a list content (a text or refusal part without one is
    left out, as vLLM leaves it)."""
    out = []
    for part in content:
        kind = part.get("type", "text")  # (a TextPart's default type is not written out)
        value = part.get(_TEXT_KEY[kind])
        if value is not None or kind == "thinking":
            out.append(value or "")
    return out


def _content(role: str, content: Any, fmt: str) -> Any:
    """A message's content as the template is handed it (see the module docstring)."""
    parts = [] if content is None else [content] if isinstance(content, str) else _texts(content)
    if fmt == OPENAI and role != "tool":
        return [{"type": "text", "text": p} for p in parts]
    if fmt == OPENAI:  # a tool message's all-text list is joined, empty parts too
        return "\n".join(parts)
    return "\n".join(p for p in parts if p)


def _arguments(value: Any) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _tool_calls(calls: list) -> list[dict]:
    out = []
    for call in calls:
        call = dict(call)
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ChatTemplateError("a tool call that is not a function call")
        function = dict(function)
        function["arguments"] = _arguments(function.get("arguments"))
        call["function"] = function
        out.append(call)
    return out


def conversation(messages: list[dict[str, Any]], fmt: str, names_developer: bool) -> list[dict[str, Any]]:
    """The messages as the template is handed them (see the module docstring).
    ``messages``: plain dicts; ``names_developer``: the template's source names the
    ``developer`` role (quoted)."""
    out = []
    developer = False
    wrap = fmt == OPENAI
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        if content.__class__ is str and len(m) == 2 and role != "developer":  # the common one
            out.append({"role": role, "content": [{"type": "text", "text": content}]
                        if wrap and role != "tool" else content})
            continue
        msg: dict[str, Any] = {"role": role, "content": _content(role, content, fmt)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                calls = _tool_calls(list(calls))
                if calls:
                    msg["tool_calls"] = calls
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "developer":
            msg["tools"] = None  # (vLLM hands a developer message its tools: ours carry none)
            developer = True
        out.append(msg)
    if developer and not names_developer:
        for msg in out:
            if msg["role"] == "developer":
                msg["role"] = "system"
                msg.pop("tools", None)
        out = _one_system(out)
    return out


def _one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message merged into one at the start, when there is more than one or
    one not first (their texts joined with a blank line, empty ones left out)."""
    where = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not where or (len(where) == 1 and where[0] == 0):
        return messages
    texts = []
    for i in where:
        content = messages[i]["content"]
        text = content if isinstance(content, str) else "\n".join(p["text"] for p in content)
        if text:
            texts.append(text)
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def template_variables(options: ChatOptions, reads: frozenset[str]) -> tuple[list | None, list | None,
                                                                             bool, bool, dict[str, Any]]:
    """``(tools, documents, add_generation_prompt, continue_final_message, variables)``
    for a render: the keyword arguments merged as vLLM merges them, and of the rest only
    those the template ``reads`` (its undeclared variables)."""
    merged: dict[str, Any] = {}
    if options.tools is not None:
        merged["tools"] = [t.as_template_dict() for t in options.tools]
    for k, v in (options.chat_template_kwargs or {}).items():
        if v is not None and v != "auto":
            merged[k] = v
    over: dict[str, Any] = {"add_generation_prompt": options.add_generation_prompt,
                            "continue_final_message": options.continue_final_message,
                            "documents": options.documents}
    if options.reasoning_effort is not None and "enable_thinking" not in (options.chat_template_kwargs or {}):
        over["enable_thinking"] = options.reasoning_effort != "none"
    for k, v in over.items():
        if v is not None and v != "auto":
            merged[k] = v
    variables = {k: v for k, v in merged.items() if k in reads and k not in _NAMED}
    return (merged.get("tools"), merged.get("documents"), bool(merged.get("add_generation_prompt")),
            bool(merged.get("continue_final_message")), variables)
