"""``GET /v1/snapshot``: this aggregator's current snapshot, for ``--bootstrap-from``.

The body is the same checksummed file format as the data dir's (``kvevents.service.snapshot``);
a fresh replica loads it and then follows the publishers itself. Guarded by the bearer
token when one is set: it holds the whole index.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from kvevents.service.aggregator import Aggregator
from kvevents.api.auth import require_token
from kvevents.api.models import ERRORS
from kvevents.api.routes_engines import get_aggregator

router = APIRouter(prefix="/v1", tags=["operations"])


# def: capturing copies the index under the apply lock; keep it off the event loop.
@router.get("/snapshot", responses=ERRORS, dependencies=[Depends(require_token)],
            response_class=Response,
            summary="The index and each engine's stream position, for bootstrapping a replica")
def get_snapshot(agg: Aggregator = Depends(get_aggregator)) -> Response:
    return Response(agg.capture_snapshot(), media_type="application/octet-stream")
