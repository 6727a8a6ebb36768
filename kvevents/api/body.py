"""Request bodies of the hot endpoints, defined once as msgspec Structs.

Each body is decoded by a typed msgspec decoder built once (microseconds for a
2,048-token list, where pydantic plus FastAPI's body machinery cost about a
millisecond), and its OpenAPI schema is generated from the same Struct
(``msgspec.json.schema_components``), so the documentation cannot drift from what is
accepted. Errors become the API's error shape with the offending field named, e.g.
``token_ids[3]`` for msgspec's ``$.token_ids[3]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from fastapi import FastAPI, Request

from kvevents.api._fastbody import lookup_body
from kvevents.api.errors import ApiError
from kvevents.text.chat import ChatMessage
from kvevents.text.chat_inputs import ChatOptions, Tool


T = TypeVar("T")

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]

#: Media part types (as vLLM's chat requests take them) and the field each needs.
MEDIA_FIELDS = {"image_url": "image_url", "input_image": "image_url", "image_embeds": "image_embeds",
                "audio_url": "audio_url", "input_audio": "input_audio", "audio_embeds": "audio_embeds",
                "video_url": "video_url"}


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One part of a message's content: text (``text``, ``refusal``, ``thinking``) or
    media (``image_url``, ``input_image``, ``image_embeds``, ``audio_url``,
    ``input_audio``, ``audio_embeds``, ``video_url``, each with its field of that name;
    ``input_image`` with ``image_url``), with the client's ``uuid`` for the item."""

    type: Literal["text", "refusal", "thinking", "image_url", "input_image", "image_embeds",
                  "audio_url", "input_audio", "audio_embeds", "video_url"] = "text"
    text: str | None = None
    refusal: str | None = None
    thinking: str | None = None
    image_url: dict[str, Any] | str | None = None
    image_embeds: dict[str, Any] | str | None = None
    audio_url: dict[str, Any] | str | None = None
    input_audio: dict[str, Any] | None = None
    audio_embeds: dict[str, Any] | str | None = None
    video_url: dict[str, Any] | str | None = None
    uuid: str | None = None

    def __post_init__(self) -> None:
        need = MEDIA_FIELDS.get(self.type)
        if need is not None and getattr(self, need) is None:
            raise ValueError(f"Object missing required field `{need}`")
        if need is None:  # a text part: what a chat template is handed, nothing else
            extra = next((f for f in _MEDIA_ONLY if getattr(self, f) is not None), None)
            if extra is not None:
                raise ValueError(f"Object has field `{extra}`, which a {self.type} part does not take")


_MEDIA_ONLY = ("image_url", "image_embeds", "audio_url", "input_audio", "audio_embeds", "video_url", "uuid")


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One OpenAI chat message, its content text or parts (images too: see
    :func:`has_media`). The fields of :class:`~kvevents.text.chat.ChatMessage`."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


def has_media(messages: list[Message]) -> bool:
    """Whether any message has a media part."""
    return any(isinstance(m.content, list) and any(p.type in MEDIA_FIELDS for p in m.content)
               for m in messages)


_text_messages = msgspec.json.Decoder(list[ChatMessage])


class Placeholder(msgspec.Struct, forbid_unknown_fields=True):
    offset: Annotated[int, msgspec.Meta(ge=0, description="Its first token's position.")]
    length: Annotated[int, msgspec.Meta(ge=1, description="Its number of tokens.")]


class Features(msgspec.Struct):
    """A prompt's multimodal items as vLLM's render endpoint answers them (its
    ``features``; other fields, such as ``kwargs_data``, are ignored)."""

    mm_hashes: Annotated[dict[str, list[str]], msgspec.Meta(
        description="Per modality, each item's identifier (vLLM's mm_hash).")]
    mm_placeholders: Annotated[dict[str, list[Placeholder]], msgspec.Meta(
        description="Per modality, each item's placeholder tokens, in the same order.")]

    def __post_init__(self) -> None:
        if set(self.mm_hashes) != set(self.mm_placeholders):
            raise ValueError("mm_hashes and mm_placeholders name different modalities")
        for modality, hashes in self.mm_hashes.items():
            if len(hashes) != len(self.mm_placeholders[modality]):
                raise ValueError(f"mm_placeholders has {len(self.mm_placeholders[modality])} "
                                 f"{modality} items, mm_hashes {len(hashes)}")

    def items(self) -> list[tuple[str, int, int]]:
        return [(h, p.offset, p.length) for m, hashes in self.mm_hashes.items()
                for h, p in zip(hashes, self.mm_placeholders[m])]


class LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt to look up: exactly one of ``token_ids``, ``prompt`` or ``messages``."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(
        description="The prompt's token ids.")] | None = None
    features: Annotated[Features, msgspec.Meta(
        description="With `token_ids`: the prompt's multimodal items as vLLM's "
                    "`/v1/chat/completions/render` answers them (its `features`): the "
                    "blocks they cover match only blocks stored under the same items.")] | None = None
    prompt: Annotated[str, msgspec.Meta(
        description="Prompt text, tokenized with `model`'s tokenizer (special tokens "
                    "added as the tokenizer defines).")] | None = None
    messages: Annotated[list[Message], msgspec.Meta(
        min_length=1, description="OpenAI chat messages, rendered with `model`'s chat "
                                  "template (generation prompt added) and tokenized. With "
                                  "media parts (images...), rendered by an engine serving "
                                  "`model` (vLLM's /v1/chat/completions/render): its ids and "
                                  "each item's identifier and placeholders are looked up; "
                                  "else by the text before the first media part.")] | None = None
    model: Annotated[str, msgspec.Meta(
        description="Only consider engines serving this model; names the tokenizer for "
                    "`prompt` and `messages`.")] | None = None
    lora_name: Annotated[str, msgspec.Meta(
        description="LoRA adapter the prompt runs under.")] | None = None
    cache_salt: Annotated[str, msgspec.Meta(
        description="The request's `cache_salt` (vLLM, SGLang): only blocks stored under "
                    "the same salt match; an empty salt is none.")] | None = None
    # What else changes a chat's ids, as in an OpenAI chat request to vLLM (and, for
    # add_special_tokens, a completions one): the same names, the same defaults.
    tools: Annotated[list[Tool], msgspec.Meta(
        description="`messages`: the request's tools, handed to the chat template.")] | None = None
    documents: Annotated[list[dict[str, Any]], msgspec.Meta(
        description="`messages`: documents handed to the chat template.")] | None = None
    chat_template_kwargs: Annotated[dict[str, Any], msgspec.Meta(
        description="`messages`: the chat template's keyword arguments (e.g. `enable_thinking`).")] | None = None
    add_generation_prompt: Annotated[bool, msgspec.Meta(
        description="`messages`: end with the assistant's generation prompt (default true).")] | None = None
    continue_final_message: Annotated[bool, msgspec.Meta(
        description="`messages`: continue the last message instead (default false).")] | None = None
    reasoning_effort: Annotated[str, msgspec.Meta(
        description="`messages`: as vLLM, `none` turns a template's `enable_thinking` off.")] | None = None
    chat_template: Annotated[str, msgspec.Meta(
        description="`messages`: the request's own chat template (an engine started with "
                    "`--trust-request-chat-template` renders with it).")] | None = None
    add_special_tokens: Annotated[bool, msgspec.Meta(
        description="Add the tokenizer's special tokens (BOS...) around the text: default true "
                    "for `prompt`, false for `messages`.")] | None = None
    tool_choice: Annotated[str | dict[str, Any], msgspec.Meta(
        description="`messages`: the request's `tool_choice`; `none` drops the tools for a "
                    "tokenizer set up as an engine started with "
                    "`--exclude-tools-when-tool-choice-none`.")] | None = None

    def text_messages(self) -> list[ChatMessage] | None:
        """``messages`` as the chat template takes them (None: none, or with media)."""
        if self.messages is None or has_media(self.messages):
            return None
        try:
            return _text_messages.decode(msgspec.json.encode(self.messages))
        except msgspec.ValidationError as exc:  # (the same fields: not expected)
            message, field = _field(str(exc))
            raise ApiError(422, f"messages: {message}", f"messages{field.removeprefix('$')}"
                           if field else "messages") from None

    def chat_options(self) -> ChatOptions | None:
        """The fields besides ``messages`` that change a text's ids (None: none given, or
        the prompt is token ids)."""
        if self.token_ids is not None:
            return None
        given = {name: value for name in ChatOptions.__struct_fields__
                 if (value := getattr(self, name)) is not None}
        return ChatOptions(**given) if given else None


# A request count, bounded so sums and ratios of loads stay finite (1e308 overflowed).
MAX_LOAD = 1e9


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    waiting: Annotated[float, msgspec.Meta(ge=0, le=MAX_LOAD, description="Requests queued.")] = 0.0
    running: Annotated[float, msgspec.Meta(ge=0, le=MAX_LOAD, description="Requests running.")] = 0.0
    kv_usage: Annotated[float, msgspec.Meta(
        ge=0, le=1, description="Fraction of GPU KV blocks in use.")] = 0.0


class CandidateBody(msgspec.Struct, forbid_unknown_fields=True):
    """One engine to choose from. ``pod`` is the old name of ``engine`` (engines were
    called pods), still accepted; exactly one of the two is required."""

    engine: Annotated[str | None, msgspec.Meta(description="The engine's name.")] = None
    load: LoadBody | None = None
    pod: Annotated[str | None, msgspec.Meta(
        description="Deprecated: the old name of `engine`.",
        extra_json_schema={"deprecated": True})] = None

    def __post_init__(self) -> None:
        # Raised here, msgspec reports it at this candidate's path ("candidates[i]"),
        # and _field() appends the field named in backticks.
        if self.engine is None:
            if self.pod is None:
                raise ValueError("Object missing required field `engine`")
            self.engine = self.pod
        elif self.pod is not None:
            raise ValueError("both field `engine` and its old name `pod` given: give `engine` only")
        self.pod = None


class RouteBody(LookupBody, forbid_unknown_fields=True):
    """A prompt to route, with the engines to choose from."""

    candidates: Annotated[list[CandidateBody], msgspec.Meta(
        description="Engines to choose from, with their load; default: every engine not "
                    "down.")] | None = None


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


def _field(message: str) -> tuple[str, str | None]:
    """Split msgspec's message into (message, field path)."""
    m = _AT.search(message)
    path = m.group("path") if m else ""
    head = message[: m.start()] if m else message
    named = _FIELD.search(head)
    if named:
        path = f"{path}.{named.group('name')}" if path else named.group("name")
    return head, path or None


class BodyDecoder:
    """Decodes one body type; build once per type and reuse. ``fast``: a reader of the
    type's common shape, tried first; it returns None for anything else (msgspec then
    decodes, and words every error)."""

    def __init__(self, type_: type[T], fast: Callable[[bytes], T | None] | None = None) -> None:
        self.type = type_
        self._dec = msgspec.json.Decoder(type_)
        self._fast = fast

    async def __call__(self, request: Request) -> T:
        raw = await request.body()
        if self._fast is not None:
            body = self._fast(raw)
            if body is not None:
                return body
        try:
            return self._dec.decode(raw)
        except msgspec.ValidationError as exc:
            message, field = _field(str(exc))
            raise ApiError(422, f"{field}: {message}" if field else message, field) from None
        except msgspec.DecodeError:
            raise ApiError(422, "request body is not valid JSON", None) from None
        except UnicodeDecodeError:  # msgspec's error for invalid UTF-8 in a key
            raise ApiError(422, "request body is not valid UTF-8", None) from None


def _fast_lookup(raw: bytes) -> LookupBody | None:
    """``{"token_ids": [...], "model"?, "lora_name"?}`` with the ids read straight into
    an int64 array (``_fastbody``), which the index reads in place."""
    got = lookup_body(raw)
    if got is None:
        return None
    ids, model, lora = got
    return LookupBody(token_ids=ids, model=model, lora_name=lora)  # type: ignore[arg-type]


decode_lookup = BodyDecoder(LookupBody, _fast_lookup)


decode_route = BodyDecoder(RouteBody)

_BODIES: tuple[type, ...] = (LookupBody, RouteBody)
_REF = "#/components/schemas/{name}"


def body_doc(type_: type) -> dict[str, Any]:
    """``openapi_extra`` of a route whose body is ``type_`` (decoded with msgspec)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(name=type_.__name__)}}}}}


def install_body_schemas(app: FastAPI) -> None:
    """Add the Structs' JSON schemas to the app's OpenAPI components (once, lazily)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, components = msgspec.json.schema_components(_BODIES, ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
