"""``POST /v1/lookup`` answered in front of the framework, for its common body.

Why: a lookup is the request routers send most, and the index answers it in tens of
microseconds; what remains is the HTTP stack. Through FastAPI/Starlette a lookup also
passes the error, body-size and exception middlewares, route matching and the
``Request`` / ``Response`` objects: in process, a 2,048-token lookup held by 16 engines
took 51-52 us through the route and 38-44 us here (``benchmarks/bench_lookup_asgi.py``,
6 rounds). This ASGI wrapper answers ``{"token_ids": [...], "model"?,
"lora_name"?}`` bodies (read by the compiled ``_fastbody`` reader) itself, with the same
lookup, payload and encoding as the route (``routes_query``), and hands everything else
to the app, the body replayed as it came: any other body, a body over the size limit or
a prompt over the token limit (the app words those errors), a client that leaves, any
other method or path. So the app's route stays the one reference for the semantics, and
answers every error.

Under ``kvevents serve`` the HTTP protocol answers these bodies first
(:mod:`kvevents.api.lookup_protocol`, with :func:`common_lookup` and
:func:`encode_answer` from here); this middleware answers them when the app runs under
another server, when that is turned off, and when the protocol handed a lookup on
because the index lock stayed taken.

Lifecycle: the outermost of the app's own middlewares (``create_app`` adds it last;
only Starlette's error middleware is outside it); reads ``app.state.aggregator`` per
request (set by the lifespan; before it, the app answers).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvevents.api._fastbody import lookup_body
from kvevents.api.routes_query import _json, lookup_payload
from kvevents.index import LookupResult
from kvevents.routing.offloop import lookup as lookup_off_loop

_PATH = "/v1/lookup"
_HEADERS = [(b"content-type", b"application/json")]


class LookupFastPath:
    """See the module docstring. ``max_body_bytes`` and ``max_prompt_tokens``: the
    app's limits (a request over either goes to the app, which refuses it)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_prompt_tokens: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_prompt_tokens = max_prompt_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        agg = (getattr(scope["app"].state, "aggregator", None)
               if scope["type"] == "http" and scope["path"] == _PATH
               and scope["method"] == "POST" and "app" in scope else None)
        if agg is None:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app sees it as it would have
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                break
        answer = None if more or size > self.max_body_bytes else await self._answer(
            agg, b"".join(m.get("body", b"") for m in messages))
        if answer is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_HEADERS, (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    async def _answer(self, agg, raw: bytes) -> bytes | None:
        """The answer to a common body, or None for the app to answer."""
        got = common_lookup(raw, self.max_prompt_tokens)
        if got is None:
            return None
        return encode_answer(agg, await lookup_off_loop(agg, *got, "lookup"))


def common_lookup(raw: bytes, max_prompt_tokens: int) -> tuple | None:
    """``(token_ids, model, lora_name)`` of a common lookup body within the prompt
    limit, else None (the app's route answers it, errors included)."""
    got = lookup_body(raw)
    if got is None or len(got[0]) > max_prompt_tokens:
        return None
    return got


def encode_answer(agg, result: LookupResult) -> bytes:
    """The route's JSON answer to ``result`` (``routes_query.lookup_payload``)."""
    return _json.encode(lookup_payload(result, agg.unroutable_engines()))


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that gives ``messages`` first, then goes on with the real one."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()
    return replayed
