"""The OpenAI Responses API (``POST /v1/responses``) as vLLM 0.32 serves it: its body
read as the chat vLLM renders from it, and the engine that stored each response.

**The prompt.** vLLM builds chat messages from ``instructions`` and ``input``
(``construct_input_messages`` in ``vllm/entrypoints/openai/responses/utils.py``) and
renders them with the model's chat template, as a chat completion's: ``instructions``
is a system message; a string ``input`` a user message; a list's items each a message
(``input_text``/``output_text`` parts are text parts; an assistant item's text is its
first part's), a ``function_call`` a tool call joined to the assistant message before
it, a ``function_call_output`` a tool message. The last item an assistant's message
``in_progress`` or ``incomplete``: the final message is continued, without a generation
prompt. Unlike a chat completion's, the rendered text is tokenized with the tokenizer's
special tokens (``add_special_tokens`` true: a Llama tokenizer's BOS is added). :func:`parse_responses` builds the same messages, so the gateway's own
tokenizer (or an engine's ``/tokenize``) gives the ids the engine computes, and the
request is routed by its cached prefix like a chat. What it does not render here
(``tools``, reasoning items, media) is routed by load alone.

**Stored responses.** With ``VLLM_ENABLE_RESPONSES_API_STORE=1`` an engine keeps each
response it answered, in its own memory; a follow-up naming it
(``previous_response_id``) can only be answered there. :class:`ResponseHomes`
remembers which engine answered each response id (a non-streamed answer's ``id``, a
stream's ``response.created`` event's ``response.id``), least recently used forgotten
first, and sends a follow-up there; that engine gone from the fleet, the answer is the
404 vLLM gives for a response it does not have, saying why. An id the gateway never saw
(answered before a restart, or through another gateway) is routed as any request.

**Retrieve and cancel.** ``GET /v1/responses/{id}`` and ``POST
/v1/responses/{id}/cancel`` (:func:`ask_stored`) go to the engine that stored the
response; an id the gateway never saw is asked of each reachable engine in turn until
one has it (vLLM's 404 when none has). The answer is read whole, a retrieved stream
(``?stream=true``) included: a stored response is done, or its events are replayed from
``starting_after``.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import httpx
import msgspec
from starlette.responses import Response

from kvevents.engines import EngineSpec
from kvevents.gateway.answers import answer_headers
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.prompt import RESPONSES, OpenAIRequest, decode_chat
from kvevents.gateway.server_ext import while_present
from kvevents.gateway.upstream import UpstreamResponse
from kvevents.text.chat_inputs import ChatOptions

__all__ = ["ResponseHomes", "ask_stored", "parse_responses", "response_id", "stream_response_id"]

HOMES = 100_000  # response ids remembered (least recently used forgotten first)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant", "tool")


class _Reasoning(msgspec.Struct):
    effort: str | None = None


class _Body(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    cache_salt: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    reasoning: _Reasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None


_body = msgspec.json.Decoder(_Body)
_FIELDS = ("model", "stream", "cache_salt", "input", "instructions", "previous_response_id",
           "tools", "reasoning", "chat_template_kwargs")


def parse_responses(body: bytes) -> OpenAIRequest:
    """A Responses body as the gateway needs it (see the module docstring); a 400
    naming the field for one it cannot read."""
    try:
        doc = _body.decode(body)
    except msgspec.ValidationError as exc:
        field = str(exc).rpartition("$.")[2].rstrip("`").split("[")[0].split(".")[0] or None
        raise OpenAIError(400, f"invalid request: {exc}", field if field in _FIELDS else None) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise OpenAIError(400, f"request body is not a JSON object: {exc}") from None
    if doc.input is None:
        raise OpenAIError(400, "input is required: a string or an array of input items", "input")
    req = OpenAIRequest(RESPONSES, body, doc.model, bool(doc.stream), cache_salt=doc.cache_salt or None,
                        previous_response_id=doc.previous_response_id or None)
    if req.previous_response_id is not None or doc.tools:
        return req  # routed to the engine that stored it / by load: no prompt read here
    messages = _messages(doc.instructions, doc.input)
    if messages is None:
        return req
    raw = msgspec.json.encode(messages)
    req.chat, req.messages = decode_chat(raw)
    req.messages_json = raw
    req.options = _options(doc)
    req.options_json = msgspec.json.encode(req.options)
    return req


def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict] | None:
    """The chat messages vLLM builds (``construct_input_messages``), or None for an
    item this does not render."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    built: list[dict[str, Any]] = []  # (vLLM joins items to the messages built from them)
    for item in items:
        kind, role = item.get("type"), item.get("role")
        prev = built[-1] if built and built[-1].get("role") == "assistant" else None
        if kind == "function_call":
            if item.get("namespace"):
                return None
            call = {"id": item.get("call_id"), "function": {"name": item.get("name"),
                                                             "arguments": item.get("arguments")},
                    "type": "function"}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                built.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            built.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif kind not in (None, "message") or role not in _ROLES:
            return None  # reasoning, custom tools, media...: the engine's business
        elif role == "assistant":
            content = item.get("content")
            text = content if isinstance(content, str) else (
                content[0].get("text") if isinstance(content, list) and content and
                isinstance(content[0], dict) else None)
            if text is None:
                return None
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                built.append({"role": "assistant", "content": text})
        else:
            message = {k: item[k] for k in ("role", "content", "name", "tool_call_id") if k in item}
            content = message.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type", "text") in _TEXT_PARTS for p in content):
                    return None
                message["content"] = [{"type": "text", "text": p.get("text")} for p in content]
            built.append(message)
    return out + built


def _options(doc: _Body) -> ChatOptions:
    """What vLLM renders and tokenizes the messages with besides them
    (``build_chat_params``; ``build_tok_params`` leaves ``add_special_tokens`` at its
    default, true, where a chat completion's is false: the tokenizer's BOS is added)."""
    items = doc.input
    last = items[-1] if isinstance(items, list) and items else None
    continued = (isinstance(last, dict) and last.get("status") in ("in_progress", "incomplete")
                 and (last.get("type") == "reasoning" or last.get("role") == "assistant"))
    effort = doc.reasoning.effort if doc.reasoning is not None else None
    kwargs = dict(doc.chat_template_kwargs or {})
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
    return ChatOptions(chat_template_kwargs=kwargs or None, add_generation_prompt=not continued,
                       continue_final_message=continued, reasoning_effort=effort, add_special_tokens=True)


# -- which engine stored a response ------------------------------------------------------------


class _Id(msgspec.Struct):
    id: str | None = None
    object: str | None = None


class _Created(msgspec.Struct):
    response: _Id | None = None


_id_of = msgspec.json.Decoder(_Id).decode
_created_of = msgspec.json.Decoder(_Created).decode


def response_id(body: bytes) -> str | None:
    """A whole answer's response id (None: not a response object)."""
    try:
        doc = _id_of(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return doc.id if doc.object == "response" else None


def stream_response_id(head: bytes) -> str | None:
    """The response id of a stream's first event (``response.created``), from its start."""
    at = head.find(b"data:")
    end = head.find(b"\n", at)
    if at < 0 or end < 0:
        return None
    try:
        doc = _created_of(head[at + 5:end])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return doc.response.id if doc.response is not None else None


async def first_event_id(upstream: UpstreamResponse, scope: dict, receive: Any, timeout: float) -> str | None:
    """The response id of a stream's first event, once it arrived (its bytes are left for
    the relay: the stream is then relayed through Python, not pumped), or None (not in
    its first 16 KiB, no event within ``timeout``, or the client gone meanwhile)."""
    peek = asyncio.ensure_future(upstream.peek(b"\n\n", 16384))
    if await while_present(peek, scope, receive, timeout) != "done":
        return None
    return stream_response_id(peek.result())


class ResponseHomes:
    """Response id -> the engine that answered (and stored) it; least recently used
    forgotten first. The event loop's thread only."""

    def __init__(self, size: int = HOMES) -> None:
        self.size = size
        self._homes: collections.OrderedDict[str, str] = collections.OrderedDict()

    def remember(self, response: str | None, engine: str) -> None:
        if not response:
            return
        self._homes[response] = engine
        self._homes.move_to_end(response)
        while len(self._homes) > self.size:
            self._homes.popitem(last=False)

    def home(self, response: str) -> str | None:
        engine = self._homes.get(response)
        if engine is not None:
            self._homes.move_to_end(response)
        return engine

    def targets(self, req: OpenAIRequest, targets: list[EngineSpec],
                reachable: list[EngineSpec]) -> list[EngineSpec]:
        """The engines ``req`` may go to: the one that stored its previous response, when
        known (404 as vLLM's when it has left the fleet, 503 while it is unreachable);
        else ``reachable``."""
        prev = req.previous_response_id
        engine = self.home(prev) if prev else None
        if engine is None:
            return reachable
        return self.where(prev, engine, targets, reachable, "previous_response_id")

    @staticmethod
    def where(response: str, engine: str, targets: list[EngineSpec], reachable: list[EngineSpec],
              field: str) -> list[EngineSpec]:
        """``[engine]``, which stored ``response``, if reachable: 404 as vLLM's when it is
        not among ``targets`` any more, 503 while it is unreachable."""
        if not any(s.name == engine for s in targets):
            raise OpenAIError(404, f"Response with id '{response}' not found: engine {engine}, which "
                                   "stored it, no longer serves this model", field)
        there = [s for s in reachable if s.name == engine]
        if not there:
            raise OpenAIError(503, f"engine {engine}, which stored response '{response}', is not "
                                   "reachable now; retry shortly", field, headers={"Retry-After": "2"})
        return there


async def ask_stored(client: httpx.AsyncClient, homes: ResponseHomes, rid: str, method: str, path: str,
                     query: bytes, headers: list[tuple[bytes, bytes]], targets: list[EngineSpec],
                     reachable: list[EngineSpec]) -> Response:
    """A stored response's retrieve or cancel (``method`` ``path``, ``query`` string and
    ``headers`` as the client sent them) answered by the engine that stored ``rid``, else
    by the first of ``reachable`` that has it (see the module docstring); the engine's
    answer unchanged, or the error (:class:`OpenAIError`) when none could answer."""
    if not targets:  # (no engine with an OpenAI server: none can have stored it)
        raise OpenAIError(404, f"Response with id '{rid}' not found: no engine serves the Responses "
                               "API here", "response_id")
    home = homes.home(rid)
    order = reachable if home is None else homes.where(rid, home, targets, reachable, "response_id")
    if not order:
        raise OpenAIError(503, "no engine is reachable now; retry shortly", headers={"Retry-After": "2"})
    url_tail = path + ("?" + query.decode("latin-1") if query else "")
    answer, engine = None, ""
    for spec in order:
        try:
            answer = await client.request(method, spec.http + url_tail, headers=headers)
        except httpx.HTTPError as exc:
            if home is not None:
                raise OpenAIError(502, f"engine {spec.name} failed before answering: {exc}",
                                  headers={"Retry-After": "1"}) from None
            continue  # (another engine may have it)
        engine = spec.name
        if answer.status_code != 404:
            break
    if answer is None:
        raise OpenAIError(502, "every engine asked failed before answering", headers={"Retry-After": "1"})
    if answer.status_code < 400:
        homes.remember(rid, engine)
    return Response(answer.content, answer.status_code, headers=answer_headers(answer, engine))
