"""The prompt-size limit checked before tokenizing (``max_prompt_chars``).

Why: a tokenizer's memory grows with the text it encodes (280 MB for a 4-million
character prompt with the tests' byte-level tokenizer), so a prompt is measured in characters, and refused, before any
tokenizer sees it. Counting is one step per string, never per character: a 4-million
character prompt costs one ``len``.

Pure functions, no HTTP: the aggregator's ``/v1/lookup`` and ``/v1/route``
(:func:`kvevents.routing.offloop.prompt_token_ids`) call :func:`check_chars`, and the
gateway can count its parsed OpenAI bodies with :func:`text_chars`.
"""

from __future__ import annotations

import functools

import msgspec
from msgspec.structs import astuple

from kvevents.text.prompt import InputError


def text_chars(value: object) -> int:
    """Characters of every string in ``value``: a prompt string, or chat messages as
    decoded JSON (dicts and lists) or as msgspec Structs (``ChatMessage``, its content
    parts: the same count as their JSON). Contents, names, tool calls' arguments: whatever
    a chat template may render is counted; dict keys are not. Other values (numbers,
    None) count 0. About 1.2 us per decoded message here: exact classes are compared
    first, because a message's absent fields are None and going through four
    ``isinstance`` calls each made the count 4x slower."""
    total = 0
    stack: list = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        item = pop()
        cls = item.__class__
        if cls is str:
            total += len(item)
        elif item is None:
            continue
        elif cls is list or cls is tuple:
            extend(item)
        elif cls is dict:
            extend(item.values())
        elif isinstance(item, msgspec.Struct):
            extend(astuple(item))
            total += _tag_chars(cls)
        elif isinstance(item, str):  # subclasses, after the exact classes
            total += len(item)
        elif isinstance(item, (list, tuple)):
            extend(item)
        elif isinstance(item, dict):
            extend(item.values())
    return total


@functools.cache
def _tag_chars(cls: type) -> int:
    """A tagged Struct's tag (a content part's ``"type": "text"``) is a string of its JSON
    too: counted, so a Struct counts what its JSON does. Per class, once (reading
    ``__struct_config__`` builds an object)."""
    tag = cls.__struct_config__.tag  # type: ignore[attr-defined]
    return len(tag) if isinstance(tag, str) else 0


def check_chars(value: object, limit: int, field: str) -> None:
    """Raise :class:`~kvevents.text.prompt.InputError` (400 on ``field``) when ``value``
    has more than ``limit`` characters (:func:`text_chars`); the message gives both and
    names the setting."""
    chars = text_chars(value)
    if chars > limit:
        raise InputError(400, f"{field} has {chars} characters; the limit is {limit} "
                              f"(max_prompt_chars)", field)
