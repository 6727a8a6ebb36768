"""``/v1/pods``: which publishers the aggregator follows, and changing that at run time."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from kvevents.aggregator import Aggregator, PodBudgetError, PodExistsError
from kvevents.api.auth import require_token
from kvevents.api.errors import ApiError
from kvevents.api.models import ERRORS, PodBlocksResponse, PodCreate, PodsResponse
from kvevents.settings import PodSpec

router = APIRouter(prefix="/v1/pods", tags=["pods"])


async def get_aggregator(request: Request) -> Aggregator:
    return request.app.state.aggregator


@router.get("", response_model=PodsResponse, summary="Every publisher and its state")
def list_pods(agg: Aggregator = Depends(get_aggregator)) -> dict:
    return {"pods": agg.pod_statuses()}


@router.post("", status_code=201, responses=ERRORS, dependencies=[Depends(require_token)],
             summary="Subscribe to a publisher")
def add_pod(body: PodCreate, agg: Aggregator = Depends(get_aggregator)) -> dict:
    try:
        spec = PodSpec(name=body.name, endpoint=body.endpoint,
                       replay_endpoint=body.replay_endpoint, model=body.model, topic=body.topic)
    except ValueError as exc:
        raise ApiError(422, str(exc), getattr(exc, "field", "endpoint")) from None
    try:
        agg.add_pod(spec)
    except PodExistsError as exc:
        raise ApiError(409, str(exc), "name") from None
    except PodBudgetError as exc:  # out of sockets/files for another pod
        raise ApiError(409, str(exc), "name") from None
    return {"name": spec.name, "endpoint": spec.endpoint, "replay_endpoint": spec.replay_endpoint,
            "model": spec.model, "topic": spec.topic}


@router.delete("/{name}", status_code=204, responses=ERRORS,
               dependencies=[Depends(require_token)],
               summary="Unsubscribe from a publisher and drop its state")
def delete_pod(name: str, agg: Aggregator = Depends(get_aggregator)) -> Response:
    try:
        agg.remove_pod(name)
    except KeyError:
        raise ApiError(404, f"unknown pod {name!r}", "name") from None
    return Response(status_code=204)


@router.get("/{name}/blocks", response_model=PodBlocksResponse, responses=ERRORS,
            summary="What a pod holds: its resident engine block hashes per tier")
def pod_blocks(name: str, agg: Aggregator = Depends(get_aggregator)) -> dict:
    if name not in {spec.name for spec in agg.pod_specs()}:
        raise ApiError(404, f"unknown pod {name!r}", "name")
    tiers = agg.index.engine_hashes(name)
    # JSON-safe: uint64 hashes stay numbers, digest bytes become hex strings.
    return {"pod": name, "tiers": {
        tier: sorted((h if isinstance(h, int) else h.hex() for h in hashes),
                     key=lambda x: (isinstance(x, str), x))
        for tier, hashes in tiers.items()}}
