"""The KV-aware OpenAI gateway: each request routed by the in-process index and the
engines' load, forwarded byte for byte, streamed back, and accounted.

Per request (each endpoint of :mod:`.endpoints`: ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, and, routed by load alone, ``/v1/embeddings``,
``/tokenize``, ``/detokenize``):

1. the bearer token (``api_key``), then the concurrency bound (``max_inflight``: past
   it, 503 with ``Retry-After``): the request holds its slot from here, before its body
   is read, to its answer's last byte (a streamed answer's :class:`~.relay.Relay` gives
   it back); then the body (:mod:`.prompt`: model, stream, prompt; a client that leaves
   while sending it is a 499), and (its model known, 2.) its prompt's characters
   (``max_prompt_chars``, or fewer if the model's ``max_model_len`` cannot hold more;
   checked before tokenizing: an oversized prompt costs no tokenizer memory);
2. the targets: followed engines with an ``http`` URL serving the model (or adapter:
   :mod:`.catalog`, which also gives the prompt's identity with its ``cache_salt``),
   reachable (:mod:`.load`); none: 503 with ``Retry-After``;
3. the prompt's token ids, the stored response a Responses follow-up names (its engine:
   :mod:`.responses`), the session pin (``x-session-id``: a conversation stays on
   its engine while that engine is a target and not overloaded), else the policy's
   choice (:class:`~kvevents.routing.Router`: longest cached prefix per tier against
   load; engines whose event stream is down are chosen only when all are);
   a model with prefill engines (``role=prefill``) is disaggregated (:mod:`.disagg`):
   the choice is among its decode engines, and the prompt may first go to a prefill
   engine (the prefill hop), whose ``kv_transfer_params`` the body then carries;
4. the body sent unchanged to the engine. A refused connection, or a 5xx before the
   first byte, is sent once more to the next choice (``kvevents_gateway_retries_total``);
   after the first byte nothing is retried;
5. the answer streamed back unchanged (:mod:`.relay`). A client that goes away, at any
   moment from its body's end to the answer's last byte, closes the upstream request
   (vLLM then aborts it); so does ``timeout_s`` without an answer.

Every request ends in exactly one ``kvevents_gateway_requests_total`` sample, and the
decision is logged at debug level and published on the feed (``route``). Lifecycle:
:meth:`start` (HTTP client, load poller) in the app's lifespan, :meth:`stop` at its end.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial

import httpx
import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from kvevents.engines import EngineSpec
from kvevents.gateway.answers import (WholeAnswer, answer_headers, cached_tokens, expected_cached,
                                      stream_cached_tokens)
from kvevents.gateway.catalog import ModelCatalog, identity_digest
from kvevents.gateway.disagg import Disaggregation, Hop
from kvevents.gateway.endpoints import ENDPOINTS, Endpoint
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.headers import DROP as _DROP, DROP_KEYED as _DROP_KEYED, with_rank
from kvevents.gateway.inflight import InflightPrompts
from kvevents.gateway.load import EngineLoads
from kvevents.gateway.memory import MemoryTrim
from kvevents.gateway.metrics import GatewayMetrics
from kvevents.gateway.parity import TokenParity
from kvevents.gateway.pool import UpstreamPool, retry_reason
from kvevents.gateway.prompt import MESSAGES, OpenAIRequest, PromptTokens, prompt_chars
from kvevents.gateway.relay import Relay, read_whole
from kvevents.gateway.responses import ResponseHomes, first_event_id, response_id
from kvevents.gateway.server_ext import body_now, client_gone
from kvevents.gateway.upstream import (UpstreamAborted, UpstreamConnectError, UpstreamError,
                                       UpstreamResponse, UpstreamTimeout)
from kvevents.routing import RouteDecision, Router
from kvevents.text import TokenizerRegistry
from kvevents.text.limits import chars_limit, check_chars
from kvevents.text.prompt import InputError, check_length

log = logging.getLogger(__name__)

PATHS = {row.kind: row.path for row in ENDPOINTS.values()}
_SESSIONS = 100_000  # conversations remembered (least recently used forgotten first)


class Gateway:
    """See the module docstring. One per app; the event loop's thread only."""

    def __init__(self, router: Router, tokenizers: TokenizerRegistry, metrics: GatewayMetrics, *,
                 api_key: str | None = None, timeout_s: float = 600.0, max_inflight: int = 1024,
                 poll_interval_s: float = 1.0, busy_poll_interval_s: float | None = 1.0,
                 prefill_tokens_per_request: int = 2048, max_prompt_tokens: int = 1_000_000,
                 max_prompt_chars: int = 4_000_000, token_parity_sample_rate: float = 0.01,
                 token_parity_threshold: int = 3, models_interval_s: float = 30.0,
                 pd_skip_cached_share: float = 0.9, pd_skip_uncached_tokens: int = 256) -> None:
        self.router = router
        self.aggregator = router.aggregator
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.poll_interval_s = poll_interval_s
        self.busy_poll_interval_s = busy_poll_interval_s  # while routing (see load.py)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_chars = max_prompt_chars
        self.loads = EngineLoads(prefill_tokens_per_request)
        self.flights = InflightPrompts()  # prompts sent and not finished, per engine
        self.sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.homes = ResponseHomes()  # stored responses' engines
        self.inflight = 0  # requests holding a slot (admitted, last byte not yet sent)
        self.trim = MemoryTrim(lambda: self.inflight)  # freed memory back to the OS after a burst
        self.client: httpx.AsyncClient | None = None  # polls, /tokenize, /v1/models
        self.upstream = UpstreamPool()  # the proxied requests themselves
        self.tokens: PromptTokens | None = None
        # Local ids checked against the engines' /tokenize (see parity.py)
        self.parity = TokenParity(metrics.parity_checked, token_parity_sample_rate, token_parity_threshold)
        self._poller: asyncio.Task | None = None
        self._known: set[str] = set()  # targets at the last poll
        self.catalog, self._catalog_task = ModelCatalog(models_interval_s), None  # engines' adapters
        self.pd = Disaggregation(metrics, pd_skip_cached_share, pd_skip_uncached_tokens, timeout_s)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        self.tokens = PromptTokens(self.tokenizers, self.client, parity=self.parity)
        self._poller = asyncio.create_task(self.loads.poll_forever(
            self.client, self._metrics_urls, self.poll_interval_s, self.busy_poll_interval_s),
            name="kvevents-gateway-poll")
        self._catalog_task = asyncio.create_task(self.catalog.run(self.client, lambda: [
            (s.name, s.http) for s in self.aggregator.engine_specs() if s.http]), name="kvevents-gateway-models")

    async def stop(self) -> None:
        for task in (t for t in (self._poller, self._catalog_task) if t is not None):
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.parity.stop()
        if self.client is not None:
            await self.client.aclose()
        self.upstream.close()
        self.trim.stop()

    def _metrics_urls(self) -> dict[str, str]:
        """The targets' ``/metrics`` now; engines gone since the last call lose their
        series (an engine that leaves the fleet leaves no stale series behind)."""
        urls = {s.name: s.http + "/metrics" for s in self.aggregator.engine_specs() if s.http}
        self.loads.set_ranks(self.aggregator.engine_specs())  # (a DP rank reads its own gauges)
        for gone in self._known - set(urls):
            self.metrics.forget_engine(gone)
        self.flights.forget(set(urls))
        self.upstream.forget({s.http for s in self.aggregator.engine_specs() if s.http})
        self._known = set(urls)
        return urls

    # -- targets ------------------------------------------------------------------------

    def targets(self, model: str | None) -> list[EngineSpec]:
        """Engines with an OpenAI server serving ``model`` (or adapter), not leaving ones."""
        leaving = self.aggregator.leaving_engines()
        specs = [s for s in self.aggregator.engine_specs() if s.http and s.name not in leaving]
        if model is None:
            return specs
        adapters = [s for s in specs if self.catalog.parent_of(s.name, model) is not None]
        return adapters or [s for s in specs if s.model is None or s.model == model]

    def served_models(self) -> list[str]:
        return sorted({s.model for s in self.aggregator.engine_specs() if s.http and s.model}
                      | set(self.catalog.adapters()))

    # -- requests -----------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def handle(self, request: Request, kind: str) -> Response:
        """One OpenAI request; never raises (errors are OpenAI-shaped answers). Its slot
        is taken before the body is read (a body sent late cannot slip past the bound)
        and given back when the answer's last byte is sent: here for every answer but a
        streamed one, by its :class:`Relay` for that."""
        t0 = time.perf_counter()
        try:
            self.check_key(request)
            if self.inflight >= self.max_inflight:
                raise OpenAIError(503, f"the gateway has {self.inflight} requests in flight "
                                       "(max_inflight); retry shortly", headers={"Retry-After": "1"})
        except OpenAIError as exc:
            self.metrics.refused(None, exc.status)
            return exc.response()
        self.inflight += 1
        self.trim.started(self.inflight)
        relayed = False
        req: OpenAIRequest | None = None
        try:
            try:
                body = body_now(request.scope)
                if body is None:
                    body = await request.body()
            except ClientDisconnect:  # left mid-upload (or timed out by the server)
                raise OpenAIError(499, "client closed the request while sending its body") from None
            row = ENDPOINTS[kind]
            req = row.parse(body)
            response = await self._serve(request, req, row, t0)
            relayed = isinstance(response, Relay)
            return response
        except (OpenAIError, InputError) as exc:  # (InputError: the prompt's limits)
            err = exc if isinstance(exc, OpenAIError) else OpenAIError(exc.status, exc.message, exc.field)
            self.metrics.refused(req.model if req else None, err.status)
            return err.response()
        finally:
            if not relayed:
                self.inflight -= 1
                self.trim.ended()

    def _check_chars(self, req: OpenAIRequest, model: str | None, field: str) -> None:
        """The lookup API's 400 (:mod:`kvevents.text.limits`) for a prompt with more
        characters than ``max_prompt_chars``, or than ``model``'s context (``max_model_len``,
        within ``max_prompt_tokens``) can hold, before tokenizing it (~150 MB per million
        characters). A chat whose JSON is within the limit is not counted: O(1)."""
        ctx = min(self.catalog.context_len(model) or self.max_prompt_tokens, self.max_prompt_tokens)
        if req.kind in MESSAGES and len(req.messages_json) <= min(ctx, self.max_prompt_chars):
            return  # a JSON text's strings hold no more characters than its bytes
        tok = self.tokenizers.get(model)
        limit, why = chars_limit(self.max_prompt_chars, ctx, tok and tok.max_token_chars(),
                                 "max_model_len" if ctx < self.max_prompt_tokens else "max_prompt_tokens")
        check_chars(None, limit, field, why, prompt_chars(req))

    async def _serve(self, request: Request, req: OpenAIRequest, row: Endpoint, t0: float) -> Response:
        model = self._model_of(req)
        targets = self.targets(model)
        if not targets:
            raise OpenAIError(404, f"no engine serves model {model!r} (served: "
                                   f"{', '.join(self.served_models()) or 'none'})", "model",
                              code="model_not_found")
        reachable = [s for s in targets if self.loads.of(s.name).reachable]
        pools = self.pd.pools(targets, reachable, req.kind)  # (None: not disaggregated)
        reachable = reachable if pools is None else pools.decode
        if not reachable:
            raise OpenAIError(503, "no engine for this model is reachable now; retry shortly",
                              headers={"Retry-After": "2"})
        reachable = self.homes.targets(req, targets, reachable)  # (a stored response's engine)
        by_name = {s.name: s for s in reachable}
        base, lora = self.catalog.identity(model, reachable)
        ids = None
        if row.affinity and req.previous_response_id is None:  # (else: by load, or pinned)
            self._check_chars(req, base if lora else model, row.prompt_field or "prompt")
            ids = await self._ids(req, base, lora, reachable[0])
        ident = identity_digest(lora, req.cache_salt, req.media)  # keys its prompt in flight
        if ids is not None:  # (the same 400 as the characters' and the lookup API's)
            check_length(ids, self.max_prompt_tokens, row.prompt_field or "prompt")
        drop = _DROP_KEYED if self.api_key else _DROP  # (the gateway's key stays here)
        raw = request.scope["headers"]  # lowercase names (ASGI)
        headers = [(k, v) for k, v in raw if k not in drop]
        session = next((v.decode("latin-1") for k, v in raw if k == b"x-session-id"), None)
        tried: set[str] = set()
        arr = None if ids is None else np.asarray(ids, dtype=np.int64)
        identity = (base if lora else model, lora, req.cache_salt, ident, req.media)
        hop: Hop | None = None  # a disaggregated request's prefill hop (see disagg.py)
        while True:
            decision = await self._decide(ids, arr, model, by_name, tried, session, identity)
            engine = by_name[decision.engine]
            if pools is not None and hop is None:  # (before the decode engine's first try)
                hop = await self.pd.prefill(self, request, req, ids, arr, decision, pools, model,
                                            identity, headers)
            predicted = max(expected_cached(decision, len(ids) if ids else 0), hop.transferred if hop else 0)
            # The request's load and prompt in flight, counted once it is on its way
            # (see UpstreamPool.send: nothing else is decided before).
            flight: list[tuple[int, tuple | None]] = []
            on_way = partial(self._on_way, flight, engine.name, decision, predicted, arr, model,
                             ids, session, ident)
            try:
                upstream = await self._send(request, engine, hop.request if hop else req, headers, on_way)
            except OpenAIError as exc:  # the client left before any answer
                self._landed(engine.name, flight)
                self._count(engine.name, model, exc.status, t0, None)
                return exc.response()
            except BaseException:
                self._landed(engine.name, flight)
                raise
            retry = retry_reason(upstream, tried, len(by_name))
            if retry is None:
                break
            self._landed(engine.name, flight)
            self.metrics.retries.labels(retry).inc()
            log.warning("engine %s: %s before the first byte; sending the request to another engine",
                        engine.name, retry)
            tried.add(engine.name)
            if isinstance(upstream, UpstreamResponse):
                upstream.close()
        if isinstance(upstream, Exception):
            self._landed(engine.name, flight)
            status = 504 if isinstance(upstream, UpstreamTimeout) else 502
            self._count(engine.name, model, status, t0, None)
            return OpenAIError(status, f"engine {engine.name} failed before answering: {upstream}",
                               headers={"Retry-After": "1"}).response()
        prefill = flight[0]  # (told before _send first waited: it is on its way)
        if upstream.status_code == 404 and model is not None:  # an adapter unloaded there?
            self.catalog.stale(engine.name)
        if session:
            self._pin(session, engine.name)
        if req.stream and row.streams and upstream.status_code < 400:
            if row.stored:  # (its id is in its first event: relayed through Python, see .responses)
                try:
                    rid = await first_event_id(upstream, request.scope, request.receive, self.timeout_s)
                except BaseException:
                    upstream.close()
                    self._finished(engine.name, prefill)
                    raise
                self.homes.remember(rid, engine.name)
            return self._stream(upstream, engine.name, model, predicted, prefill, t0, row.ends, hop)
        self.pd.first_byte(hop, model)  # (a whole answer's: its head)
        return await self._whole(request, upstream, engine.name, model, predicted, prefill, t0, row.stored)

    async def _ids(self, req: OpenAIRequest, base: str | None, lora: str | None,
                   engine: EngineSpec) -> Sequence[int] | None:
        """The prompt's ids (None: routed by load alone, counted as such); a media chat's
        items, when an engine rendered it, set on ``req`` (see :meth:`PromptTokens.identity`)."""
        assert self.tokens is not None
        try:
            treq = req if lora is None or base is None else dataclasses.replace(req, model=base)
            ids, req.partial, req.media = await self.tokens.identity(treq, engine.http, engine.name)
        except Exception:  # noqa: BLE001 - routing must never be why a request fails
            log.exception("tokenizing a %s request failed; routing it by load alone", req.kind)
            ids = None
        if ids is None or req.partial:  # no ids, or a part's (a chat's media, prompt embeds)
            self.metrics.unscored(req.partial)
        return ids

    def _model_of(self, req: OpenAIRequest) -> str | None:
        if req.model is not None:
            return req.model
        served = self.served_models()
        if len(served) > 1:
            raise OpenAIError(400, f"model is required: the engines serve {', '.join(served)}", "model")
        return served[0] if served else None

    async def _decide(self, ids: Sequence[int] | None, arr: np.ndarray | None, model: str | None,
                      by_name: dict[str, EngineSpec], tried: set[str], session: str | None,
                      identity: tuple, balance: bool = True) -> RouteDecision:
        names = [n for n in by_name if n not in tried]
        if not names:
            raise OpenAIError(502, "every engine tried failed before answering", headers={"Retry-After": "1"})
        index_model, lora, salt, ident, media = identity  # (the index's model, lora, salt, digest, items)
        flying = {} if arr is None else self.flights.matches(arr, names, ident)
        decision = await self.router.choose(ids, index_model, lora, self.loads.candidates(names, flying, balance),
                                            cache_salt=salt, media=media)
        pinned = self.sessions.get(session) if session else None
        if pinned is not None and pinned != decision.engine and pinned in names:
            # A conversation stays where its history is unless that engine is overloaded
            # (the policy's load guard made it ineligible).
            score = next((s for s in decision.scores if s.engine == pinned), None)
            if score is not None and score.eligible:
                return RouteDecision(pinned, score.matched_tokens, score.tiers, decision.scores,
                                     f"session {session!r} pinned to {pinned}", decision.block_size)
        return decision

    def _pin(self, session: str, engine: str) -> None:
        self.sessions[session] = engine
        self.sessions.move_to_end(session)
        while len(self.sessions) > _SESSIONS:
            self.sessions.popitem(last=False)

    def _on_way(self, flight: list, engine: str, decision: RouteDecision, predicted: int,
                arr: np.ndarray | None, model: str | None, ids: Sequence[int] | None,
                session: str | None, ident: bytes = b"") -> None:
        """A request is on its way to ``engine``: its prefill tokens and prompt join the
        engine's load (``flight`` gets the handle :meth:`_finished` takes back), and the
        feed's route item is published after this turn of the loop."""
        prefill = (max(0, (len(ids) if ids else 0) - predicted),
                   None if arr is None else self.flights.add(engine, arr, ident))
        flight.append(prefill)
        self.loads.started(engine, prefill[0])
        self.metrics.of(self.metrics.inflight, engine).inc()
        asyncio.get_running_loop().call_soon(self._announce, decision, model, ids, session)

    def _announce(self, decision: RouteDecision, model: str | None, ids: Sequence[int] | None,
                  session: str | None) -> None:
        log.debug("route %s -> %s: %s", model, decision.engine, decision.reason)
        self.aggregator.feed.publish("route", {
            "engine": decision.engine, "model": model, "prompt_tokens": len(ids) if ids else None,
            "matched_tokens": decision.matched_tokens, "reason": decision.reason, "session": session})

    async def _send(self, request: Request, engine: EngineSpec, req: OpenAIRequest,
                    headers: list[tuple[bytes, bytes]], on_way: Callable[[], None]
                    ) -> UpstreamResponse | UpstreamError:
        """The engine's response (headers read, body not), or the exception that stopped
        it before any answer. A client gone meanwhile ends the wait (a 499) and closes
        the engine's connection; awaited in this task (see :mod:`.pool`, also for
        ``on_way``)."""
        assert engine.http is not None
        gone = client_gone(request.scope, request.receive)
        try:
            return await self.upstream.send(engine.http, PATHS[req.kind], req.body, with_rank(headers, engine),
                                            timeout_s=self.timeout_s, abort=gone, on_way=on_way)
        except UpstreamAborted:
            raise OpenAIError(499, "client closed the request") from None
        except UpstreamConnectError as exc:
            self.loads.unreachable(engine.name, str(exc))
            return exc
        except UpstreamError as exc:  # no head in time, a malformed or broken-off answer
            return exc
        finally:
            gone.cancel()

    def _landed(self, engine: str, flight: list[tuple[int, tuple | None]]) -> None:
        """:meth:`_finished` for a request whose ``on_way`` may not have been told."""
        for prefill in flight:
            self._finished(engine, prefill)

    def _finished(self, engine: str, prefill: tuple[int, tuple | None]) -> None:
        """A request's end: its prefill tokens and its prompt leave the engine's load."""
        self.loads.finished(engine, prefill[0])
        if prefill[1] is not None:
            self.flights.remove(prefill[1])
        self.metrics.of(self.metrics.inflight, engine).dec()

    def _count(self, engine: str, model: str | None, status: int, t0: float,
               usage: tuple[int, int] | None) -> None:
        """One request's end: its status, latency, and (reported, predicted) cached tokens."""
        self.metrics.answered(engine, model, status, time.perf_counter() - t0, usage)
        if usage is not None:
            self.loads.of(engine).count_cached(*usage)

    async def _whole(self, request: Request, upstream: UpstreamResponse, engine: str, model: str | None,
                     predicted: int, prefill: tuple, t0: float, stored: bool = False) -> Response:
        """A non-streamed answer (or an engine's error), read whole while watching the
        client; taken at once when it came with its head (the common case: no task)."""
        body = upstream.body_now()
        held = body is not None  # engine connection and load released once written
        if body is None:
            try:
                body = await read_whole(request, upstream, engine, self.timeout_s)
            finally:
                upstream.close()
                self._finished(engine, prefill)
            if isinstance(body, OpenAIError):
                self._count(engine, model, body.status, t0, None)
                return body.response()
        status = upstream.status_code

        def after() -> None:  # once the answer is written: not on the client's clock
            if held:
                upstream.close()
                self._finished(engine, prefill)
            cached = cached_tokens(body) if status < 400 else None
            self._count(engine, model, status, t0, None if cached is None else (cached, predicted))
            if stored and status < 400:  # (a Responses answer: its id stored there)
                self.homes.remember(response_id(body), engine)

        return WholeAnswer(body, status, answer_headers(upstream, engine), after)

    def _stream(self, upstream: UpstreamResponse, engine: str, model: str | None,
                predicted: int, prefill: tuple, t0: float, ends: tuple[bytes, ...],
                hop: Hop | None = None) -> Relay:
        """A streamed answer, relayed as the engine sends it; the relay's end releases
        the request's slot and load and counts it (see :mod:`.relay`)."""
        def first() -> None:
            self.metrics.first_byte(model, time.perf_counter() - t0)
            self.pd.first_byte(hop, model)

        def end(status: int, tail: bytes) -> None:
            self.inflight -= 1
            self.trim.ended()
            self._finished(engine, prefill)
            cached = stream_cached_tokens(tail) if status < 400 else None
            self._count(engine, model, status, t0, None if cached is None else (cached, predicted))

        return Relay(upstream, answer_headers(upstream, engine), engine, first, end, ends)

    # -- models -----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: what the reachable engines list, adapters included."""
        try:
            self.check_key(request)
        except OpenAIError as exc:
            return exc.response()
        assert self.client is not None
        specs = [s for s in self.targets(None) if self.loads.of(s.name).reachable]
        data = await self.catalog.listing(self.client, [s.http for s in specs], self.served_models(),
                                          int(self.aggregator.started_at))
        return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")
