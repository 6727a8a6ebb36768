"""Prompts the gateway routes by less than their whole cache identity: chats with media
(images, audio, video) and completions given as prompt embeddings.

**Media.** vLLM keys the blocks an image covers by the image's identifier and offset, and
every block after them by their parents. The gateway does not compute those
identifiers: they come from the engine's multimodal processor, or from a part's
``uuid``. So a chat whose content has a media part (``image_url``, ``input_image``,
``image_embeds``, ``image_pil``, ``audio_url``, ``input_audio``, ``audio_embeds``,
``video_url``) is routed by the ids of its text **before the first media part**, which
are keyed by text alone. That prefix is where its cache can be shared: the system
prompt, the history, and the turn's text before the image. The conversation is cut
there (:func:`before_media`): the messages before the one with the media part, and that
message with its content replaced by a sentinel text part after the text parts before
the media part (templates with the ``openai`` content format render parts in order).
For ``string``-format templates the sentinel alone, because vLLM puts a string-format
message's media placeholders *before* its text. The chat is rendered as vLLM would
render it, cut at the sentinel, and the text before it is tokenized. Placeholders are
special tokens, so that text's ids are the engine's own. This needs the model's local
tokenizer. Without one, the engine's ``/tokenize`` of the whole chat is used as before:
matching stops at the first block the image covers all the same.

**Prompt embeddings.** A ``/v1/completions`` body with ``prompt_embeds`` and no
``prompt`` (vLLM's ``--enable-prompt-embeds``) has no token ids at all. vLLM keys its
blocks by a digest of the embeddings, which nothing else shares. It is routed by load
alone, with no cache affinity, instead of being refused.

Both are counted in ``kvevents_gateway_partial_prompts_total{reason}`` (``reason``:
``image``, ``audio``, ``video`` or ``prompt_embeds``). Cost: one pass over a chat's
messages when they did not decode as text-only messages (a text-only chat is never
looked at), nothing per token or block.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvevents.gateway.errors import OpenAIError

__all__ = ["MEDIA_PARTS", "PROMPT_EMBEDS", "REASONS", "SENTINEL", "before_media", "check_embeds",
           "first_media", "text_before"]

PROMPT_EMBEDS = "prompt_embeds"
#: Content part types vLLM 0.32's chat requests take as media, by kind.
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image_embeds": "image",
               "image_pil": "image", "audio_url": "audio", "input_audio": "audio",
               "audio_embeds": "audio", "video_url": "video"}
#: Every ``reason`` of ``kvevents_gateway_partial_prompts_total``.
REASONS = ("image", "audio", "video", PROMPT_EMBEDS)
#: Where the first media part was (private-use characters: no template writes them).
SENTINEL = "\ue000kvevents-media\ue001"


def first_media(messages: Any) -> str | None:
    """The kind of a chat's first media part (``image``, ``audio``, ``video``), or None."""
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    kind = MEDIA_PARTS.get(part.get("type"))  # type: ignore[arg-type]
                    if kind is not None:
                        return kind
    return None


def check_embeds(raw: msgspec.Raw) -> None:
    """400 naming ``prompt_embeds`` unless it is a string or an array (base64 tensors:
    the engine checks the rest)."""
    if memoryview(raw)[:1].tobytes() not in (b'"', b"["):  # (the first byte: no copy of it all)
        raise OpenAIError(400, "prompt_embeds must be a base64 string or an array of them",
                          "prompt_embeds")


def before_media(messages: list, content_format: str) -> list[dict] | None:
    """The conversation cut at its first media part (see the module docstring), or None
    when it has none."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for i, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                    keep = content[:i] if content_format == "openai" else []
                    out.append({**m, "content": [*keep, {"type": "text", "text": SENTINEL}]})
                    return out
        out.append(m)
    return None


def text_before(rendered: str) -> str | None:
    """The rendered text before the sentinel (None: the template did not render it)."""
    cut = rendered.find(SENTINEL)
    return rendered[:cut] if cut >= 0 else None
