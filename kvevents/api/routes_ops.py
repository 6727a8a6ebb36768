"""Operations: ``/healthz``, ``/metrics``, ``/v1/events`` (SSE) and the live page ``/``."""

from __future__ import annotations

import asyncio
import time
from importlib import resources

from starlette.concurrency import run_in_threadpool
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvevents.service.aggregator import Aggregator
from kvevents.api.routes_engines import get_aggregator
from kvevents.service.feed import parse_last_event_id, to_json

router = APIRouter(tags=["operations"])

# How often the SSE stream looks for new items, and how often it sends a summary.
_SSE_TICK_S = 0.25
_SSE_SUMMARY_S = 1.0


@router.get("/healthz", summary="Liveness: 503 when ingest is not running or stuck",
            responses={503: {"description": "ingest is not running or stuck (body says why)"}})
def healthz(agg: Aggregator = Depends(get_aggregator)) -> JSONResponse:
    engines, live = agg.engine_counts()  # never waits on the index lock
    ingest = agg.ingest_health()
    body = {"status": "ok" if ingest["ok"] else "unhealthy", "engines": engines, "live": live,
            "uptime_seconds": round(time.time() - agg.started_at, 3), "ingest": ingest,
            "snapshots": agg.snapshot_stats}
    if not ingest["ok"]:
        body["error"] = ingest["reason"]
    return JSONResponse(body, status_code=200 if ingest["ok"] else 503)


@router.get("/readyz", summary="Readiness: 200 once discovery has found the fleet and every "
                                "engine finished its initial replay",
            responses={503: {"description": "engines still replaying their history, or a "
                                            "discovery source's first round not done"}})
def readyz(request: Request, agg: Aggregator = Depends(get_aggregator)) -> JSONResponse:
    ready = agg.readiness()
    ingest = agg.ingest_health()
    discovery = request.app.state.discovery.readiness()
    ok = ready["ready"] and ingest["ok"] and discovery["ready"]
    body = {"status": "ready" if ok else "not ready", "waiting": ready["waiting"][:100],
            "waiting_count": len(ready["waiting"]), "given_up": ready["given_up"][:100],
            "given_up_count": len(ready["given_up"]),
            "waiting_sources": discovery["waiting_sources"]}
    if not ingest["ok"]:
        body["error"] = ingest["reason"]
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v1/discovery", summary="Discovery sources: what each watches, its last round, "
                                     "the engines it lists and those leaving")
def discovery(request: Request) -> dict:
    disc = request.app.state.discovery
    return {"sources": disc.status(), "grace_s": disc.grace_s,
            "reconcile_errors": disc.reconcile_errors, "added": disc.added,
            "removed": disc.removed, "sources_given_up": disc.sources_given_up}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(agg: Aggregator = Depends(get_aggregator)) -> Response:
    return Response(generate_latest(agg.registry), media_type=CONTENT_TYPE_LATEST)


def summary(agg: Aggregator) -> dict:
    """The fleet at a glance, for the live page."""
    counters = agg.index.counters()
    return {"ts": time.time(), "engines": agg.engine_statuses(),
            "index": {"entries": counters.resident_entries,
                      "distinct_blocks": counters.distinct_blocks},
            "lookups": {**agg.metrics.totals, "tier_tokens": dict(agg.metrics.tier_totals)},
            "feed_id": agg.feed.last_id}


def _sse(event_id: int | None, kind: str, data: dict) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {to_json(data)}\n\n"


@router.get("/v1/events", summary="Server-sent events of what the index applies",
            response_class=StreamingResponse)
async def events(
    request: Request,
    max_seconds: float | None = Query(None, gt=0, le=86400,
                                      description="Close the stream after this long."),
    agg: Aggregator = Depends(get_aggregator),
) -> StreamingResponse:
    start = parse_last_event_id(request.headers.get("last-event-id"), agg.feed.last_id)

    async def stream():
        cursor = start
        next_summary = 0.0
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        yield "retry: 2000\n\n"
        while not await request.is_disconnected():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            items, missed = agg.feed.since(cursor)
            if missed:
                yield _sse(None, "missed", {"count": missed})
            for item_id, kind, data in items:
                yield _sse(item_id, kind, data)
                cursor = item_id
            if now >= next_summary:
                # (off the loop: it reads the index under its lock)
                yield _sse(None, "summary", await run_in_threadpool(summary, agg))
                next_summary = now + _SSE_SUMMARY_S
            await asyncio.sleep(_SSE_TICK_S)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def page() -> HTMLResponse:
    html = resources.files("kvevents").joinpath("static/index.html").read_text()
    return HTMLResponse(html)
