"""Chats with media (images, audio, video) and completions given as prompt embeddings:
their cache identity, and what the gateway routes them by when it cannot have it all.

**Media, whole.** vLLM keys the blocks an image covers by the image's identifier and
offset, and every block after them by their parents (:mod:`kvevents.index.media`). The
identifier is the engine's own (its processor's hash of the image and its options, or
the part's ``uuid``), and so are the placeholder tokens the image expands to (their
number depends on the image's size and the model's processor). So a chat whose content
has a media part (``image_url``, ``input_image``, ``image_embeds``, ``image_pil``,
``audio_url``, ``input_audio``, ``audio_embeds``, ``video_url``) is first rendered by an
engine serving the model: vLLM 0.32's ``POST /v1/chat/completions/render`` (served with
``vllm serve --enable-scale-out``) answers the prompt's token ids with each item's
``mm_hashes`` and ``mm_placeholders``, exactly what the engine hashes (``mm_payload:
"none"``: no tensors). :class:`Renderer` asks it with the request's own body, and the
prompt is looked up block by block under its items. Cost: one more hop per media chat,
in which the engine fetches and processes the images once more (its render skips the
processor cache). An engine that does not serve the endpoint (403, 404, 405, 501) is not
asked again for ``retry_s``.

**Media, partial.** When no render can be had, the chat is routed by the ids of its text
**before the first media part**, which are keyed by text alone. That prefix is where its
cache can be shared: the system
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

Both partial cases are counted in ``kvevents_gateway_partial_prompts_total{reason}``
(``reason``: ``image``, ``audio``, ``video`` or ``prompt_embeds``); a rendered chat is
whole and not counted. Cost: one pass over a chat's messages when they did not decode
as text-only messages (a text-only chat is never looked at), nothing per token or block.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import msgspec

from kvevents.gateway.errors import OpenAIError
from kvevents.index import MediaItem, media_items

__all__ = ["MEDIA_PARTS", "PROMPT_EMBEDS", "REASONS", "RENDER_PATH", "SENTINEL", "Renderer",
           "before_media", "check_embeds", "first_media", "parse_render", "render_body", "text_before",
           "without_media"]

log = logging.getLogger(__name__)

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


def without_media(messages: Any) -> Any:
    """The messages with their media parts left out: what counts toward a prompt's
    characters (an image's data URL is not text the template renders: it becomes the
    model's placeholder tokens, whatever its size)."""
    if not isinstance(messages, list):
        return messages

    def text_parts(parts: list) -> list:
        return [p for p in parts if not (isinstance(p, dict) and p.get("type") in MEDIA_PARTS)]
    return [{**m, "content": text_parts(m["content"])}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]


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


#: vLLM 0.32's chat render endpoint (``--enable-scale-out``, or ``vllm launch render``).
RENDER_PATH = "/v1/chat/completions/render"
#: Answers that say an engine does not render (scale-out endpoints off, an older vLLM).
_NOT_SERVED = (403, 404, 405, 501)
# Fields of a chat body that a render refuses or that only matter to generation.
_NOT_RENDERED = ("stream", "stream_options")


def render_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat request's body as the render endpoint takes it: the same fields (so it
    renders exactly what the engine will), not streamed, without the tensors."""
    out = {k: v for k, v in body.items() if k not in _NOT_RENDERED}
    out["mm_payload"] = "none"
    return out


def parse_render(doc: Any) -> tuple[list[int], tuple[MediaItem, ...]] | None:
    """(token ids, items) of a render's answer (vLLM's ``GenerateRequest``): each item's
    ``mm_hashes`` entry is its identifier, its ``mm_placeholders`` entry where its tokens
    are; None when the answer is not of that shape."""
    if not isinstance(doc, dict):
        return None
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        return None
    feats = doc.get("features")
    if feats is None:
        return ids, ()
    try:
        hashes, places = feats["mm_hashes"], feats["mm_placeholders"]
        items = [(h, p["offset"], p["length"]) for modality in hashes
                 for h, p in zip(hashes[modality], places[modality], strict=True)]
        return ids, media_items(items)
    except (KeyError, TypeError, ValueError):
        return None


class Renderer:
    """Asks engines to render media chats (see the module docstring). The event loop's
    thread only."""

    def __init__(self, client: httpx.AsyncClient, timeout: float = 10.0, retry_s: float = 60.0) -> None:
        self.client = client
        self.timeout = timeout
        self.retry_s = retry_s
        self._not_until: dict[str, float] = {}  # engine URL -> when to ask it again

    async def render(self, url: str, body: dict[str, Any]) -> tuple[list[int], tuple[MediaItem, ...]] | None:
        """The prompt's (ids, items) as the engine at ``url`` renders the chat ``body``
        (a chat request's JSON object), or None when it cannot say."""
        until = self._not_until.get(url)
        if until is not None:
            if time.monotonic() < until:
                return None
            del self._not_until[url]
        try:
            resp = await self.client.post(url + RENDER_PATH, json=render_body(body), timeout=self.timeout)
        except httpx.HTTPError as exc:
            log.debug("render at %s failed: %s", url, exc)
            return None
        if resp.status_code in _NOT_SERVED:
            self._not_until[url] = time.monotonic() + self.retry_s
            log.info("engine %s does not render chats (%d; vllm serve --enable-scale-out serves %s): "
                     "media chats are routed by their text before the first media part", url,
                     resp.status_code, RENDER_PATH)
            return None
        if resp.status_code != 200:
            log.debug("render at %s answered %d", url, resp.status_code)
            return None
        try:
            got = parse_render(resp.json())
        except ValueError:
            got = None
        if got is None:
            log.debug("render at %s answered an unknown shape", url)
        return got
