"""The aggregator's HTTP API (FastAPI): routers per feature, state on ``app.state``.

``create_app(settings)`` builds the app; its lifespan creates the
:class:`~kvevents.service.aggregator.Aggregator`, starts it, and stops it on shutdown;
``app.state.routing`` is the :class:`~kvevents.routing.Router` over it. Handlers are
thin: they decode, call the service or the router, and encode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from starlette.routing import Route

from kvevents import __version__
from kvevents.api import (routes_engines, routes_openai, routes_ops, routes_query, routes_route,
                          routes_snapshot)
from kvevents.api.body import install_body_schemas
from kvevents.api.errors import install_error_handlers
from kvevents.api.limits import BodySizeLimit
from kvevents.discovery import Discovery, build_sources
from kvevents.gateway import Gateway, GatewayMetrics
from kvevents.gateway.endpoints import PATHS as OPENAI_PATHS
from kvevents.routing import KVAwarePolicy, KVRouterConfig, Router
from kvevents.service.aggregator import Aggregator
from kvevents.service.metrics.labels import ModelLabels
from kvevents.service.settings import AggregatorSettings
from kvevents.text import TokenizerRegistry


def create_app(
    settings: AggregatorSettings | None = None,
    registry: CollectorRegistry | None = None,
    aggregator: Aggregator | None = None,
) -> FastAPI:
    """Build the app. Pass ``aggregator`` to serve one you own (it is then neither
    started nor stopped by the app)."""
    settings = settings or (aggregator.settings if aggregator else AggregatorSettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = aggregator is None
        agg = Aggregator(settings, registry) if own else aggregator
        if own:
            agg.start()
        app.state.aggregator = agg
        # Engines found by DNS / Kubernetes (none configured: no threads at all).
        app.state.discovery = Discovery(agg, sources, grace_s=settings.discover_grace_s,
                                        first_round_timeout_s=settings.recovery_timeout_s)
        app.state.discovery.start()
        app.state.routing = Router(agg, KVAwarePolicy(KVRouterConfig(
            load_weight=settings.route_load_weight, max_imbalance=settings.route_max_imbalance,
            affinity_weight=settings.route_affinity_weight,
            balance_weight=settings.route_balance_weight)))
        app.state.gateway = Gateway(
            app.state.routing, app.state.tokenizers, GatewayMetrics(agg.registry, ModelLabels(agg)),
            api_key=settings.api_key, timeout_s=settings.request_timeout_s,
            max_inflight=settings.max_inflight, poll_interval_s=settings.engine_poll_interval_s,
            busy_poll_interval_s=settings.engine_poll_busy_interval_s,
            max_prompt_tokens=settings.max_prompt_tokens, max_prompt_chars=settings.max_prompt_chars,
            token_parity_sample_rate=settings.token_parity_sample_rate,
            token_parity_threshold=settings.token_parity_threshold,
            pd_skip_cached_share=settings.pd_skip_cached_share,
            pd_skip_uncached_tokens=settings.pd_skip_uncached_tokens)
        await app.state.gateway.start()
        try:
            yield
        finally:
            await app.state.gateway.stop()
            app.state.discovery.stop()
            if own:
                agg.stop()

    app = FastAPI(
        title="kvevents aggregator",
        version=__version__,
        description="Which KV cache prefixes live on which engine and tier, from vLLM-compatible "
                    "KV events.",
        lifespan=lifespan,
    )
    app.state.settings = settings  # read by the server's protocol (connection limits)
    install_error_handlers(app)
    install_body_schemas(app)
    # Built now, not in the lifespan: a bad value or a missing extra stops startup
    # with one clear line (the sources start in the lifespan).
    sources = build_sources(settings)
    # Loaded now, not in the lifespan: a bad tokenizer path stops startup with its name.
    app.state.tokenizers = TokenizerRegistry.load(settings.tokenizers)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       openai_paths=OPENAI_PATHS)
    app.include_router(routes_ops.router)
    app.include_router(routes_engines.router)
    app.include_router(routes_engines.legacy_router)
    app.include_router(routes_query.router)
    app.include_router(routes_route.router)
    app.include_router(routes_snapshot.router)
    app.include_router(routes_openai.router)
    serve_lean(app, HOT_PATHS)
    return app


#: The endpoints routers and OpenAI clients call per request.
HOT_PATHS = ("/v1/lookup", "/v1/route", *OPENAI_PATHS)


def api_routes(routes: list) -> Iterator[APIRoute]:
    """Every ``APIRoute`` of a route list, those of included routers too: FastAPI 0.165
    keeps an included router as one entry (its ``original_router``) where earlier
    releases copied its routes into the app's list. (The app includes its routers
    without a prefix of their own, so each route's path is the served path.)"""
    for r in routes:
        if isinstance(r, APIRoute):
            yield r
        elif (inner := getattr(r, "original_router", None)) is not None:
            yield from api_routes(inner.routes)


def serve_lean(app: FastAPI, paths: tuple[str, ...]) -> None:
    """Serve the handlers of ``paths`` through Starlette's ``request_response``, first
    in the route list.

    Why: they take only the ``Request`` and return a ``Response``, so FastAPI's
    per-request dependency solving around them (query parsing, an exit stack: about
    60 us a lookup here, a sixth of the event loop's time per request) does nothing
    for them, and route matching walks the list in order. Each gets a plain Starlette
    ``Route`` in front, left out of the schema; the error handlers still apply
    (``request_response`` routes exceptions to them), and the ``APIRoute`` stays where it
    was, so OpenAPI is unchanged. A route with dependencies (an auth guard, say) is left
    as it is: skipping them would skip the guard."""
    hot = [r for r in api_routes(app.router.routes) if r.path in paths and not r.dependant.dependencies]
    app.router.routes[:0] = [Route(r.path, r.endpoint, methods=sorted(r.methods), name=r.name,
                                   include_in_schema=False) for r in hot]
