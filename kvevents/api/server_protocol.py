"""The HTTP protocol ``kvevents serve`` runs uvicorn with: uvicorn's HTTP/1.1 protocol
under connection limits (:mod:`~kvevents.api.conn_guard`), with the hot paths answered
from the protocol itself, before the ASGI app, through one table of path -> handler.

Why: the requests routers and OpenAI clients send most spent much of the server's CPU
in the framework rather than in their answer. A 2,048-token lookup cost about 160 us of
CPU on the 2-core VM through uvicorn's ASGI cycle (a scope, a task, the message dicts,
the app's middleware stack, head and body written apart), ~65 us of it the cycle alone;
the index answers it in tens of microseconds. Around the gateway's handler, uvicorn's
cycle, the app's eight middleware layers, route matching and Starlette's request and
response wrappers took a large part of each proxied request.

The table (:func:`path_table`; exact path, no query string, ``POST``):

* ``/v1/lookup``: the body is held in the protocol's callbacks and, when it is the
  common shape within the limits, answered in one write with
  :func:`~kvevents.api.routes_query.common_answer` (the route's lookup, metrics, payload
  and encoding). Not on a connection with a response of its own in progress, with
  ``Expect: 100-continue``, or before the app is started. Anything else goes to the app
  as it would have: uvicorn's own cycle is started late with the body so far (a body past
  the size limit the moment it passes it, not held), so the route answers every error and
  every lookup that finds the index lock busy;
* each path of :data:`kvevents.gateway.endpoints.ENDPOINTS` (chat completions,
  completions, responses, embeddings, tokenize, detokenize): over HTTP/1.1, with one
  ``Content-Length`` within ``max_body_bytes``, :meth:`Gateway.handle
  <kvevents.gateway.Gateway.handle>` is called directly in one task, with this
  connection as its ``receive``/``send`` (:class:`~kvevents.api.exchange.Exchange`): the
  same handler, answers, errors and accounting as through the app, and the extensions of
  :mod:`kvevents.gateway.server_ext` (the connection for a streamed answer's direct relay,
  a disconnect watch, the body already read). The handler starts when the head is
  complete, as uvicorn's cycle would: it takes its slot (``max_inflight``) before the body
  arrives, and a client that leaves mid-upload is its 499. Anything else (a chunked or
  oversized body, ...) goes to the app.

Every answer written here has the head of :func:`~kvevents.api.http_head.response_head`
(uvicorn's default headers ``server`` and ``date``; one write for a whole answer).

Lifecycle: one instance per connection, made by uvicorn; :func:`protocol_class` makes the
class for one app (its state is read per request). It relies on these parts of uvicorn's
``HttpToolsProtocol``: the parser callbacks, ``on_response_complete``, ``shutdown``,
``connection_lost`` and the per-request attributes ``parser``, ``url``, ``headers``,
``scope``, ``cycle``, ``expect_100_continue``, ``transport``, ``loop``, ``tasks`` and
``server_state``; :func:`~kvevents.api.conn_guard.uvicorn_fits` is the one check that
the installed uvicorn has them, with what the connection limits need (if not, ``kvevents serve`` runs uvicorn's own protocol and the app answers
everything), and the tests run against the installed uvicorn.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

from kvevents.api.conn_guard import ConnLimits, GuardedHttpProtocol, guarded_class
from kvevents.api.exchange import Exchange
from kvevents.api.http_head import JSON, response_head
from kvevents.api.routes_query import common_answer
from kvevents.gateway.endpoints import ENDPOINTS
from kvevents.gateway.server_ext import BODY, DIRECT, GONE

log = logging.getLogger(__name__)

__all__ = ["HotPathProtocol", "LOOKUP_PATH", "path_table", "protocol_class"]

LOOKUP_PATH = b"/v1/lookup"

#: A row of the table: the handler (called once the request's head is in, with the
#: protocol and the row's kind; True: it took the request, False: the app answers it)
#: and the kind (the lookup's metrics label, or the OpenAI request's kind).
Row = tuple[Callable[["HotPathProtocol", str], bool], str]


def protocol_class(app, limits: ConnLimits | None = None, *, lookup: bool = True,
                   openai: bool = True) -> type | None:
    """The class for ``app`` under ``limits`` (default: :class:`ConnLimits`' defaults):
    ``lookup`` false: every lookup through the app; ``openai`` false: every OpenAI request
    through the app (each removes its rows from the table); both false: the limits only
    (:class:`~kvevents.api.conn_guard.GuardedHttpProtocol`). None when the installed
    uvicorn is not one these were written against (uvicorn's own protocol then runs, and
    the app answers everything)."""
    limits = limits or ConnLimits()
    if not lookup and not openai:
        return guarded_class(app, limits)
    cls = guarded_class(app, limits, HotPathProtocol)
    if cls is not None:
        cls.routes = path_table(lookup=lookup, openai=openai)
    return cls


def path_table(*, lookup: bool = True, openai: bool = True) -> dict[bytes, Row]:
    """The paths answered in the protocol: ``/v1/lookup`` if ``lookup``, each OpenAI
    endpoint's path if ``openai``."""
    table: dict[bytes, Row] = {}
    if lookup:
        table[LOOKUP_PATH] = (HotPathProtocol.take_lookup, "lookup")
    if openai:
        for row in ENDPOINTS.values():
            table[row.path.encode()] = (HotPathProtocol.take_openai, row.kind)
    return table


class HotPathProtocol(GuardedHttpProtocol):
    """See the module docstring; made per app by :func:`protocol_class`. Its connections
    have :class:`~kvevents.api.conn_guard.GuardedHttpProtocol`'s timeouts and cap; a
    request taken here marks its head and body done for them as uvicorn's cycle would."""

    #: path -> row (see :func:`path_table`), set per class by :func:`protocol_class`.
    routes: dict[bytes, Row] = {}
    #: The body of a lookup being held here, as it came (None: no lookup held); a list,
    #: not a bytearray: a body in one piece is then read without a copy.
    _held: list[bytes] | None = None
    _held_size = 0
    #: The aggregator answering the held lookup.
    _agg = None
    #: The server asked to shut down while a held lookup was arriving.
    _close_after = False
    #: The OpenAI request answered here (from its head to its answer's last byte).
    _ex: Exchange | None = None

    # -- uvicorn's protocol ------------------------------------------------------------

    def on_headers_complete(self) -> None:
        row = self.routes.get(self.url)
        if row is not None:
            # Common to every row: a POST that asks no 100-continue or upgrade, and no
            # response of the connection's own in progress (a pipelined request then
            # waits for it in uvicorn's way).
            parser = self.parser
            if (parser.get_method() == b"POST" and not self.expect_100_continue
                    and not parser.should_upgrade()
                    and (self.cycle is None or self.cycle.response_complete)
                    and row[0](self, row[1])):
                return
        self._held = None
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        ex = self._ex
        if ex is not None and ex.reading:
            ex.body.append(body)
            return
        held = self._held
        if held is None:
            super().on_body(body)
            return
        held.append(body)
        self._held_size += len(body)
        if self._held_size > self._agg.settings.max_body_bytes:
            self._to_app(more=True)  # the app refuses it as it arrives

    def on_message_complete(self) -> None:
        ex = self._ex
        if ex is not None and ex.reading:
            self._message_done()
            ex.body_complete()
            return
        held = self._held
        if held is None:
            super().on_message_complete()
            return
        self._message_done()
        try:
            answer = common_answer(self._agg, b"".join(held))  # one piece: that piece, not a copy
        except Exception:  # a fault here must still get the app's error answer
            log.exception("lookup in the protocol failed; the app answers it")
            answer = None
        if answer is None:
            self._to_app(more=False)
            return
        self._held = None
        keep_alive = (self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
                      and not self._close_after)
        self.transport.write(response_head(200, self.server_state.default_headers, JSON, keep_alive,
                                           answer)[0])
        if not keep_alive:
            self.transport.close()
        self.on_response_complete()

    def shutdown(self) -> None:
        if self._held is not None:
            self._close_after = True  # answer the lookup that is arriving, then close
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        ex = self._ex
        if ex is not None:  # (a pipelined request may have taken ``cycle`` since)
            ex.lost()
        super().connection_lost(exc)

    # -- the table's handlers ------------------------------------------------------------

    def take_lookup(self, kind: str) -> bool:
        """Hold this lookup's body here (answered at its end); False: the app answers."""
        self._agg = getattr(self.guard_app.state, "aggregator", None)
        if self._agg is None:  # not started: the app answers
            return False
        self._held, self._held_size = [], 0
        self._head_done()
        return True

    def take_openai(self, kind: str) -> bool:
        """Start the gateway's handler for this request here; False: the app answers."""
        if self.parser.get_http_version() != "1.1":
            return False
        state = self.guard_app.state
        gateway = getattr(state, "gateway", None)
        settings = getattr(state, "settings", None)
        if gateway is None or settings is None:  # not started: the app answers
            return False
        length = None
        for name, value in self.headers:
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return False  # repeated or odd: the app's parser decides
                length = int(value)
        if length is None or length > settings.max_body_bytes:
            return False
        self._held = None  # (no lookup held: this request is the gateway's)
        self._head_done()
        scope = self.scope
        scope["method"] = "POST"
        scope["path"] = self.url.decode("ascii")
        scope["raw_path"] = self.url
        scope["query_string"] = b""
        ex = self._ex = Exchange(self, self.parser.should_keep_alive())
        scope["extensions"] = {DIRECT: (weakref.ref(self), weakref.ref(ex)), GONE: ex.watch,
                               BODY: ex.take_body}
        self.cycle = ex
        task = self.loop.create_task(ex.run(gateway, scope, kind))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        return True

    def _to_app(self, *, more: bool) -> None:
        """Start uvicorn's own cycle for the held lookup now, with its body so far
        (``more``: the rest is still arriving and goes to it as usual)."""
        held, self._held = self._held, None
        super().on_headers_complete()
        if held:
            super().on_body(b"".join(held))
        if not more:
            super().on_message_complete()
        if self._close_after:
            super().shutdown()
