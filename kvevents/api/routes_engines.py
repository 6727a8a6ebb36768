"""``/v1/engines``: which publishers the aggregator follows, and changing that at run time.

The same handlers also answer at the old paths ``/v1/pods...`` (engines were called pods
before), marked deprecated in the OpenAPI document; there the answers carry 0.1.0's keys
(``pods``, ``pod``) beside the new ones, until 0.3.0.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvevents.api.auth import require_token
from kvevents.api.errors import ApiError
from kvevents.api.models import (ERRORS, EngineBlocksResponse, EngineCreate, EnginesResponse,
                                 PodBlocksResponse, PodsResponse)
from kvevents.engines import EngineBudgetError, EngineExistsError, EngineSpec
from kvevents.gateway.load import TargetLoad
from kvevents.service.aggregator import Aggregator

router = APIRouter(prefix="/v1/engines", tags=["engines"])
legacy_router = APIRouter(prefix="/v1/pods", tags=["engines"], deprecated=True)


async def get_aggregator(request: Request) -> Aggregator:
    return request.app.state.aggregator


def list_engines(request: Request, agg: Aggregator = Depends(get_aggregator)) -> dict:
    return {"engines": with_gateway(request, agg.engine_statuses())}


def with_gateway(request: Request, engines: list[dict]) -> list[dict]:
    """Each engine with an OpenAI server also shows what the gateway knows of it: whether
    it answers, its requests in flight from this gateway, and the engine's own load."""
    gateway = getattr(request.app.state, "gateway", None)
    for entry in engines:
        if gateway is not None and entry.get("http"):
            # Read only: this handler runs on a worker thread, and the load table belongs
            # to the event loop (``of`` would insert a missing engine).
            t = gateway.loads.targets.get(entry["name"]) or TargetLoad()
            entry["gateway"] = {"reachable": t.reachable, "inflight": t.inflight,
                                "others_load": t.others, "kv_usage": t.kv_usage,
                                "last_error": t.last_error,
                                "predicted_cached_tokens": t.predicted_cached,
                                "reported_cached_tokens": t.reported_cached,
                                "usage_reports": t.usage_reports,
                                # (its model's: the gateway's ids against the engines')
                                "token_parity": gateway.parity.state(entry.get("model"))}
    return engines


def add_engine(body: EngineCreate, agg: Aggregator = Depends(get_aggregator)) -> dict:
    try:
        spec = EngineSpec(name=body.name, endpoint=body.endpoint,
                          replay_endpoint=body.replay_endpoint, model=body.model, topic=body.topic,
                          http=body.http, dp_rank=body.dp_rank, role=body.role)
    except ValueError as exc:
        raise ApiError(422, str(exc), getattr(exc, "field", "endpoint")) from None
    try:
        agg.add_engine(spec, origin="api")
    except EngineExistsError as exc:
        raise ApiError(409, str(exc), "name") from None
    except EngineBudgetError as exc:  # out of sockets/files for another engine
        raise ApiError(409, str(exc), "name") from None
    return {"name": spec.name, "endpoint": spec.endpoint, "replay_endpoint": spec.replay_endpoint,
            "model": spec.model, "topic": spec.topic, "http": spec.http, "dp_rank": spec.dp_rank,
            "role": spec.role}


def delete_engine(name: str, agg: Aggregator = Depends(get_aggregator)) -> Response:
    try:
        agg.remove_engine(name)
    except KeyError:
        raise ApiError(404, f"unknown engine {name!r}", "name") from None
    return Response(status_code=204)


def engine_blocks(name: str, agg: Aggregator = Depends(get_aggregator)) -> dict:
    if name not in {spec.name for spec in agg.engine_specs()}:
        raise ApiError(404, f"unknown engine {name!r}", "name")
    tiers = agg.index.engine_hashes(name)
    # JSON-safe: uint64 hashes stay numbers, digest bytes become hex strings.
    return {"engine": name, "tiers": {
        tier: sorted((h if isinstance(h, int) else h.hex() for h in hashes),
                     key=lambda x: (isinstance(x, str), x))
        for tier, hashes in tiers.items()}}


def list_engines_legacy(request: Request, agg: Aggregator = Depends(get_aggregator)) -> dict:
    engines = with_gateway(request, agg.engine_statuses())
    return {"engines": engines, "pods": engines}


def engine_blocks_legacy(name: str, agg: Aggregator = Depends(get_aggregator)) -> dict:
    return {**engine_blocks(name, agg), "pod": name}


for _r, _list, _blocks, _lmodel, _bmodel in (
        (router, list_engines, engine_blocks, EnginesResponse, EngineBlocksResponse),
        (legacy_router, list_engines_legacy, engine_blocks_legacy, PodsResponse, PodBlocksResponse)):
    _r.add_api_route("", _list, methods=["GET"], response_model=_lmodel,
                     summary="Every publisher and its state")
    _r.add_api_route("", add_engine, methods=["POST"], status_code=201, responses=ERRORS,
                     dependencies=[Depends(require_token)], summary="Subscribe to a publisher")
    _r.add_api_route("/{name}", delete_engine, methods=["DELETE"], status_code=204,
                     responses=ERRORS, dependencies=[Depends(require_token)],
                     summary="Unsubscribe from a publisher and drop its state")
    _r.add_api_route("/{name}/blocks", _blocks, methods=["GET"],
                     response_model=_bmodel, responses=ERRORS,
                     summary="What an engine holds: its resident engine block hashes per tier")
del _r, _list, _blocks, _lmodel, _bmodel
