"""The prompt-size limit checked before tokenizing (``max_prompt_chars``).

Why: a tokenizer's memory grows with the text it encodes (about 150 MB per million
characters here), so a prompt is measured in characters, and refused, before any
tokenizer sees it. Counting is one step per string, never per character: a 4-million
character prompt costs one ``len``.

Pure functions, no HTTP: the aggregator's ``/v1/lookup`` and ``/v1/route``
(:func:`kvevents.routing.offloop.prompt_token_ids`) call :func:`check_chars`, and the
gateway can count its parsed OpenAI bodies with :func:`text_chars`.
"""

from __future__ import annotations

import msgspec

from kvevents.text.prompt import InputError


def text_chars(value: object) -> int:
    """Characters of every string in ``value``: a prompt string, or chat messages as
    decoded JSON (dicts and lists) or as msgspec Structs (``ChatMessage``, its content
    parts: the same count as their JSON). Contents, names, tool calls' arguments: whatever a chat template may render
    is counted; dict keys are not. Other values (numbers, None) count 0."""
    if isinstance(value, str):
        return len(value)
    total = 0
    stack: list = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, msgspec.Struct):
            stack.extend(getattr(item, name) for name in item.__struct_fields__)
            # A tagged Struct's tag (a content part's "type": "text") is a string of the
            # JSON too: counted, so the Structs count what their JSON does.
            tag = item.__struct_config__.tag
            if isinstance(tag, str):
                total += len(tag)
    return total


def check_chars(value: object, limit: int, field: str) -> None:
    """Raise :class:`~kvevents.text.prompt.InputError` (400 on ``field``) when ``value``
    has more than ``limit`` characters (:func:`text_chars`); the message gives both and
    names the setting."""
    chars = text_chars(value)
    if chars > limit:
        raise InputError(400, f"{field} has {chars} characters; the limit is {limit} "
                              f"(max_prompt_chars)", field)
