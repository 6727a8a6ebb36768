"""A streamed answer relayed from an engine to the client, as one ASGI response that
owns the engine's stream from the moment the gateway has its headers to its last byte.

Why not Starlette's ``StreamingResponse`` around a generator: it watches for the
client's disconnect in a task of its own and, when the client has left before the first
chunk, cancels the stream before the generator ever ran, so the generator's ``finally``
(which closed the engine's stream and released the request's slot) never ran either: the
engine went on answering nobody, and the slot was given back the moment the handler
returned the response, before any byte was sent.

Here one watcher task per request (not per chunk) waits for the client's
``http.disconnect``; when it comes, the engine's stream is closed at once from the
watcher's callback (vLLM aborts the request), which also wakes the relay wherever it
waits (for the engine's next bytes, or for the client's socket to drain). However the
relay ends (the answer's end, the client gone, the engine broken off, cancelled), its
``on_end(status, tail)`` runs exactly once: the engine's stream is closed, the request's
slot and load are released and it is counted. A relay that is dropped without ever being
sent (its request task cancelled in between) is closed by its finaliser.

Backpressure: one chunk at a time goes to the client; the server's ``send`` waits while
the client's socket is full, and meanwhile the engine's stream buffers at most
:data:`~kvevents.gateway.upstream._HIGH_WATER` bytes before the engine is paused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvevents.gateway.answers import is_complete
from kvevents.gateway.errors import error_body
from kvevents.gateway.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

USAGE_TAIL = 16384  # bytes of a streamed answer kept to find its usage chunk

__all__ = ["Relay", "USAGE_TAIL"]


class Relay(Response):
    """See the module docstring. ``on_first()``: the first body byte arrived (TTFT);
    ``on_end(status, tail)``: the status to count (499: the client left first, 502: the
    engine broke off) and the answer's last :data:`USAGE_TAIL` bytes."""

    def __init__(self, upstream: UpstreamResponse, headers: dict[str, str], engine: str,
                 on_first: Callable[[], None], on_end: Callable[[int, bytes], None]) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.engine = engine
        self._on_first = on_first
        self._on_end: Callable[[int, bytes], None] | None = on_end

    def _end(self, status: int, tail: bytes) -> None:
        end, self._on_end = self._on_end, None
        self.upstream.close()
        if end is not None:
            end(status, tail)

    def __del__(self) -> None:
        # Never sent (the request's task was cancelled between the handler and the send):
        # close the engine's stream and release the request on the loop, not inside a
        # finaliser (the metrics take locks a finaliser may interrupt).
        if self._on_end is not None:
            try:
                asyncio.get_running_loop().call_soon(self._end, 499, b"")
            except RuntimeError:  # no loop any more: at least close the stream
                self.upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        up = self.upstream
        status = up.status_code
        tail = b""
        gone = asyncio.ensure_future(_disconnected(receive))
        # The client gone: close the engine's stream now, wherever the relay waits.
        gone.add_done_callback(lambda f: None if f.cancelled() else up.close())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            first = True
            try:
                async for chunk in up.aiter_raw():
                    if first:
                        self._on_first()
                        first = False
                    tail = (tail + chunk)[-USAGE_TAIL:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if gone.done():
                        break
            except UpstreamError as exc:
                if not gone.done():
                    # The engine broke off: say so in the stream, in OpenAI's shape (the
                    # official client raises on it), instead of ending as if complete.
                    status = 502
                    log.warning("engine %s broke off a streamed answer: %s", self.engine, exc)
                    await send({"type": "http.response.body", "more_body": True, "body": b"data: " + error_body(
                        502, f"engine {self.engine} broke off its answer: {exc}") + b"\n\n"})
            if gone.done():
                if not is_complete(tail):
                    status = 499
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException:  # cancelled, or the server's send failed: the client is gone
            if not is_complete(tail):
                status = 499
            raise
        finally:
            gone.cancel()
            self._end(status, tail)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client goes away (its body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
