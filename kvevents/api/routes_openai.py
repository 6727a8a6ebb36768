"""The OpenAI-compatible endpoints: thin handlers over :class:`kvevents.gateway.Gateway`.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed or not) are
forwarded to the engine the gateway picks, their bytes unchanged; ``GET /v1/models``
lists what the engines serve. Errors are in OpenAI's shape (``{"error": {...}}``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kvevents.gateway import Gateway
from kvevents.gateway.prompt import CHAT, COMPLETIONS

router = APIRouter(tags=["openai"])

_OPENAI_ERRORS = {code: {"description": what} for code, what in (
    (400, "Bad body (OpenAI error shape; param names the field)"), (401, "Missing or wrong API key"),
    (404, "No engine serves the model"), (413, "Body too large"),
    (502, "Every engine tried failed before answering"),
    (503, "No engine reachable, or too many requests in flight (Retry-After)"))}


@router.post("/v1/chat/completions", responses=_OPENAI_ERRORS,
             summary="OpenAI chat completions, routed to the engine that caches most of the prompt")
async def chat_completions(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return await gateway.handle(request, CHAT)


@router.post("/v1/completions", responses=_OPENAI_ERRORS,
             summary="OpenAI completions, routed to the engine that caches most of the prompt")
async def completions(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return await gateway.handle(request, COMPLETIONS)


@router.get("/v1/models", responses=_OPENAI_ERRORS, summary="The models the engines serve")
async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return await gateway.models(request)
