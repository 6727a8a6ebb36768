"""The OpenAI endpoints the gateway serves: one row per path.

Everything that differs between endpoints is a field of its row (:class:`Endpoint`),
and everything that lists the endpoints reads :data:`ENDPOINTS`: the paths the gateway
forwards to (``Gateway._send``), the server protocol's path table
(:mod:`kvevents.api.server_protocol`), the app's routes
(:mod:`kvevents.api.routes_openai`), its hot paths and the paths whose 413 is
OpenAI-shaped (:mod:`kvevents.api`), and a streamed answer's end marker
(:mod:`.relay`). ``GET /v1/models`` is not a row: it is answered by the gateway
itself, merged across the engines (:mod:`.catalog`).

Adding an endpoint is one row here, its body parser (a function of the body's bytes to
an :class:`~.prompt.OpenAIRequest`, raising a 400 :class:`~.errors.OpenAIError` that
names the field) and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvevents.gateway.answers import DONE
from kvevents.gateway.prompt import (CHAT, COMPLETIONS, DETOKENIZE, EMBEDDINGS, RESPONSES, TOKENIZE,
                                     OpenAIRequest, parse_passthrough, parse_request)
from kvevents.gateway.responses import parse_responses

#: A Responses stream's end: its last event's data, whose ``type`` vLLM writes last.
RESPONSE_END = (b'"type":"response.completed"}', b'"type":"response.incomplete"}',
                b'"type":"response.failed"}')


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI endpoint, as the gateway serves it (``POST`` with a JSON body)."""

    path: str
    kind: str  # the request's kind (OpenAIRequest.kind)
    parse: Callable[[bytes], OpenAIRequest]  # the body parser: a 400 naming the field
    prompt_field: str | None  # the field whose text is the prompt (limits' 400s); None: none
    affinity: bool  # routed by the prompt's cached prefix and load (False: by load alone)
    streams: bool  # answers a server-sent event stream when the body says "stream": true
    ends: tuple[bytes, ...]  # a whole stream's last bytes (trailing whitespace left out)
    usage: str  # where an answer reports its cached prompt tokens (empty: nowhere)
    summary: str  # the route's summary in the OpenAPI schema
    stored: bool = False  # the engine stores each answer by its id, for a follow-up naming it
    errors: str = "openai"  # the error shape: {"error": {message, type, param, code}}


ENDPOINTS: dict[str, Endpoint] = {row.kind: row for row in (
    Endpoint("/v1/chat/completions", CHAT, partial(parse_request, CHAT), "messages", True, True, DONE,
             "usage.prompt_tokens_details.cached_tokens",
             "OpenAI chat completions, routed to the engine that caches most of the prompt"),
    Endpoint("/v1/completions", COMPLETIONS, partial(parse_request, COMPLETIONS), "prompt", True, True,
             DONE, "usage.prompt_tokens_details.cached_tokens",
             "OpenAI completions, routed to the engine that caches most of the prompt"),
    Endpoint("/v1/responses", RESPONSES, parse_responses, "input", True, True, RESPONSE_END,
             "usage.input_tokens_details.cached_tokens (streamed: in response.completed)",
             "OpenAI Responses, routed to the engine that caches most of the prompt; "
             "a previous_response_id to the engine that stored it", stored=True),
    Endpoint("/v1/embeddings", EMBEDDINGS, partial(parse_passthrough, EMBEDDINGS, "input"), None,
             False, False, (), "", "OpenAI embeddings, routed by load"),
    Endpoint("/tokenize", TOKENIZE, partial(parse_passthrough, TOKENIZE, None), None, False, False,
             (), "", "vLLM's tokenizer, passed through to an engine serving the model"),
    Endpoint("/detokenize", DETOKENIZE, partial(parse_passthrough, DETOKENIZE, "tokens"), None,
             False, False, (), "", "vLLM's detokenizer, passed through to an engine serving the model"),
)}

#: The paths served, in the table's order.
PATHS: tuple[str, ...] = tuple(row.path for row in ENDPOINTS.values())
#: Each path's row.
BY_PATH: dict[str, Endpoint] = {row.path: row for row in ENDPOINTS.values()}
