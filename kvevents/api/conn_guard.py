"""uvicorn's HTTP/1.1 protocol with read timeouts and a connection cap, for
``kvevents serve``: a client that trickles its request (slowloris) or opens connections by
the thousand cannot hold the server's files and memory.

uvicorn arms no timer before a request is complete: its keep-alive timer runs only
between requests and is cancelled by the first byte of the next one, so a connection
that sends one byte of a head every few seconds, or a body one byte at a time, was held
as long as the client kept its socket. Here:

* **head**: a request's head must arrive whole within ``header_timeout_s`` of the
  connection's opening, or of its first byte on a kept-alive connection (idle between
  requests is uvicorn's keep-alive timeout); past it the connection is answered 408
  and closed;
* **body**: a request's body may go at most ``body_timeout_s`` without a byte arriving
  (not counting while the server itself is not reading it); past it the connection is
  closed, and the app sees its client gone (the gateway counts a 499);
* **connections**: past ``max_connections`` open at once, the connection that has waited
  longest for a request head (a trickling head, or an idle kept-alive one) is closed to
  make room; when every connection has a request in progress, the new one is answered
  503 and closed. Well-behaved clients, whose heads arrive at once, are never the ones
  closed while a slow one is open;
* **early answers** (a 413 for a body over the limit, or any answer that closes the
  connection while the request's body is still arriving): the connection is not closed
  under the client's upload, which would make the kernel reset it and the client lose the
  answer (most clients send the whole body before reading: httpx, the ``openai`` SDK).
  It closes as nginx's lingering close does: once the answer is written, the write side
  is shut (FIN after the answer), and what the client still sends is read and discarded,
  never parsed or kept, until it closes its side, or ``linger_bytes`` (bounded further by
  the request's declared ``Content-Length``) have been discarded, or ``linger_s`` have
  passed; then the connection is closed (:meth:`close_after_answer`). A lingering
  connection counts as an idle one for making room.

Every close is counted (``kvevents_gateway_connections_closed_total{reason}``; a lingering
close as ``early_answer``). Cost on the common path: a request that arrives in one packet
arms no timer at all; one that spans packets arms one timer.

It also offers each request's connection to the gateway's streamed answers
(:data:`kvevents.gateway.server_ext.DIRECT`, :mod:`kvevents.gateway.relay`): their body
is written to the socket as the engine sends it, and :attr:`on_writable` is called when
the socket drains after being full (the engine then reads again:
:mod:`kvevents.gateway.flow`).

Lifecycle: one instance per connection, made by uvicorn; :func:`guarded_class` makes the
class for one app and its limits. It relies on ``HttpToolsProtocol``'s ``connection_made``,
``data_received``, ``on_headers_complete``, ``on_message_complete``,
``on_response_complete``, ``connection_lost`` and its ``loop``, ``transport``,
``connections``, ``pipeline``, ``flow``, ``headers`` and ``server_state`` attributes and its
cycle's ``transport`` (:func:`uvicorn_fits`, which :func:`guarded_class` runs, checks them).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from kvevents.api.http_head import error_bytes, response_head
from kvevents.gateway.server_ext import DIRECT

log = logging.getLogger(__name__)

try:  # uvicorn's compiled-parser protocol (httptools is a dependency)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - an install without httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

__all__ = ["ConnLimits", "GuardedHttpProtocol", "guarded_class", "uvicorn_fits"]

#: What this module and :mod:`~kvevents.api.server_protocol` override or call of
#: uvicorn's protocol (checked by :func:`uvicorn_fits`).
_USED = ("connection_made", "data_received", "on_headers_complete", "on_body",
         "on_message_complete", "on_response_complete", "shutdown", "connection_lost",
         "resume_writing")


@dataclass(frozen=True)
class ConnLimits:
    """The limits (see the module docstring); the settings of the same names."""

    max_connections: int = 4096
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    #: A lingering close (see the module docstring) ends after this many seconds ...
    linger_s: float = 5.0
    #: ... or this many bytes discarded (or the request's declared length, if less).
    linger_bytes: int = 64 << 20

    @classmethod
    def from_settings(cls, settings) -> "ConnLimits":
        return cls(settings.max_connections, settings.header_timeout_s, settings.body_timeout_s)


def _answer(status: int, message: str) -> bytes:
    """An answer the guard writes before any request of the connection (so without the
    server's default headers), in OpenAI's shape: the gateway's clients read it."""
    head_and_body, _, _ = response_head(status, [], ((b"content-type", b"application/json"),
                                                     (b"retry-after", b"1")),
                                        False, error_bytes(status, message, openai=True))
    return head_and_body


_TIMEOUT = _answer(408, "the request head did not arrive in time")
_BUSY = _answer(503, "too many connections; retry shortly")


def _cycle_init_names() -> tuple[str, ...]:
    """The parameters of uvicorn's request cycle (it must take the ``transport`` it
    writes to and closes, which :class:`_CycleTransport` stands in for)."""
    try:
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
        return RequestResponseCycle.__init__.__code__.co_varnames
    except (ImportError, AttributeError):  # pragma: no cover - another uvicorn
        return ()


def uvicorn_fits() -> bool:
    """The one check that the installed uvicorn's protocol has what the protocols of
    ``kvevents serve`` rely on (this module's and the hot paths'); logged when not."""
    if HttpToolsProtocol is None or not all(hasattr(HttpToolsProtocol, n) for n in _USED) \
            or "transport" not in _cycle_init_names():
        log.warning("uvicorn's httptools protocol is not the expected one: no header/body "
                    "timeouts or connection cap, and every request goes through the ASGI app")
        return False
    return True


def guarded_class(app, limits: ConnLimits, base: type | None = None) -> type | None:
    """The protocol class for ``app`` with ``limits`` (``base``: a subclass of
    :class:`GuardedHttpProtocol` to specialise), or None when the installed uvicorn
    lacks what it relies on (:func:`uvicorn_fits`; uvicorn's own protocol then runs,
    without these limits, and the app answers everything)."""
    if not uvicorn_fits():
        return None
    base = base or GuardedHttpProtocol
    return type(base.__name__, (base,), {"guard_app": app, "limits": limits})


class GuardedHttpProtocol(HttpToolsProtocol or object):  # type: ignore[misc]
    """See the module docstring; made per app by :func:`guarded_class`."""

    guard_app = None
    limits = ConnLimits()
    _timer: asyncio.TimerHandle | None = None
    #: Loop time since which the connection waits for a request head (None: a request
    #: is in progress, from its head to its response's end).
    _head_since: float | None = None
    _in_body = False  # the head is in, the body is still arriving
    _body_seen = 0.0  # loop time of the last bytes while _in_body
    #: Called when the client's socket drained after being full (set by a direct relay).
    on_writable: Callable[[], None] | None = None
    #: Bytes still to discard in a lingering close (None: not lingering).
    _linger_left: int | None = None

    # -- uvicorn's protocol ------------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_since = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._close("over_capacity", _BUSY)
            return
        self._timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:  # an answer went early: discard, never parse
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self._linger_end()
            return
        super().data_received(data)
        # Timers only for a request that spans packets: none for one that came whole.
        if self._timer is None and not self.transport.is_closing():
            if self._in_body:
                self._body_seen = self.loop.time()
                self._timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timeout)
            elif self._head_since is not None:
                self._timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)
        elif self._in_body:
            self._body_seen = self.loop.time()

    def on_headers_complete(self) -> None:
        self._head_done()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # this request's cycle
            # Weak: the scope lives in the cycle and the protocol, and a cycle of strong
            # references would keep every connection's objects until a full collection.
            self.scope.setdefault("extensions", {})[DIRECT] = (weakref.ref(self), weakref.ref(cycle))
            # The cycle closes the connection through this: an answer that goes before
            # its body (the 413) closes lingering.
            cycle.transport = _CycleTransport(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.on_writable is not None:
            self.on_writable()

    def on_message_complete(self) -> None:
        self._message_done()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._linger_left is not None:  # closing: no keep-alive timer, no next request
            self.server_state.total_requests += 1  # (uvicorn's count, as its own does)
            return
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._head_since = self.loop.time()  # idle: uvicorn's keep-alive timer runs

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._head_since = None
        self._in_body = False
        super().connection_lost(exc)

    # -- the guard's own ---------------------------------------------------------------------

    def close_after_answer(self) -> None:
        """Close the connection after the answer written so far: at once if the
        request's body was read whole (or there is no request), else lingering (see the
        module docstring)."""
        transport = self.transport
        if self._linger_left is not None or transport.is_closing():
            return
        if not self._in_body:
            transport.close()
            return
        self._disarm()
        self._in_body = False
        self._head_since = self.loop.time()  # evictable, as an idle connection is
        declared = None
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit():
                declared = int(value)
        self._linger_left = min(self.limits.linger_bytes, declared or self.limits.linger_bytes)
        if self.cycle is not None and hasattr(self.cycle, "body"):
            self.cycle.body = bytearray()  # what uvicorn's cycle held of it: never read now
        try:
            transport.write_eof()  # FIN once the answer has gone
        except (NotImplementedError, RuntimeError, OSError):  # TLS, or already shut
            pass
        self.flow.resume_reading()  # (paused while a cycle's body waited to be read)
        self._timer = self.loop.call_later(self.limits.linger_s, self._linger_end)
        gateway = getattr(getattr(self.guard_app, "state", None), "gateway", None)
        if gateway is not None:
            gateway.metrics.connections_closed.labels("early_answer").inc()

    def _linger_end(self) -> None:
        """The lingering close's bound is reached (or the client stopped sending)."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _head_done(self) -> None:
        """A request's head is in: its body (if any) follows."""
        self._disarm()
        self._head_since = None
        self._in_body = True

    def _message_done(self) -> None:
        self._in_body = False
        self._disarm()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if self._head_since is not None and not self.transport.is_closing():
            self._close("header_timeout", _TIMEOUT)

    def _body_timeout(self) -> None:
        self._timer = None
        if not self._in_body or self.transport.is_closing():
            return
        idle = self.loop.time() - self._body_seen
        if self.flow.read_paused:  # the server is not reading it now: not the client's delay
            self._body_seen, idle = self.loop.time(), 0.0
        if idle < self.limits.body_timeout_s:
            self._timer = self.loop.call_later(self.limits.body_timeout_s - idle, self._body_timeout)
            return
        self._close("body_timeout")

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request head (not this
        one); False when every other connection has a request in progress."""
        victim, oldest = None, None
        for conn in self.connections:
            since = getattr(conn, "_head_since", None)
            if conn is not self and since is not None and (oldest is None or since < oldest):
                victim, oldest = conn, since
        if victim is None:
            return False
        victim._close("evicted")
        return True

    def _close(self, reason: str, answer: bytes | None = None) -> None:
        self._disarm()
        self._head_since = None
        if answer is not None:
            self.transport.write(answer)
        self.transport.close()
        gateway = getattr(getattr(self.guard_app, "state", None), "gateway", None)
        if gateway is not None:
            gateway.metrics.connections_closed.labels(reason).inc()


class _CycleTransport:
    """The transport as uvicorn's request cycle sees it: its ``close`` is the
    protocol's :meth:`~GuardedHttpProtocol.close_after_answer` (so an answer sent before
    the request's body closes lingering); the rest is the transport's. The protocol is
    held weakly (it holds the cycle)."""

    __slots__ = ("_protocol", "_transport", "write", "is_closing")

    def __init__(self, protocol: GuardedHttpProtocol) -> None:
        self._protocol = weakref.ref(protocol)
        transport = self._transport = protocol.transport
        self.write = transport.write  # bound once: the cycle's writes cost no extra call
        self.is_closing = transport.is_closing

    def close(self) -> None:
        protocol = self._protocol()
        if protocol is None or protocol.transport is not self._transport:
            self._transport.close()
        else:
            protocol.close_after_answer()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
