"""``POST /v1/route``: pick the engine for a prompt (KV-aware policy)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request, Response

from kvevents.service.aggregator import Aggregator
from kvevents.api import offloop
from kvevents.api.body import RouteBody, body_doc, decode_route
from kvevents.api.errors import ApiError
from kvevents.api.models import ERRORS, RouteResponse
from kvevents.api.prompt import prompt_token_ids
from kvevents.api.routes_query import json_response
from kvevents.routing.policies import Candidate, EngineLoad, without_engines

router = APIRouter(prefix="/v1", tags=["routing"])


def candidates_of(body: RouteBody, agg: Aggregator) -> list[Candidate]:
    """The request's candidates, each checked against the followed engines; by default
    every engine that is not down, with no load."""
    known = {p["name"]: p["status"] for p in agg.engine_statuses()}
    if body.candidates is None:
        engines = [name for name, status in known.items() if status != "down"] or list(known)
        if not engines:
            raise ApiError(422, "the aggregator follows no engines; pass candidates", "candidates")
        return [Candidate(p) for p in engines]
    if not body.candidates:
        raise ApiError(422, "candidates must not be empty", "candidates")
    out = []
    seen = set()
    for i, c in enumerate(body.candidates):
        if c.engine not in known:
            raise ApiError(422, f"unknown engine {c.engine!r}", f"candidates[{i}].engine")
        if c.engine in seen:
            raise ApiError(422, f"engine {c.engine!r} listed twice", f"candidates[{i}].engine")
        seen.add(c.engine)
        load = EngineLoad(c.load.waiting, c.load.running, c.load.kv_usage) if c.load else EngineLoad()
        out.append(Candidate(c.engine, load))
    return out


@router.post("/route", response_model=RouteResponse, responses=ERRORS,
             openapi_extra=body_doc(RouteBody),
             summary="Choose the engine for a prompt: longest cached prefix per tier vs load")
async def route(request: Request) -> Response:
    # No ``Depends``, as in /v1/lookup (routes_query.py): the per-request cost matters.
    body = await decode_route(request)
    agg: Aggregator = request.app.state.aggregator
    token_ids = await prompt_token_ids(body, request.app.state.tokenizers,
                                       agg.settings.max_prompt_tokens)
    candidates = candidates_of(body, agg)
    lookup = without_engines(
        await offloop.lookup(agg, token_ids, body.model, body.lora_name, "route"),
        agg.unroutable_engines())
    # Never a down engine while one that is not down is on offer.
    down = agg.down_engines()
    decision = agg.router.choose(token_ids, lookup, candidates, down=down)
    return json_response({
        "engine": decision.engine, "matched_tokens": decision.matched_tokens, "tiers": decision.tiers,
        "scores": [dataclasses.asdict(s) for s in decision.scores], "reason": decision.reason,
    })
