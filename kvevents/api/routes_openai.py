"""The OpenAI-compatible endpoints: thin handlers over :class:`kvevents.gateway.Gateway`.

One ``POST`` route per row of :data:`kvevents.gateway.endpoints.ENDPOINTS` (chat
completions, completions and responses, streamed or not, routed by the prompt's cached
prefix; embeddings, ``/tokenize`` and ``/detokenize`` by load), each forwarded to the
engine the gateway picks, its bytes unchanged; ``GET /v1/models`` lists what the engines
serve; ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the engine
that stored the response. Errors are in OpenAI's shape (``{"error": {...}}``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response

from kvevents.gateway import Gateway
from kvevents.gateway.endpoints import ENDPOINTS

router = APIRouter(tags=["openai"])

_OPENAI_ERRORS = {code: {"description": what} for code, what in (
    (400, "Bad body (OpenAI error shape; param names the field)"), (401, "Missing or wrong API key"),
    (404, "No engine serves the model (or has the previous response)"), (413, "Body too large"),
    (502, "Every engine tried failed before answering"),
    (503, "No engine reachable, or too many requests in flight (Retry-After)"))}


def _handler(kind: str) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        return await gateway.handle(request, kind)
    handle.__name__ = handle.__qualname__ = f"openai_{kind}"
    return handle


def _body_schema(prompt_field: str | None) -> dict:
    """The request body in the OpenAPI schema: a JSON object with the fields the gateway
    reads (the rest is the engine's)."""
    schema: dict = {"type": "object", "additionalProperties": True,
                    "properties": {"model": {"type": "string"}, "stream": {"type": "boolean"}}}
    if prompt_field is not None:
        schema["properties"][prompt_field] = {"description": "The prompt."}
        schema["required"] = [prompt_field]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


for _row in ENDPOINTS.values():
    router.add_api_route(_row.path, _handler(_row.kind), methods=["POST"], responses=_OPENAI_ERRORS,
                         summary=_row.summary, name=f"openai_{_row.kind}",
                         openapi_extra=_body_schema(_row.prompt_field))


@router.get("/v1/responses/{response_id}", responses=_OPENAI_ERRORS,
            summary="A stored response, from the engine that stored it (query: stream, starting_after)")
async def retrieve_response(request: Request, response_id: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    return await gateway.stored_response(request, response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=_OPENAI_ERRORS,
             summary="Cancel a background response, on the engine that runs it")
async def cancel_response(request: Request, response_id: str) -> Response:
    gateway: Gateway = request.app.state.gateway
    return await gateway.stored_response(request, response_id, "cancel")


@router.get("/v1/models", responses=_OPENAI_ERRORS, summary="The models the engines serve")
async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return await gateway.models(request)
