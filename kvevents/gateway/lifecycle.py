"""One request's state in the gateway, from its slot to its count: :class:`Call`, and
each send's share of an engine's load: :class:`Load`.

:meth:`Gateway.handle <kvevents.gateway.proxy.Gateway.handle>` reads as the request's
life, top to bottom (parse -> targets -> identity and tokens -> choose -> send with
retry -> answer); what one step hands the next is a field of its :class:`Call`, and
what must be given back is given back by the call, in one place:

* the **slot** (``max_inflight``): taken when the call is made, before its body is read;
* the **load** of the send in progress (:class:`Load`: the prompt tokens the engine has
  yet to compute, the prompt in flight, the per-engine in-flight gauge), joined when the
  request is on its way and left when a try fails (a retry makes a new one) or the call
  ends;
* the **engine's answer** (its connection), closed when the call ends;
* the **count**: one ``kvevents_gateway_requests_total`` sample per request, with its
  latency and its (reported, predicted) cached tokens.

:meth:`Call.end` does all four, once: a second call does nothing. Who calls it: the
answer that owns the call once the handler returned it (a streamed answer's
:class:`~.relay.Relay` at its last byte, a whole answer's
:class:`~.answers.WholeAnswer` once written), else the handler itself (every refusal,
and any exception). A call dropped without an end (its answer never sent: the request's
task cancelled in between) is ended by its finaliser as a 499, on the loop.

The event loop's thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvevents.gateway.endpoints import Endpoint
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.inflight import InflightPrompts
from kvevents.gateway.load import EngineLoads
from kvevents.gateway.memory import MemoryTrim
from kvevents.gateway.metrics import GatewayMetrics
from kvevents.gateway.prompt import OpenAIRequest
from kvevents.gateway.upstream import UpstreamResponse
from kvevents.routing import RouteDecision
from kvevents.text.prompt import InputError

__all__ = ["Call", "Load"]

log = logging.getLogger(__name__)


class Gateway(Protocol):
    """What a call uses of :class:`~kvevents.gateway.proxy.Gateway` (named here, not
    imported: the gateway imports this module)."""

    inflight: int
    trim: MemoryTrim
    loads: EngineLoads
    flights: InflightPrompts
    metrics: GatewayMetrics
    aggregator: Any


class Load:
    """One send's share of ``engine``'s load: ``tokens`` prompt tokens to compute and the
    prompt (``arr``, under the digest ``ident``) in flight there. :meth:`join` when the
    request is on its way (``UpstreamPool.send``'s ``on_way``; it also publishes the
    feed's ``route`` item, after this turn of the loop), :meth:`leave` once it ended;
    either again does nothing."""

    __slots__ = ("gw", "engine", "tokens", "arr", "ident", "route", "handle", "joined")

    def __init__(self, gw: Gateway, engine: str, tokens: int, arr: np.ndarray | None, ident: bytes,
                 route: dict | None) -> None:
        self.gw = gw
        self.engine = engine
        self.tokens = tokens
        self.arr = arr
        self.ident = ident
        self.route = route  # the feed's route item (None: none published)
        self.handle: tuple | None = None
        self.joined = False

    def join(self) -> None:
        if self.joined:
            return
        gw = self.gw
        self.joined = True
        gw.loads.started(self.engine, self.tokens)
        if self.arr is not None:
            self.handle = gw.flights.add(self.engine, self.arr, self.ident)
        gw.metrics.of(gw.metrics.inflight, self.engine).inc()
        if self.route is not None:
            asyncio.get_running_loop().call_soon(_announce, gw, self.route)

    def leave(self) -> None:
        if not self.joined:
            return
        gw = self.gw
        self.joined = False
        gw.loads.finished(self.engine, self.tokens)
        if self.handle is not None:
            gw.flights.remove(self.handle)
            self.handle = None
        gw.metrics.of(gw.metrics.inflight, self.engine).dec()


def _announce(gw: Gateway, route: dict) -> None:
    log.debug("route %s -> %s: %s", route["model"], route["engine"], route["reason"])
    gw.aggregator.feed.publish("route", route)


class Call:
    """One request's state (see the module docstring). Made by the gateway once the
    request is admitted (the slot is taken here); the handler fills its fields step by
    step: ``req`` (the parsed body), ``model``, ``ids`` / ``arr`` (the prompt's token ids,
    None: routed by load), ``identity`` (the index's model, adapter, salt, the three's
    digest, media items), ``session``, ``headers`` (those forwarded), then per try ``engine``,
    ``load``, ``predicted`` and ``upstream``, and ``hop`` (a disaggregated request's
    prefill hop)."""

    __slots__ = ("gw", "request", "row", "t0", "req", "model", "ids", "arr", "identity",
                 "session", "headers", "engine", "load", "predicted", "upstream", "hop", "_open")

    def __init__(self, gw: Gateway, request: Request, row: Endpoint, t0: float) -> None:
        self.gw = gw
        self.request = request
        self.row = row
        self.t0 = t0
        self.req: OpenAIRequest | None = None
        self.model: str | None = None
        self.ids: Sequence[int] | None = None
        self.arr: np.ndarray | None = None
        self.identity: tuple = (None, None, None, b"", ())
        self.session: str | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.engine: str | None = None  # the engine of the try in progress (None: none)
        self.load: Load | None = None
        self.predicted = 0  # the cached tokens the engine should report
        self.upstream: UpstreamResponse | None = None
        self.hop: Any = None  # (a disagg.Hop)
        self._open = True
        gw.inflight += 1
        gw.trim.started(gw.inflight)

    def load_on(self, engine: str, decision: RouteDecision, predicted: int, announce: bool = True) -> Load:
        """A new :class:`Load` for a send of this call's prompt to ``engine`` (not joined
        yet); ``announce``: publish the feed's route item once it joins."""
        n = len(self.ids) if self.ids else 0
        route = {"engine": engine, "model": self.model, "prompt_tokens": n or None,
                 "matched_tokens": decision.matched_tokens, "reason": decision.reason,
                 "session": self.session} if announce else None
        # (identity[3]: its digest, which keys the prompt in flight)
        return Load(self.gw, engine, max(0, n - predicted), self.arr, self.identity[3], route)

    def retry(self) -> None:
        """The try in progress failed before its first byte: its load and answer go."""
        if self.load is not None:
            self.load.leave()
        if self.upstream is not None:
            self.upstream.close()
        self.engine, self.load, self.upstream = None, None, None

    def end(self, status: int, cached: int | None = None) -> None:
        """The request's end (see the module docstring): the engine's answer closed, the
        load and the slot given back, and one count: on the engine of the try in
        progress (``cached``: the cached tokens its answer reported), else as answered
        by the gateway itself. Once; later calls do nothing."""
        if not self._open:
            return
        self._open = False
        gw = self.gw
        if self.upstream is not None:
            self.upstream.close()
        if self.load is not None:
            self.load.leave()
        gw.inflight -= 1
        gw.trim.ended()
        model = self.model if self.model is not None else (self.req.model if self.req else None)
        if self.engine is None:
            gw.metrics.refused(model, status)
            return
        usage = None if cached is None else (cached, self.predicted)
        gw.metrics.answered(self.engine, model, status, time.perf_counter() - self.t0, usage)
        if usage is not None:
            gw.loads.of(self.engine).count_cached(*usage)

    def fail(self, exc: OpenAIError | InputError) -> Response:
        """End the call with ``exc``'s status and return its answer, in OpenAI's shape
        (an :class:`InputError` of the prompt's limits says the same)."""
        err = exc if isinstance(exc, OpenAIError) else OpenAIError(
            exc.status, exc.message, exc.field, headers=exc.headers)
        self.end(err.status)
        return err.response()

    def __del__(self) -> None:
        # Never ended (its answer dropped unsent): end it on the loop, not inside a
        # finaliser (the metrics take locks a finaliser may interrupt).
        if self._open:
            try:
                asyncio.get_running_loop().call_soon(self.end, 499)
            except RuntimeError:  # no loop any more: at least close the engine's answer
                if self.upstream is not None:
                    self.upstream.close()
