"""``POST /v1/route``: pick the engine for a prompt (a thin handler over
:class:`kvevents.routing.Router`)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request, Response

from kvevents.api.body import RouteBody, body_doc, decode_route
from kvevents.api.media_prompt import body_prompt
from kvevents.api.models import PROMPT_ERRORS, RouteResponse
from kvevents.api.routes_query import json_response
from kvevents.routing import EngineLoad, Router

router = APIRouter(prefix="/v1", tags=["routing"])


def requested_candidates(body: RouteBody) -> list[tuple[str, EngineLoad]] | None:
    if body.candidates is None:
        return None
    return [(c.engine, EngineLoad(c.load.waiting, c.load.running, c.load.kv_usage) if c.load
             else EngineLoad()) for c in body.candidates]


@router.post("/route", response_model=RouteResponse, responses=PROMPT_ERRORS,
             openapi_extra=body_doc(RouteBody),
             summary="Choose the engine for a prompt: longest cached prefix per tier vs load")
async def route(request: Request) -> Response:
    # No ``Depends``, as in /v1/lookup (routes_query.py): the per-request cost matters.
    body = await decode_route(request)
    routing: Router = request.app.state.routing
    settings = routing.aggregator.settings
    token_ids, media = await body_prompt(request.app.state, body, settings.max_prompt_tokens,
                                         settings.max_prompt_chars)
    decision = await routing.decide(token_ids, body.model, body.lora_name,
                                    requested_candidates(body), cache_salt=body.cache_salt, media=media)
    return json_response({
        "engine": decision.engine, "pod": decision.engine,  # "pod": 0.1.0's name, until 0.3.0
        "matched_tokens": decision.matched_tokens, "tiers": decision.tiers,
        "scores": [dataclasses.asdict(s) for s in decision.scores], "reason": decision.reason,
    })
