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

The bytes, two ways (backpressure on both: :mod:`.flow`):

* **direct** (``kvevents serve``: its protocol offers the connection in the request's
  scope, :data:`~.server_ext.DIRECT`): once the server has sent the head, the engine's
  chunked body is written to the client's socket as the engine's connection reads it,
  by compiled code that is that connection's protocol meanwhile
  (:meth:`~kvevents.gateway.upstream.UpstreamResponse.pump_to`): the engine's chunks go
  out as it framed them, one ``write`` per read, with no Python call, coroutine, task
  or ``send`` message per chunk (the pump holds what arrives between the head and this
  relay, and writes it at once). A body that is not chunked goes from the read callback
  through a Python sink, each piece framed as a chunk. The server's ``send`` still
  writes the head and the final chunk, so its view of the response stays whole. A full
  client socket pauses the engine; its draining resumes it;
* **through ``send``** (any other server, or a response the server does not frame as
  chunked): one chunk at a time; the server's ``send`` waits while the client's socket is
  full, and meanwhile the engine's stream buffers at most
  :data:`~kvevents.gateway.flow.HIGH_WATER` bytes before the engine is paused.

Either way the answer's last :data:`USAGE_TAIL` bytes are kept for its usage chunk (a few
operations per chunk), TTFT is taken at its first body byte, and the request is counted
once, at its end.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvevents.gateway.answers import DONE, is_complete
from kvevents.gateway.errors import OpenAIError, error_body
from kvevents.gateway.flow import after_write, follow, unfollow
from kvevents.gateway.server_ext import client_gone, direct_protocol, while_present
from kvevents.gateway.upstream import TAIL_BYTES, UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

USAGE_TAIL = TAIL_BYTES  # bytes of a streamed answer kept to find its usage chunk

__all__ = ["Relay", "USAGE_TAIL", "read_whole"]


async def read_whole(request: Request, upstream: UpstreamResponse, engine: str,
                     timeout_s: float) -> bytes | OpenAIError:
    """An answer's whole body, read while watching the client: the error to answer
    instead when the client left (499), the engine gave no answer within ``timeout_s``
    (504) or broke it off (502). The caller closes ``upstream`` (the engine then sees a
    request it answers for nobody end)."""
    read = asyncio.ensure_future(upstream.aread())
    how = await while_present(read, request.scope, request.receive, timeout_s)
    if how != "done":
        return (OpenAIError(499, "client closed the request") if how == "gone" else
                OpenAIError(504, f"engine {engine} gave no answer within {timeout_s:g} s"))
    if read.exception() is not None:
        return OpenAIError(502, f"engine {engine} broke off its answer: {read.exception()}")
    return read.result()


class Relay(Response):
    """See the module docstring. ``on_first()``: the first body byte arrived (TTFT);
    ``on_end(status, tail)``: the status to count (499: the client left first, 502: the
    engine broke off) and the answer's last :data:`USAGE_TAIL` bytes. ``ends``: the
    endpoint's end markers (see :func:`~.answers.is_complete`)."""

    def __init__(self, upstream: UpstreamResponse, headers: dict[str, str], engine: str,
                 on_first: Callable[[], None], on_end: Callable[[int, bytes], None],
                 ends: tuple[bytes, ...] = DONE) -> None:
        self.upstream = upstream
        self.ends = ends
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers(headers)
        self.engine = engine
        self._on_first = on_first
        self._on_end: Callable[[int, bytes], None] | None = on_end
        self._cut = False  # the client got part of a chunk the engine never finished

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
        gone = client_gone(scope, receive)
        # The client gone: close the engine's stream now, wherever the relay waits.
        gone.add_done_callback(lambda f: None if f.cancelled() else up.close())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            protocol = direct_protocol(scope)
            if protocol is not None:
                tail = await self._direct(protocol)
            else:
                tail = await self._through(send, gone)
            # An engine that broke off after its [DONE] had written its whole answer: the
            # client has it, so its stream ends as a whole one does (nothing after [DONE]).
            broke = up.error is not None and not is_complete(tail, self.ends)
            if broke and not gone.done() and self._cut:
                # The engine broke off inside a chunk that was partly sent: nothing can
                # follow it in the stream; the client sees its answer cut short.
                status = 502
                log.warning("engine %s broke off a streamed answer: %s", self.engine, up.error)
                protocol.transport.close()
                return
            if broke and not gone.done():
                # The engine broke off: say so in the stream, in OpenAI's shape (the
                # official client raises on it), instead of ending as if complete.
                status = 502
                log.warning("engine %s broke off a streamed answer: %s", self.engine, up.error)
                await send({"type": "http.response.body", "more_body": True, "body": b"data: " + error_body(
                    502, f"engine {self.engine} broke off its answer: {up.error}") + b"\n\n"})
            if gone.done():
                if not is_complete(tail, self.ends):
                    status = 499
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException:  # cancelled, or the server's send failed: the client is gone
            if not is_complete(tail, self.ends):
                status = 499
            raise
        finally:
            gone.cancel()
            self._end(status, tail)

    async def _through(self, send: Send, gone: asyncio.Future) -> bytes:
        """The body through the server's ``send``, chunk by chunk; its last bytes."""
        tail = b""
        first = True
        try:
            async for chunk in self.upstream.aiter_raw():
                if first:
                    self._on_first()
                    first = False
                tail = (tail + chunk)[-USAGE_TAIL:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if gone.done():
                    break
        except UpstreamError:
            pass  # the engine broke off, or the client left: the caller tells which
        return tail

    async def _direct(self, protocol) -> bytes:
        """The body written to the client's socket as the engine's connection reads it
        (see the module docstring); its last bytes, once the answer ended."""
        up = self.upstream
        transport, flow = protocol.transport, protocol.flow
        ended = asyncio.get_running_loop().create_future()

        def end() -> None:
            if not ended.done():
                ended.set_result(None)

        # A server that lets the relay frame the answer (kvevents' own protocol) has kept
        # the head back: it goes out with the body's first bytes, and the pump ends the
        # answer with its last chunks. Two writes fewer per answer.
        cycle = protocol.cycle
        frames = getattr(cycle, "relay_frames", False)
        head = cycle.take_head() if frames else None
        pump = up.pump_to(transport, flow, self._on_first, end, head, frames)
        if pump is not None:
            follow(protocol, pump.resume)
            try:
                await ended
            finally:
                unfollow(protocol)
            self._cut = pump.mid_chunk
            if pump.wrote_end:
                cycle.end_written()
            return up.tail()
        if head is not None and not transport.is_closing():
            transport.write(head)
        kept: collections.deque[bytes] = collections.deque()
        size = 0

        def sink(data: bytes) -> None:
            nonlocal size
            if not kept:
                self._on_first()
            if not transport.is_closing():  # (closed before the server saw it: raises)
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                after_write(flow, up)
            kept.append(data)
            size += len(data)
            while size - len(kept[0]) >= USAGE_TAIL:
                size -= len(kept.popleft())

        follow(protocol, up.resume_reading)
        try:
            up.relay_to(sink, end)
            await ended
        finally:
            unfollow(protocol)
        return b"".join(kept)
