"""The prompt of a ``/v1/lookup`` or ``/v1/route`` body: token ids, and for chats with
media parts (images, audio, video) their items, as the gateway has them.

A text prompt is tokenized here (:func:`~kvevents.routing.offloop.prompt_token_ids`);
token ids may come with their ``features`` (a render's answer: the items as they are). A
chat with media goes the gateway's way (:mod:`kvevents.gateway.media`): rendered by an
engine serving ``model`` (the adapter's name when ``lora_name`` is given: what the
engine serves it as), whose answer gives the ids and each item's identifier and
placeholder range, looked up block by block; else by the ids of its text before the
first media part (counted in ``kvevents_gateway_partial_prompts_total{reason}``, as the
gateway's are). Neither possible (no engine renders, no tokenizer for ``model``): 422 on
``messages``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import msgspec

from kvevents.api.body import LookupBody
from kvevents.gateway import Gateway, OpenAIError
from kvevents.gateway.prompt import CHAT, OpenAIRequest, parse_request, prompt_chars
from kvevents.index import MediaItem, media_items
from kvevents.routing.offloop import prompt_token_ids
from kvevents.text.limits import PromptLimits
from kvevents.text.prompt import InputError

__all__ = ["body_prompt"]

log = logging.getLogger(__name__)


async def body_prompt(state: Any, body: LookupBody, limit: int, max_chars: int
                      ) -> tuple[Sequence[int], tuple[MediaItem, ...]]:
    """(ids, media items) of the body's prompt (``state``: the app's). Raises
    :class:`~kvevents.text.prompt.InputError` as :func:`prompt_token_ids` does."""
    messages = body.text_messages()
    if body.messages is None or messages is not None:
        if body.features is not None and body.token_ids is None:
            raise InputError(422, "features go with token_ids (a render's answer)", "features")
        ids = await prompt_token_ids(
            state.tokenizers, limit, max_chars=max_chars, model=body.model, token_ids=body.token_ids,
            prompt=body.prompt, messages=messages, options=body.chat_options())
        try:
            return ids, media_items(body.features.items()) if body.features is not None else ()
        except ValueError as exc:
            raise InputError(422, f"features: {exc}", "features") from None
    if body.token_ids is not None or body.prompt is not None or body.features is not None:
        raise InputError(422, "give exactly one of token_ids, prompt or messages", "messages")
    gateway: Gateway = state.gateway
    req, served = _chat_request(body)
    limits = PromptLimits(max_chars, limit)
    tok = state.tokenizers.get(body.model)  # (counted as the gateway counts it: not the media)
    limits.check_text(None, "messages", tok.max_token_chars() if tok else None, count=partial(prompt_chars, req))
    ids, unscored, media = await _media_ids(gateway, req, served)
    if ids is None:
        raise InputError(422, "messages with media parts need an engine serving the model that "
                              "renders chats (vllm serve --enable-scale-out) or a tokenizer for "
                              "model", "messages")
    if unscored is not None:
        gateway.metrics.unscored(unscored)
    limits.check_ids(ids, "messages")
    return ids, media


def _chat_request(body: LookupBody) -> tuple[OpenAIRequest, str | None]:
    """The body's chat as the gateway reads a chat request (its model the tokenizer's,
    the base model's), and the model or adapter that serves it."""
    chat: dict[str, Any] = {k: v for k, v in msgspec.to_builtins(body).items() if v is not None
                            and k not in ("token_ids", "prompt", "lora_name", "cache_salt", "candidates")}
    for m in chat["messages"]:  # (a text part's default type is left out by to_builtins)
        for part in m["content"] if isinstance(m.get("content"), list) else ():
            part.setdefault("type", "text")
    served = body.lora_name or body.model
    if served is not None:
        chat["model"] = served
    try:
        req = parse_request(CHAT, msgspec.json.encode(chat))
    except OpenAIError as exc:  # (what the gateway would answer 400 to)
        raise InputError(422, exc.message, exc.param or "messages") from None
    return dataclasses.replace(req, model=body.model), served


async def _media_ids(gateway: Gateway, req: OpenAIRequest, served: str | None
                     ) -> tuple[Sequence[int] | None, str | None, tuple]:
    engines = gateway.targets(served)
    engine = next(iter(gateway.reachable(engines) or engines), None)
    assert gateway.tokens is not None
    try:
        return await gateway.tokens.identity(req, engine.http if engine else None, engine.name if engine else "")
    except Exception:  # noqa: BLE001 - as in the gateway: a prompt it cannot read has no ids
        log.exception("reading a media chat of a lookup failed")
        return None, req.partial, ()
