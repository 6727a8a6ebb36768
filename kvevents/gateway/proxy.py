"""The KV-aware OpenAI gateway: each request routed by the in-process index and the
engines' load, forwarded byte for byte, streamed back, and accounted.

A request's life (each endpoint of :mod:`.endpoints`: ``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, and, routed by load alone, ``/v1/embeddings``,
``/tokenize``, ``/detokenize``) is :meth:`Gateway.handle`, read top to bottom, with its
state in one :class:`~.lifecycle.Call` that owns its slot, load, engine connection and
count (:mod:`.lifecycle`: one release, one count, however it ends):

0. admitted: the bearer token (``api_key``), then the concurrency bound
   (``max_inflight``: past it, 503 with ``Retry-After``). The call holds its slot from
   here, before its body is read, to its answer's last byte;
1. the body (:mod:`.endpoints`' parser: model, stream, prompt; a client that leaves
   while sending it is a 499);
2. the targets: followed engines with an ``http`` URL serving the model (or adapter:
   :mod:`.catalog`), reachable (:mod:`.load`); none serve it: 404; none reachable: 503
   with ``Retry-After``; a model with prefill engines (``role=prefill``) is
   disaggregated (:mod:`.disagg`): the targets are its decode engines;
3. the identity and tokens: the prompt's cache identity (model, adapter,
   ``cache_salt``, media items) and its token ids, within the prompt's limits
   (:class:`~kvevents.text.limits.PromptLimits`, the lookup API's: characters before
   tokenizing, so an oversized prompt costs no tokenizer memory, and ids after, under
   the model's ``max_model_len``);
4. the choice: the engine that stored the response a Responses follow-up names
   (:mod:`.responses`), the session pin (``x-session-id``: a conversation stays on
   its engine while that engine is a target and not overloaded), else the policy's
   (:class:`~kvevents.routing.Router`: longest cached prefix per tier against load;
   engines whose event stream is down are chosen only when all are); a disaggregated
   request's prompt may first go to a prefill engine (the prefill hop), whose
   ``kv_transfer_params`` the body then carries;
5. the send: the body unchanged to the engine. A refused connection, or a 5xx before
   the first byte, is sent once more to the next choice
   (``kvevents_gateway_retries_total``); after the first byte nothing is retried;
6. the answer streamed back unchanged (:mod:`.relay`) or whole. A client that goes
   away, at any moment from its body's end to the answer's last byte, closes the
   upstream request (vLLM then aborts it); so does ``timeout_s`` without an answer.
   The answer ends the call once its last byte is written.

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
from collections.abc import Sequence
from functools import partial
from urllib.parse import quote

import httpx
import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from kvevents.engines import EngineSpec
from kvevents.gateway.answers import (WholeAnswer, answer_headers, cached_tokens, expected_cached,
                                      stream_cached_tokens)
from kvevents.gateway.catalog import ModelCatalog, identity_digest
from kvevents.gateway.disagg import Disaggregation, Pools
from kvevents.gateway.endpoints import ENDPOINTS
from kvevents.gateway.errors import OpenAIError
from kvevents.gateway.headers import DROP as _DROP, DROP_KEYED as _DROP_KEYED, with_rank
from kvevents.gateway.inflight import InflightPrompts
from kvevents.gateway.lifecycle import Call, Load
from kvevents.gateway.load import EngineLoads
from kvevents.gateway.memory import MemoryTrim
from kvevents.gateway.metrics import GatewayMetrics
from kvevents.gateway.parity import TokenParity
from kvevents.gateway.pool import UpstreamPool, retry_reason
from kvevents.gateway.prompt import MESSAGES, OpenAIRequest, PromptTokens, prompt_chars
from kvevents.gateway.relay import Relay, read_whole
from kvevents.gateway.responses import ResponseHomes, ask_stored, first_event_id, response_id
from kvevents.gateway.server_ext import body_now, client_gone
from kvevents.gateway.upstream import (UpstreamAborted, UpstreamConnectError, UpstreamError,
                                       UpstreamResponse, UpstreamTimeout)
from kvevents.routing import RouteDecision, Router
from kvevents.text import TokenizerRegistry
from kvevents.text.limits import PromptLimits
from kvevents.text.prompt import InputError

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
        self.limits = PromptLimits(max_prompt_chars, max_prompt_tokens)  # (the lookup API's too)
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

    def reachable(self, specs: list[EngineSpec]) -> list[EngineSpec]:
        """Those of ``specs`` whose OpenAI server answered its last poll (:mod:`.load`)."""
        return [s for s in specs if self.loads.of(s.name).reachable]

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
        """One OpenAI request, its whole life (the module docstring's steps); never raises
        but for a bug or a cancellation (errors are OpenAI-shaped answers). Its
        :class:`~.lifecycle.Call` holds the slot from before the body is read; the answer
        returned owns the call's end from then on (its last byte written), else the
        call ends here."""
        t0 = time.perf_counter()
        try:
            self.check_key(request)
            if self.inflight >= self.max_inflight:
                raise OpenAIError(503, f"the gateway has {self.inflight} requests in flight "
                                       "(max_inflight); retry shortly", headers={"Retry-After": "1"})
        except OpenAIError as exc:  # (no slot taken: counted as refused)
            self.metrics.refused(None, exc.status)
            return exc.response()
        call = Call(self, request, ENDPOINTS[kind], t0)
        try:
            call.req = call.row.parse(await self._body(request))  # 1. the body
            reachable, pools = self._targets_of(call)  # 2. the engines it may go to
            await self._identify(call, reachable)  # 3. its identity and token ids
            await self._choose_and_send(call, reachable, pools)  # 4. and 5. choose, send, retry
            return await self._answer(call)  # 6. the answer, which ends the call
        except (OpenAIError, InputError) as exc:  # (InputError: the prompt's limits)
            return call.fail(exc)
        except BaseException as exc:
            call.end(499 if isinstance(exc, asyncio.CancelledError) else 500)
            raise

    async def _body(self, request: Request) -> bytes:
        body = body_now(request.scope)
        if body is not None:
            return body
        try:
            return await request.body()
        except ClientDisconnect:  # left mid-upload (or timed out by the server)
            raise OpenAIError(499, "client closed the request while sending its body") from None

    def _targets_of(self, call: Call) -> tuple[list[EngineSpec], Pools | None]:
        """The reachable engines that may answer the call (a disaggregated model's: its
        decode pool, with its ``pools``): 404 when no engine serves its model, 503 when
        none is reachable."""
        req = call.req
        assert req is not None
        call.model = model = self._model_of(req)
        targets = self.targets(model)
        if not targets:
            raise OpenAIError(404, f"no engine serves model {model!r} (served: "
                                   f"{', '.join(self.served_models()) or 'none'})", "model",
                              code="model_not_found")
        reachable = self.reachable(targets)
        pools = self.pd.pools(targets, reachable, req.kind)  # (None: not disaggregated)
        reachable = reachable if pools is None else pools.decode
        if not reachable:
            raise OpenAIError(503, "no engine for this model is reachable now; retry shortly",
                              headers={"Retry-After": "2"})
        return self.homes.targets(req, targets, reachable), pools  # (a stored response's engine)

    async def _identify(self, call: Call, reachable: list[EngineSpec]) -> None:
        """The call's cache identity and prompt token ids (routed by load alone: none),
        within the prompt's limits, and the headers forwarded."""
        req, row, model = call.req, call.row, call.model
        assert req is not None
        base, lora = self.catalog.identity(model, reachable)
        if row.affinity and req.previous_response_id is None:  # (else: by load, or pinned)
            # The lookup API's limits (one path: kvevents.text.limits), under the model's
            # context: a prompt it cannot hold is refused before tokenizing more than it
            # could (~150 MB per million characters), or after, on its ids.
            field, served = row.prompt_field or "prompt", base if lora else model
            ctx = self.catalog.context_len(served)
            tok = self.tokenizers.get(served)
            self.limits.check_text(None, field, tok and tok.max_token_chars(), ctx,
                                   count=partial(prompt_chars, req),
                                   json_len=len(req.messages_json) if req.kind in MESSAGES else None)
            call.ids = await self._ids(req, base, lora, reachable[0])
            if call.ids is not None:
                self.limits.check_ids(call.ids, field, ctx)
                call.arr = np.asarray(call.ids, dtype=np.int64)
        call.identity = (base if lora else model, lora, req.cache_salt,
                         identity_digest(lora, req.cache_salt, req.media), req.media)
        raw = call.request.scope["headers"]  # lowercase names (ASGI)
        call.headers = self._forwarded(raw)
        call.session = next((v.decode("latin-1") for k, v in raw if k == b"x-session-id"), None)

    def _forwarded(self, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The client's headers an engine gets (:mod:`.headers`; the gateway's own API key
        stays here)."""
        drop = _DROP_KEYED if self.api_key else _DROP
        return [(k, v) for k, v in raw if k not in drop]

    async def _choose_and_send(self, call: Call, reachable: list[EngineSpec], pools: Pools | None) -> None:
        """Choose the engine, send the body, and send it once more to the next choice on a
        refused connection or a 5xx before the first byte; ``call.upstream`` is then the
        answer's head. A client gone meanwhile: 499; an engine failed: 502 / 504."""
        by_name = {s.name: s for s in reachable}
        tried: set[str] = set()
        n = len(call.ids) if call.ids else 0
        while True:
            decision = await self._decide(call, by_name, tried)
            engine = by_name[decision.engine]
            if pools is not None and call.hop is None:  # (before the decode engine's first try)
                call.hop = await self.pd.prefill(self, call, decision, pools)
            hop = call.hop
            call.engine = engine.name
            call.predicted = max(expected_cached(decision, n), hop.transferred if hop else 0)
            # The request's load and prompt in flight, counted once it is on its way (see
            # UpstreamPool.send: nothing else is decided before).
            call.load = call.load_on(engine.name, decision, call.predicted)
            upstream = await self._send(call, engine, hop.request if hop else call.req, call.load)
            if isinstance(upstream, UpstreamResponse):
                call.upstream = upstream
            retry = retry_reason(upstream, tried, len(by_name))
            if retry is None:
                break
            self.metrics.retries.labels(retry).inc()
            log.warning("engine %s: %s before the first byte; sending the request to another engine",
                        engine.name, retry)
            tried.add(engine.name)
            call.retry()
        if isinstance(upstream, Exception):  # (counted on the engine that failed)
            raise OpenAIError(504 if isinstance(upstream, UpstreamTimeout) else 502,
                              f"engine {engine.name} failed before answering: {upstream}",
                              headers={"Retry-After": "1"})

    async def _answer(self, call: Call) -> Response:
        """The engine's answer, streamed (a :class:`Relay`) or whole; either ends the call
        once its last byte is written."""
        upstream, req, row = call.upstream, call.req, call.row
        assert upstream is not None and req is not None and call.engine is not None
        if upstream.status_code == 404 and call.model is not None:  # an adapter unloaded there?
            self.catalog.stale(call.engine)
        if call.session:
            self._pin(call.session, call.engine)
        if req.stream and row.streams and upstream.status_code < 400:
            if row.stored:  # (its id is in its first event: relayed through Python, see .responses)
                rid = await first_event_id(upstream, call.request.scope, call.request.receive, self.timeout_s)
                self.homes.remember(rid, call.engine)
            return self._stream(call)
        self.pd.first_byte(call.hop, call.model)  # (a whole answer's: its head)
        return await self._whole(call)

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

    async def _decide(self, call: Call, by_name: dict[str, EngineSpec], tried: set[str],
                      prefill: bool = False) -> RouteDecision:
        """The policy's choice for ``call`` among ``by_name`` less ``tried`` (502 when
        every one was tried); a session pinned to one of them stays there unless the
        policy's load guard made it ineligible. ``prefill``: a disaggregated request's
        prefill engine (no pull toward even request counts, no session; see .disagg)."""
        names = [n for n in by_name if n not in tried]
        if not names:
            raise OpenAIError(502, "every engine tried failed before answering", headers={"Retry-After": "1"})
        index_model, lora, salt, ident, media = call.identity
        flying = {} if call.arr is None else self.flights.matches(call.arr, names, ident)
        decision = await self.router.choose(call.ids, index_model, lora,
                                            self.loads.candidates(names, flying, not prefill),
                                            cache_salt=salt, media=media)
        session = None if prefill else call.session
        pinned = self.sessions.get(session) if session else None
        if pinned is not None and pinned != decision.engine and pinned in names:
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

    async def _send(self, call: Call, engine: EngineSpec, req: OpenAIRequest, load: Load
                    ) -> UpstreamResponse | UpstreamError:
        """The engine's response to ``req`` (headers read, body not), or the exception
        that stopped it before any answer; ``load`` joins the engine's once the request
        is on its way. A client gone meanwhile ends the wait (a 499) and closes the
        engine's connection; awaited in this task (see :mod:`.pool`)."""
        assert engine.http is not None
        request = call.request
        gone = client_gone(request.scope, request.receive)
        try:
            return await self.upstream.send(engine.http, PATHS[req.kind], req.body,
                                            with_rank(call.headers, engine), timeout_s=self.timeout_s,
                                            abort=gone, on_way=load.join)
        except UpstreamAborted:
            raise OpenAIError(499, "client closed the request") from None
        except UpstreamConnectError as exc:
            self.loads.unreachable(engine.name, str(exc))
            return exc
        except UpstreamError as exc:  # no head in time, a malformed or broken-off answer
            return exc
        finally:
            gone.cancel()

    async def _whole(self, call: Call) -> Response:
        """A non-streamed answer (or an engine's error), read whole while watching the
        client; taken at once when it came with its head (the common case: no task). The
        call ends once the answer is written."""
        upstream, engine = call.upstream, call.engine
        assert upstream is not None and engine is not None
        body = upstream.body_now()
        if body is None:
            body = await read_whole(call.request, upstream, engine, self.timeout_s)
            if isinstance(body, OpenAIError):
                return call.fail(body)
        status = upstream.status_code
        stored = call.row.stored

        def after() -> None:  # once the answer is written: not on the client's clock
            call.end(status, cached_tokens(body) if status < 400 else None)
            if stored and status < 400:  # (a Responses answer: its id stored there)
                self.homes.remember(response_id(body), engine)

        return WholeAnswer(body, status, answer_headers(upstream, engine), after)

    def _stream(self, call: Call) -> Relay:
        """A streamed answer, relayed as the engine sends it; the relay's end ends the call."""
        upstream, engine = call.upstream, call.engine
        assert upstream is not None and engine is not None

        def first() -> None:
            self.metrics.first_byte(call.model, time.perf_counter() - call.t0)
            self.pd.first_byte(call.hop, call.model)

        def end(status: int, tail: bytes) -> None:
            call.end(status, stream_cached_tokens(tail) if status < 400 else None)

        return Relay(upstream, answer_headers(upstream, engine), engine, first, end, call.row.ends)

    # -- stored responses -------------------------------------------------------------------

    async def stored_response(self, request: Request, rid: str, action: str = "") -> Response:
        """``GET /v1/responses/{rid}`` (``action`` empty) or ``POST
        /v1/responses/{rid}/cancel`` (``action`` "cancel"): to the engine that stored it
        (:func:`~.responses.ask_stored`); errors in OpenAI's shape, never raised."""
        try:
            self.check_key(request)
            assert self.client is not None
            targets = self.targets(None)
            reachable = self.reachable(targets)
            headers = self._forwarded(request.scope["headers"])
            path = f"/v1/responses/{quote(rid, safe='')}" + (f"/{action}" if action else "")
            return await ask_stored(self.client, self.homes, rid, request.method, path,
                                    request.scope.get("query_string", b""), headers, targets, reachable)
        except OpenAIError as exc:
            return exc.response()

    # -- models -----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: what the reachable engines list, adapters included."""
        try:
            self.check_key(request)
        except OpenAIError as exc:
            return exc.response()
        assert self.client is not None
        specs = self.reachable(self.targets(None))
        data = await self.catalog.listing(self.client, [s.http for s in specs], self.served_models(),
                                          int(self.aggregator.started_at))
        return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")
