"""An OpenAI request body as the gateway needs it: the model, whether it streams, and
the prompt's token ids for routing.

The body itself is forwarded to the engine byte for byte; this only reads it. Token ids
come from the model's local tokenizer (``serve --tokenizer MODEL=DIR``: the same ids the
engine computes, chat templates included) or, without one, from an engine's own
``POST /tokenize`` (one more hop; said once in the log). A body the gateway cannot read
is a 400 naming the field; a prompt it cannot tokenize (a chat template that refuses
the messages, an engine without ``/tokenize``) is routed without a cache signal, by load
alone, and counted: routing must never be why a request fails.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import msgspec
from starlette.concurrency import run_in_threadpool

from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.media import (PROMPT_EMBEDS, Renderer, before_media, check_embeds, first_media,
                                    text_before, without_media)
from kvevents.gateway.parity import TokenParity
from kvevents.index import MediaItem
from kvevents.text import ChatTemplateError, TextTokenizer, TokenizerRegistry
from kvevents.text.chat import ChatMessage
from kvevents.text.chat_inputs import ChatOptions
from kvevents.text.limits import text_chars

log = logging.getLogger(__name__)

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"  # rendered as a chat (see .responses)
EMBEDDINGS = "embeddings"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
#: The kinds whose prompt is chat messages (rendered by the model's chat template).
MESSAGES = (CHAT, RESPONSES)


@dataclass
class OpenAIRequest:
    """What the gateway reads of a body (the body itself is forwarded unchanged)."""

    kind: str  # CHAT, COMPLETIONS, RESPONSES (a chat), or a passed-through one
    body: bytes
    model: str | None
    stream: bool
    prompt: str | list[int] | None = None  # completions: the (first) prompt
    # chat: the messages typed (``chat``) when every one is a ChatMessage, else as
    # decoded JSON (``messages``: the engine's /tokenize or load alone route them)
    chat: list[ChatMessage] | None = None
    messages: list[dict[str, Any]] | None = None
    messages_json: bytes = b""  # chat: the messages as the body wrote them
    # chat: the other fields that change its ids (tools, chat_template_kwargs...; None: a
    # plain request), and their JSON as the body wrote them (for the recent ones' key)
    options: ChatOptions | None = None
    options_json: bytes = b""
    add_special_tokens: bool = True  # completions: the BOS... of a text prompt
    # The tenant's salt (vLLM keys the prompt's first block with it): part of the
    # prompt's cache identity. Never logged, never a label.
    cache_salt: str | None = None
    # Why the prompt is routed by less than its whole identity (:mod:`.media`): a chat's
    # first media part ("image", "audio", "video": routed by the text before it), or
    # "prompt_embeds" (a completion without a prompt: no ids, by load alone); None: whole.
    partial: str | None = None
    # responses: the stored response this one follows (answered by the engine that has it)
    previous_response_id: str | None = None
    # A media chat rendered by an engine: its items (identifier, placeholder offset and
    # length), looked up with its ids block by block (:mod:`kvevents.index.media`).
    media: tuple[MediaItem, ...] = ()

    def plain_messages(self) -> list[dict[str, Any]] | None:
        """The chat messages as decoded JSON, as the body wrote them."""
        if self.messages is None and self.messages_json:
            return msgspec.json.decode(self.messages_json)
        return self.messages


class _Body(msgspec.Struct):
    """The fields the gateway reads; the rest of the body is the engine's business.
    ``prompt`` and ``messages`` stay raw here and are typed below, in compiled code."""

    model: str | None = None
    stream: bool | None = None
    cache_salt: str | None = None
    prompt: msgspec.Raw = msgspec.Raw()  # empty: absent
    prompt_embeds: msgspec.Raw = msgspec.Raw()  # (vLLM's --enable-prompt-embeds)
    messages: msgspec.Raw = msgspec.Raw()
    add_special_tokens: bool | None = None
    # chat: what else changes the rendered prompt (vLLM's names); raw until present
    tools: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    chat_template: msgspec.Raw = msgspec.Raw()
    add_generation_prompt: msgspec.Raw = msgspec.Raw()
    continue_final_message: msgspec.Raw = msgspec.Raw()
    reasoning_effort: msgspec.Raw = msgspec.Raw()
    tool_choice: msgspec.Raw = msgspec.Raw()  # (read only beside tools: alone it changes nothing)


# ChatOptions' fields read raw above (add_special_tokens, a completions field too, typed)
_OPTION_FIELDS = tuple(f for f in ChatOptions.__struct_fields__ if f != "add_special_tokens")


_body = msgspec.json.Decoder(_Body)
_ids = msgspec.json.Decoder(list[int])
_texts = msgspec.json.Decoder(list[str])
_id_lists = msgspec.json.Decoder(list[list[int]])
_messages = msgspec.json.Decoder(list[dict[str, Any]])
_chat = msgspec.json.Decoder(list[ChatMessage])
_chat_options = msgspec.json.Decoder(ChatOptions)


def parse_request(kind: str, body: bytes) -> OpenAIRequest:
    """Read a chat or completions body; raises :class:`OpenAIError` (400) naming the field.
    Token-id prompts are read by msgspec into a list of ints (no Python per token).
    Invalid UTF-8 in a string and JSON nested past msgspec's depth limit (anywhere, in an
    unknown field too) are 400s, not the decoder's own exceptions."""
    try:
        return _parse(kind, body)
    except UnicodeDecodeError:
        raise OpenAIError(400, "request body is not valid UTF-8") from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None


def _parse(kind: str, body: bytes) -> OpenAIRequest:
    try:
        doc = _body.decode(body)
    except msgspec.ValidationError as exc:
        field = str(exc).rpartition("$.")[2].rstrip("`") or None
        raise OpenAIError(400, f"invalid request: {exc}",
                          field if field in ("model", "stream", "cache_salt") else None) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"request body is not a JSON object: {exc}") from None
    req = OpenAIRequest(kind, body, doc.model, bool(doc.stream), cache_salt=doc.cache_salt or None)
    if kind == CHAT:
        raw = doc.messages
        chat, messages = decode_chat(raw)
        if not chat and not messages:
            raise OpenAIError(400, "messages must be a non-empty array of objects", "messages")
        req.chat, req.messages = chat, messages
        req.messages_json = bytes(raw)
        _options(req, doc)
        if messages is not None:  # (a text-only chat decodes as ChatMessages: never looked at)
            req.partial = first_media(messages)
    elif len(doc.prompt_embeds) and (not len(doc.prompt) or bytes(doc.prompt) == b"null"):
        check_embeds(doc.prompt_embeds)  # no ids to route by: load alone
        req.partial = PROMPT_EMBEDS
    else:
        req.prompt = _first_prompt(doc.prompt)
        req.add_special_tokens = doc.add_special_tokens is not False
    return req


def decode_chat(raw: bytes | msgspec.Raw) -> tuple[list[ChatMessage] | None, list[dict[str, Any]] | None]:
    """Chat messages straight into ChatMessage structs (what the chat template renders),
    one pass in C; messages it does not describe are read as plain objects instead
    (``(None, dicts)``); neither: ``(None, None)``."""
    if len(raw):
        try:
            return _chat.decode(raw), None
        except msgspec.ValidationError:
            try:
                return None, _messages.decode(raw)
            except msgspec.ValidationError:
                pass
    return None, None


def _options(req: OpenAIRequest, doc: _Body) -> None:
    """A chat's fields besides its messages that change its ids (a plain chat has none:
    nothing is decoded). One the gateway cannot read leaves the chat to the engine's
    ``/tokenize`` (``req.options`` stays None and ``messages`` is set)."""
    if not (doc.tools or doc.documents or doc.chat_template_kwargs or doc.chat_template
            or doc.add_generation_prompt or doc.continue_final_message or doc.reasoning_effort
            or doc.add_special_tokens is not None):  # (one test per request: the common case)
        return
    present = [(name, raw) for name in _OPTION_FIELDS if len(raw := getattr(doc, name))]
    parts = {name: raw for name, raw in present}
    if doc.add_special_tokens is not None:
        parts["add_special_tokens"] = msgspec.json.encode(doc.add_special_tokens)
    joined = b"{" + b",".join(b'"%s":%s' % (k.encode(), bytes(v)) for k, v in parts.items()) + b"}"
    req.options_json = joined
    try:
        req.options = _chat_options.decode(joined)
    except msgspec.ValidationError as exc:
        if req.chat is not None:  # valid JSON the engine may take: its /tokenize decides
            req.messages = msgspec.json.decode(req.messages_json)
            req.chat = None
        log.debug("chat options the gateway does not read (%s); the engine's /tokenize tokenizes it", exc)


class _Passed(msgspec.Struct):
    """What the gateway reads of a passed-through body: the model, and whether the
    field the engine needs is there."""

    model: str | None = None
    input: msgspec.Raw = msgspec.Raw()
    tokens: msgspec.Raw = msgspec.Raw()


_passed = msgspec.json.Decoder(_Passed)


def parse_passthrough(kind: str, required: str | None, body: bytes) -> OpenAIRequest:
    """A body passed through as it is (embeddings, tokenize, detokenize): its model, and a
    400 naming ``required`` (a field of :class:`_Passed`) when it is missing; the rest
    is the engine's to check."""
    try:
        doc = _passed.decode(body)
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, f"invalid request: {exc}", "model" if "$.model" in str(exc) else None) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise OpenAIError(400, f"request body is not a JSON object: {exc}") from None
    if required is not None and bytes(getattr(doc, required)) in (b"", b"null"):
        raise OpenAIError(400, f"{required} is required", required)
    return OpenAIRequest(kind, body, doc.model, False)


def prompt_chars(req: OpenAIRequest) -> int:
    """Characters of a request's prompt text: a completion's string prompt, or every
    string in the chat messages (contents, content parts, tool calls' arguments, names:
    whatever a chat template may render), as :func:`~kvevents.text.limits.text_chars`
    counts them for ``/v1/lookup`` and ``/v1/route``. One step per string. A chat's
    media parts are not counted (:func:`~.media.without_media`)."""
    if req.kind not in MESSAGES:
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    if req.chat is not None:
        return text_chars(req.chat)
    return text_chars(without_media(req.messages) if req.partial is not None else req.messages)


def _first_prompt(raw: msgspec.Raw) -> str | list[int]:
    """The prompt to route by: a string, token ids, or the first of a batch of either."""
    if len(raw):
        for decoder, first in ((_ids, False), (_texts, True), (_id_lists, True)):
            try:
                value = decoder.decode(raw)
            except msgspec.ValidationError:
                continue
            if value and (not first or value[0]):
                return value[0] if first else value
        try:
            text = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            text = None
        if isinstance(text, str):
            return text
    raise OpenAIError(400, "prompt must be a string, an array of token ids, or a non-empty "
                           "array of either", "prompt")


# A body this small renders and tokenizes in well under a millisecond: cheaper on the
# event loop than the hop to a worker thread and back (which took a tenth of the loop's
# time per short request). Longer prompts go to a thread so the loop keeps serving.
INLINE_BODY_BYTES = 16 * 1024


async def _off_loop_if_long(size: int, fn: Callable[[Any], Sequence[int]], arg: Any) -> Sequence[int]:
    return fn(arg) if size <= INLINE_BODY_BYTES else await run_in_threadpool(fn, arg)


# A conversation sent again as it was (a retry, "regenerate", the same prompt sampled
# again) skips the chat template and the encoder: its ids, by the messages' JSON text.
# Bounded by the bytes held (text and ids); conversations over MAX_RECENT_BYTES / 64
# are not kept.
MAX_RECENT_BYTES = 32 << 20


# The chat fields vLLM 0.32's /tokenize reads (documents and reasoning_effort it does not).
_TOKENIZE_TAKES = ("tools", "chat_template_kwargs", "chat_template", "add_generation_prompt",
                   "continue_final_message", "add_special_tokens")


def _shape(req: OpenAIRequest) -> tuple[bool, bool]:
    """(has tools, has content parts): what a parity mismatch's reason reads."""
    tools = bool(req.options is not None and req.options.tools)
    parts = bool(req.chat) and any(isinstance(m.content, list) for m in req.chat or ())
    return tools, parts


def _plain_ids(tok: TextTokenizer) -> Callable[[str], Sequence[int]]:
    return lambda text: tok.prompt_ids(text, add_special_tokens=False)


class PromptTokens:
    """Token ids of a request's prompt, locally when the model has a tokenizer, else
    from an engine's ``/tokenize``. The event loop's thread only (the encoding itself
    may run on a worker thread)."""

    def __init__(self, tokenizers: TokenizerRegistry, client: httpx.AsyncClient,
                 timeout: float = 5.0, parity: TokenParity | None = None) -> None:
        self.tokenizers = tokenizers
        self.client = client
        self.timeout = timeout
        self.parity = parity  # live checks of the local ids against the engines' (None: off)
        self.renderer = Renderer(client)  # media chats' ids and items, from an engine
        self.failures = 0  # prompts routed without ids
        self.repeats = 0  # conversations whose ids came from the recent ones
        self._told: set[str] = set()
        self._recent: OrderedDict[tuple[str, bytes], array] = OrderedDict()
        self._recent_bytes = 0

    async def identity(self, req: OpenAIRequest, engine_url: str | None,
                       engine: str = "") -> tuple[Sequence[int] | None, str | None, tuple[MediaItem, ...]]:
        """(ids, ``partial``, ``media``) of the request (see :meth:`ids`): what it is
        routed by."""
        ids = await self.ids(req, engine_url, engine)
        return ids, req.partial, req.media

    async def ids(self, req: OpenAIRequest, engine_url: str | None, engine: str = "") -> Sequence[int] | None:
        """The ids, or None when they cannot be had (routed by load alone). ``engine``
        (its name) and ``engine_url``: an engine serving the model, asked when there is no
        local tokenizer, and for the parity checks (:mod:`.parity`). A media chat is
        rendered there first (:mod:`.media`): then ``req.media`` is set and ``req.partial``
        cleared; else it is routed by its text before the first media part."""
        if req.kind == COMPLETIONS and isinstance(req.prompt, list):
            return req.prompt
        if req.kind == RESPONSES and not req.messages_json:
            return None  # a response not rendered here (see .responses): by load alone
        if req.partial == PROMPT_EMBEDS:
            return None  # no ids: routed by load alone (see .media)
        if req.partial is not None and engine_url is not None:
            got = await self.renderer.render(engine_url, msgspec.json.decode(req.body))
            if got is not None:
                req.partial, req.media = None, got[1]
                return got[0]
        tok = self.tokenizers.get(req.model)
        if req.partial is not None and tok is not None:  # media: the text before the first
            ids = await self._before_media(tok, req)
            if ids is not None:
                return ids
        if tok is not None:
            parity = self.parity if engine_url is not None else None
            if parity is not None and parity.engine_ids(req.model):
                # Local ids differed from the engine's: route with the engine's, and
                # compare a sample with the local ones (a match returns to them).
                theirs = await self._ask(req, engine_url)  # type: ignore[arg-type]
                if theirs is not None:
                    if parity.due(req.model):
                        ours = await self._local(tok, req)
                        if ours is not None:
                            parity.record(engine, req.model, ours, theirs, *_shape(req))
                    return theirs
            ours = await self._local(tok, req)
            if ours is not None:
                if parity is not None and parity.due(req.model):
                    parity.check(engine, req.model, ours, partial(self._ask, req, engine_url), *_shape(req))
                return ours
        if engine_url is None:
            self.failures += 1
            return None
        return await self._remote(req, engine_url)

    async def _local(self, tok: TextTokenizer, req: OpenAIRequest) -> Sequence[int] | None:
        """The ids from the model's own tokenizer (None: a request it cannot render)."""
        try:
            # array('q'): the index and numpy read it as it is (no int object per token).
            if req.kind == COMPLETIONS:
                if not req.add_special_tokens:
                    return await _off_loop_if_long(len(req.body), _plain_ids(tok), req.prompt)
                return await _off_loop_if_long(len(req.body), tok.prompt_ids, req.prompt)
            if req.chat is not None:
                return await self._chat_ids(tok, req)
        except (msgspec.ValidationError, ChatTemplateError) as exc:
            log.debug("local tokenization of a %s request failed (%s); asking the engine", req.kind, exc)
        return None

    async def _before_media(self, tok: TextTokenizer, req: OpenAIRequest) -> Sequence[int] | None:
        """The ids of a chat's text before its first media part (see :mod:`.media`), or
        None when they cannot be had here (the engine's ``/tokenize`` then)."""
        options = req.options
        try:
            if options is not None and options.add_special_tokens:
                return None  # (a BOS before, and whatever suffix after: the engine's)
            cut = before_media(req.plain_messages() or [], tok.template_for(options).content_format)
            chat = msgspec.convert(cut, list[ChatMessage])

            def head(messages: list[ChatMessage]) -> Sequence[int] | None:
                text = text_before(tok.render_chat(messages, options))
                return None if text is None else tok.encode_rendered(text)
            return await _off_loop_if_long(len(req.body), head, chat)
        except (msgspec.ValidationError, ChatTemplateError) as exc:
            log.debug("the text before a chat's media did not render (%s); asking the engine", exc)
        return None

    async def _chat_ids(self, tok: TextTokenizer, req: OpenAIRequest) -> array:
        """A chat's ids, from the recent conversations when its messages were seen as
        they are (and its template renders the same every time: no ``strftime_now``)."""
        key = (tok.model, req.messages_json + req.options_json)
        recent = self._recent
        if tok.repeatable_chat:
            got = recent.get(key)
            if got is not None:
                recent.move_to_end(key)
                self.repeats += 1
                return array("q", got)  # a copy: callers may hand it on
        messages, options = req.chat, req.options
        if options is None:
            ids = await _off_loop_if_long(len(req.body), tok.chat_ids, messages)
        else:
            ids = await _off_loop_if_long(len(req.body), lambda m: tok.chat_ids(m, options), messages)
        size = len(key[1]) + 8 * len(ids)
        if tok.repeatable_chat and size <= MAX_RECENT_BYTES // 64 and key not in recent:
            recent[key] = array("q", ids)
            self._recent_bytes += size
            while self._recent_bytes > MAX_RECENT_BYTES:
                (_, text), old = recent.popitem(last=False)
                self._recent_bytes -= len(text) + 8 * len(old)
        return ids

    async def _remote(self, req: OpenAIRequest, engine_url: str) -> Sequence[int] | None:
        key = req.model or ""
        if key not in self._told:
            self._told.add(key)
            log.info("no local tokenizer for model %r: asking the engines' /tokenize (one more "
                     "hop per request; serve --tokenizer %s=DIR avoids it)", req.model, req.model or "MODEL")
        got = await self._ask(req, engine_url)
        if got is None:
            self.failures += 1
        return got

    async def _ask(self, req: OpenAIRequest, engine_url: str) -> list[int] | None:
        """The engine's ``/tokenize`` ids for the request (None: it could not say)."""
        payload: dict[str, Any] = {"model": req.model} if req.model else {}
        if req.kind in MESSAGES:
            payload["messages"] = req.plain_messages()
            if req.options_json:  # what /tokenize takes of the other fields (vLLM 0.32)
                opts = msgspec.json.decode(req.options_json)
                payload.update({k: opts[k] for k in _TOKENIZE_TAKES if k in opts})
                tok = self.tokenizers.get(req.model)
                # /tokenize takes no tool_choice: the tools an engine that drops them for
                # "none" would not render are not sent (the same setting as our render's)
                if tok is not None and tok.drops_tools(opts.get("tool_choice")):
                    payload.pop("tools", None)
        else:
            payload["prompt"] = req.prompt
            if not req.add_special_tokens:
                payload["add_special_tokens"] = False
        try:
            resp = await self.client.post(engine_url + "/tokenize", json=payload, timeout=self.timeout)
            resp.raise_for_status()
            tokens = resp.json().get("tokens")
            if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                return tokens
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.debug("engine /tokenize failed: %s", exc)
        return None

