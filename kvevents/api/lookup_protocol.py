"""uvicorn's HTTP/1.1 protocol with the common ``POST /v1/lookup`` answered in the
protocol itself, for ``kvevents serve``.

Why: a lookup is the request routers send most, and the index answers it in tens of
microseconds, yet through uvicorn's ASGI cycle (a scope, a task, the message dicts, the
app's middleware stack, headers and body written as two packets) the server spent about
160 us of CPU per 2,048-token lookup on the 2-core VM, of which ~65 us were uvicorn's
cycle alone (a raw httptools protocol answering the same request: ~45 us; uvicorn with a
bare ASGI app: ~110 us). Here the body is read and answered in the protocol's own
callbacks, in one write.

What is answered here: ``POST /v1/lookup`` (exact path, no query) on a connection with
no request of its own in flight, without ``Expect: 100-continue``, whose body
:func:`~kvevents.api.fastpath.common_lookup` reads (the common shape, within the body
and prompt limits), once the app is started, and only when the index lock is free within
the event loop's bound (:func:`~kvevents.routing.offloop.lookup_now`). Everything else
goes to the app exactly as it would have: uvicorn's own request cycle is started late,
with the body received so far, so the app's route stays the reference for the semantics
and answers every error (a body past the size limit is handed over the moment it
passes it, not held). The answer is the route's: the same lookup (timed into the same
metrics), payload and encoding, with uvicorn's default headers.

Lifecycle: one instance per connection, made by uvicorn
(:func:`kvevents.api.server_protocol.protocol_class` returns the class for one app, this
one or its OpenAI subclass). It relies on these parts of uvicorn's ``HttpToolsProtocol``:
the parser callbacks, ``on_response_complete``, ``shutdown`` and the per-request
attributes ``parser``, ``url``, ``cycle``, ``expect_100_continue``, ``transport`` and
``server_state``; :func:`uvicorn_fits` is false when the installed uvicorn lacks
one of the methods (``kvevents serve`` then runs uvicorn's own protocol and the ASGI
fast path still answers), and the tests run against the installed uvicorn.
"""

from __future__ import annotations

import logging

from kvevents.api.conn_guard import GuardedHttpProtocol, HttpToolsProtocol
from kvevents.api.fastpath import common_lookup, encode_answer
from kvevents.routing.offloop import lookup_now

log = logging.getLogger(__name__)

_PATH = b"/v1/lookup"
_HEAD = b"HTTP/1.1 200 OK\r\n"
_TYPE = b"content-type: application/json\r\ncontent-length: "
_USED = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
         "shutdown", "data_received")


def uvicorn_fits() -> bool:
    """Whether the installed uvicorn's protocol has what the protocols here rely on."""
    if HttpToolsProtocol is None or not all(hasattr(HttpToolsProtocol, n) for n in _USED):
        log.warning("uvicorn's httptools protocol is not the expected one: lookups and "
                    "OpenAI requests go through the ASGI app")
        return False
    return True


class LookupHttpProtocol(GuardedHttpProtocol):
    """See the module docstring; made per app by ``protocol_class``. Its connections
    have :class:`~kvevents.api.conn_guard.GuardedHttpProtocol`'s timeouts and cap; a
    lookup held here marks its head and body done for them as uvicorn's cycle would."""

    lookup_app = None
    #: The body of a lookup being held here, as it came (None: the request is uvicorn's);
    #: a list, not a bytearray: a body in one piece is then read without a copy.
    _held: list[bytes] | None = None
    _held_size = 0
    #: The aggregator answering the held lookup.
    _agg = None
    #: The server asked to shut down while a held lookup was arriving.
    _close_after = False

    def on_headers_complete(self) -> None:
        if (self.url == _PATH and self.lookup_app is not None and self.parser.get_method() == b"POST"
                and not self.expect_100_continue and not self.parser.should_upgrade()
                and (self.cycle is None or self.cycle.response_complete)):
            self._agg = getattr(self.lookup_app.state, "aggregator", None)
            if self._agg is not None:  # else the app is not started: it answers
                self._held, self._held_size = [], 0
                self._head_done()
                return
        self._held = None
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        held = self._held
        if held is None:
            super().on_body(body)
            return
        held.append(body)
        self._held_size += len(body)
        if self._held_size > self._agg.settings.max_body_bytes:
            self._to_app(more=True)  # the app refuses it as it arrives

    def on_message_complete(self) -> None:
        held = self._held
        if held is None:
            super().on_message_complete()
            return
        self._message_done()
        try:
            answer = self._answer(b"".join(held))  # one piece: that piece, not a copy
        except Exception:  # a fault here must still get the app's error answer
            log.exception("lookup in the protocol failed; the app answers it")
            answer = None
        if answer is None:
            self._to_app(more=False)
            return
        self._held = None
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        out = [_HEAD]
        for name, value in self.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        if not keep_alive or self._close_after:
            out.append(b"connection: close\r\n")
        out += (_TYPE, b"%d\r\n\r\n" % len(answer), answer)
        self.transport.write(b"".join(out))
        if not keep_alive or self._close_after:
            self.transport.close()
        self.on_response_complete()

    def shutdown(self) -> None:
        if self._held is not None:
            self._close_after = True  # answer the lookup that is arriving, then close
            return
        super().shutdown()

    def _answer(self, raw: bytes) -> bytes | None:
        """The answer, or None for the app: another body, a limit, or the index lock
        busy past the loop's bound (the app's route then waits for it off the loop)."""
        agg = self._agg
        got = common_lookup(raw, agg.settings.max_prompt_tokens)
        if got is None:
            return None
        result = lookup_now(agg, *got, "lookup")
        return None if result is None else encode_answer(agg, result)

    def _to_app(self, *, more: bool) -> None:
        """Start uvicorn's own cycle for this request now, with the body held so far
        (``more``: the rest is still arriving and goes to it as usual)."""
        held, self._held = self._held, None
        super().on_headers_complete()
        if held:
            super().on_body(b"".join(held))
        if not more:
            super().on_message_complete()
        if self._close_after:
            super().shutdown()

