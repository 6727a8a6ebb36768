"""The prompt-size limits checked before tokenizing, for the gateway and the lookup API
alike: one path, one status (400, naming the field) for a prompt over a limit.

Why: a tokenizer's memory grows with the text it encodes (280 MB for a 4-million
character prompt with the tests' byte-level tokenizer), so a prompt is measured in
characters, and refused, before any tokenizer sees it. Counting is one step per string,
never per character: a 4-million character prompt costs one ``len``.

The characters worth tokenizing (:func:`chars_limit`) are ``max_prompt_chars``, or fewer
when the tokens the prompt may have (``max_prompt_tokens``, and on the gateway the
model's context, ``max_model_len`` from the engines' ``/v1/models``) could not hold
more: a token of the model's tokenizer covers at most :func:`token_chars_bound`
characters, so a longer text has more tokens than that and is refused as it would be
after tokenizing, without tokenizing it. After tokenizing,
:func:`~kvevents.text.prompt.check_length` is the same refusal (400) on the ids.

:class:`PromptLimits` is the one path both surfaces take, no HTTP: the aggregator's
``/v1/lookup`` and ``/v1/route`` (:func:`kvevents.routing.offloop.prompt_token_ids`, and
a media chat's lookup) and the gateway (:meth:`kvevents.gateway.Gateway.handle`) call
:meth:`~PromptLimits.check_text` before tokenizing and :meth:`~PromptLimits.check_ids`
after; the gateway answers their :class:`~kvevents.text.prompt.InputError` in OpenAI's
shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
from msgspec.structs import astuple

from kvevents.text.prompt import InputError, check_length
from kvevents.text.token_chars import token_chars_bound

__all__ = ["PromptLimits", "chars_limit", "check_chars", "text_chars", "token_chars_bound"]


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


def chars_limit(max_chars: int, max_tokens: int | None = None, token_chars: int | None = None,
                tokens_name: str = "max_prompt_tokens") -> tuple[int, str]:
    """(the most characters of prompt text worth tokenizing, what sets it):
    ``max_chars`` (``max_prompt_chars``), or ``max_tokens * token_chars`` when that is
    less (``token_chars``: the tokenizer's :func:`token_chars_bound`, None: unknown, no
    bound from tokens; ``tokens_name``: what sets ``max_tokens``, for the message)."""
    if max_tokens is not None and token_chars is not None and max_tokens * token_chars < max_chars:
        return max_tokens * token_chars, (f"{tokens_name} {max_tokens} tokens, of at most "
                                          f"{token_chars} characters each")
    return max_chars, "max_prompt_chars"


def check_chars(value: object, limit: int, field: str, why: str = "max_prompt_chars",
                chars: int | None = None) -> None:
    """Raise :class:`~kvevents.text.prompt.InputError` (400 on ``field``) when ``value``
    has more than ``limit`` characters (:func:`text_chars`, or ``chars`` when counted
    already); the message gives both and what sets the limit (``why``, from
    :func:`chars_limit`)."""
    chars = text_chars(value) if chars is None else chars
    if chars > limit:
        raise InputError(400, f"{field} has {chars} characters; the limit is {limit} ({why})", field)


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """A prompt's limits, one path for every surface: ``max_chars`` (``max_prompt_chars``)
    and ``max_tokens`` (``max_prompt_tokens``), and per call the model's context
    (``max_model_len``, when known: the lower of the two token limits holds). A prompt
    over them is an :class:`InputError` 400 naming ``field``, before tokenizing
    (:meth:`check_text`: at most the characters the token limit can hold are ever
    tokenized) and after (:meth:`check_ids`)."""

    max_chars: int
    max_tokens: int

    def tokens(self, context: int | None = None) -> tuple[int, str]:
        """(the most tokens a prompt may have, what sets it)."""
        if context is not None and context < self.max_tokens:
            return context, "max_model_len"
        return self.max_tokens, "max_prompt_tokens"

    def check_text(self, value: object, field: str, token_chars: int | None,
                   context: int | None = None, *, count: Callable[[], int] | None = None,
                   json_len: int | None = None) -> None:
        """Refuse ``value`` (a prompt, chat messages) with more characters than worth
        tokenizing (:func:`chars_limit`; ``token_chars``: the tokenizer's
        :func:`token_chars_bound`, None: unknown). ``count``: counts them instead of
        :func:`text_chars` (``value`` then unused); ``json_len``: the bytes of the
        messages' JSON, which hold at least as many characters as its strings: within the
        limit, nothing is counted (O(1))."""
        tokens, name = self.tokens(context)
        if json_len is not None and json_len <= min(tokens, self.max_chars):
            return
        limit, why = chars_limit(self.max_chars, tokens, token_chars, name)
        check_chars(value, limit, field, why, count() if count is not None else None)

    def check_ids(self, ids: Sequence[int], field: str, context: int | None = None) -> None:
        """Refuse more token ids than :meth:`tokens` allows."""
        limit, why = self.tokens(context)
        check_length(ids, limit, field, why)
