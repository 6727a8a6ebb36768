"""``/v1/engines``: which publishers the aggregator follows, and changing that at run time.

The same handlers also answer at the old paths ``/v1/pods...`` (engines were called pods
before), marked deprecated in the OpenAPI document; they answer with the new names.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvevents.service.aggregator import Aggregator, EngineBudgetError, EngineExistsError
from kvevents.api.auth import require_token
from kvevents.api.errors import ApiError
from kvevents.api.models import ERRORS, EngineBlocksResponse, EngineCreate, EnginesResponse
from kvevents.service.settings import EngineSpec

router = APIRouter(prefix="/v1/engines", tags=["engines"])
legacy_router = APIRouter(prefix="/v1/pods", tags=["engines"], deprecated=True)


async def get_aggregator(request: Request) -> Aggregator:
    return request.app.state.aggregator


def list_engines(agg: Aggregator = Depends(get_aggregator)) -> dict:
    return {"engines": agg.engine_statuses()}


def add_engine(body: EngineCreate, agg: Aggregator = Depends(get_aggregator)) -> dict:
    try:
        spec = EngineSpec(name=body.name, endpoint=body.endpoint,
                          replay_endpoint=body.replay_endpoint, model=body.model, topic=body.topic)
    except ValueError as exc:
        raise ApiError(422, str(exc), getattr(exc, "field", "endpoint")) from None
    try:
        agg.add_engine(spec)
    except EngineExistsError as exc:
        raise ApiError(409, str(exc), "name") from None
    except EngineBudgetError as exc:  # out of sockets/files for another engine
        raise ApiError(409, str(exc), "name") from None
    return {"name": spec.name, "endpoint": spec.endpoint, "replay_endpoint": spec.replay_endpoint,
            "model": spec.model, "topic": spec.topic}


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


for _r in (router, legacy_router):
    _r.add_api_route("", list_engines, methods=["GET"], response_model=EnginesResponse,
                     summary="Every publisher and its state")
    _r.add_api_route("", add_engine, methods=["POST"], status_code=201, responses=ERRORS,
                     dependencies=[Depends(require_token)], summary="Subscribe to a publisher")
    _r.add_api_route("/{name}", delete_engine, methods=["DELETE"], status_code=204,
                     responses=ERRORS, dependencies=[Depends(require_token)],
                     summary="Unsubscribe from a publisher and drop its state")
    _r.add_api_route("/{name}/blocks", engine_blocks, methods=["GET"],
                     response_model=EngineBlocksResponse, responses=ERRORS,
                     summary="What an engine holds: its resident engine block hashes per tier")
del _r
