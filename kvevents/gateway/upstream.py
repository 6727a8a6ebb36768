"""The gateway's HTTP/1.1 client to the engines: one request on a pooled keep-alive
connection, its answer streamed back as the engine sends it.

Why not ``httpx`` on this path: per proxied request its client stack (URL and header
models, the connection pool's state machine, anyio streams, ``h11``) took about half of
the event loop's time, which every request pays as latency and which ingest and every
other request wait behind. This client does only what the gateway needs: a POST with a
body, the status, the headers, and the body as it comes. The engine's answer is parsed
by ``httptools`` (llhttp, compiled: the parser uvicorn uses), the request is written in
one ``write``. ``httpx`` stays for the rest (``/metrics`` polls, ``/tokenize``,
``/v1/models``).

Lifecycle: :class:`~kvevents.gateway.pool.UpstreamPool` (the connections, and sending a
request on one) returns an :class:`UpstreamResponse` once the answer's head arrived; its
body is read with :meth:`~UpstreamResponse.aiter_raw` or :meth:`~UpstreamResponse.aread`,
taken whole if it is in already (:meth:`~UpstreamResponse.body_now`), handed to a
callback (:meth:`~UpstreamResponse.relay_to`), or, chunked, written on to the client's
socket in compiled code (:meth:`~UpstreamResponse.pump_to`: the engine's transport is
then read by a :class:`~kvevents.gateway._pump.ChunkPump` until the answer's end), and
:meth:`~UpstreamResponse.aclose` must follow (always: it returns a connection whose
answer ended cleanly to the pool, and closes any other). The event loop's thread only.

Failure: an answer that is malformed, or a connection that closes before the answer's
end, is :class:`UpstreamProtocolError` (from the pool's ``send`` before the head, from
reading the body after). Timeouts of the body are the caller's (``asyncio.wait`` or
``asyncio.timeout`` around the reads); a cancelled read closes its connection.
:meth:`UpstreamResponse.close` (sync) closes the engine's stream at once and wakes a
reader waiting for more.

Memory: at most :data:`~kvevents.gateway.flow.HIGH_WATER` bytes of an answer are
buffered before reading from the engine pauses (a client that reads slowly pauses the
engine, not the gateway's RSS); the whole backpressure story is :mod:`kvevents.gateway.flow`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Any

import httptools

from kvevents.gateway._pump import ChunkPump
from kvevents.gateway.flow import HIGH_WATER, LOW_WATER
from kvevents.gateway.upstream_errors import (UpstreamAborted, UpstreamClosed, UpstreamConnectError,
                                              UpstreamError, UpstreamProtocolError, UpstreamTimeout)

__all__ = ["UpstreamAborted", "UpstreamClosed", "UpstreamConnectError", "UpstreamError",
           "UpstreamProtocolError", "UpstreamResponse", "UpstreamTimeout"]

#: The last bytes of a pumped body kept (the relay finds the usage chunk in them).
TAIL_BYTES = 16384


class UpstreamResponse:
    """An engine's answer: status and headers now, the body as it arrives."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: UpstreamError | None = None
        self._wakeup: asyncio.Future | None = None
        self._closed = False
        self._sink: Callable[[bytes], None] | None = None  # see relay_to
        self._pump: ChunkPump | None = None  # see pump_to
        self._dirty = False  # bytes came after the answer's end: not reusable
        self._on_end: Callable[[], None] | None = None

    # -- fed by the connection -------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self, error: UpstreamError | None = None) -> None:
        if error is None:
            self._complete = True
        elif not self._complete and self._error is None:  # the first cause stands
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        if self._on_end is not None and (self._complete or self._error is not None or self._closed):
            end, self._on_end = self._on_end, None
            end()

    # -- read by the gateway ---------------------------------------------------------------

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked transfer decoded, content untouched)."""
        self._unhold()
        while True:
            if self._closed:
                if self._complete:
                    return
                raise self._error or UpstreamClosed("the answer was closed")
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered < LOW_WATER:
                    self._conn.resume()
                yield data
                continue
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
            self._wakeup = None

    def relay_to(self, sink: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        """Hand the body to ``sink`` piece by piece as the connection reads it (what is
        buffered already first, at once), instead of to :meth:`aiter_raw`, and call
        ``on_end()`` once when the answer ends (complete, broken off: see :attr:`error`,
        or closed). ``sink`` runs in the connection's read callback: it must not raise;
        it applies backpressure with :meth:`pause_reading` / :meth:`resume_reading`."""
        self._unhold()
        self._buffered = 0
        self._conn.resume()  # (nothing arrives before this returns: the sink may pause it)
        while self._chunks:
            sink(self._chunks.popleft())
        self._sink = sink
        self._on_end = on_end
        self._wake()  # already ended: on_end now

    def pump_to(self, client: asyncio.Transport, flow, on_first: Callable[[], None],
                on_end: Callable[[], None], head: bytes | None = None,
                finish: bool = False) -> ChunkPump | None:
        """Hand the body to its :class:`~kvevents.gateway._pump.ChunkPump`, which writes
        the engine's chunks to ``client`` as they are read, framed as the engine framed
        them, in compiled code (what it kept since the head first, in one write), pausing
        the engine while ``flow.write_paused``; ``on_first()`` once the body has started,
        ``on_end()`` once when the answer ends (see :attr:`error`); :meth:`tail` then
        holds its last :data:`TAIL_BYTES`. The pump's :meth:`~ChunkPump.resume` restarts
        the engine when the client's socket drains. ``head`` and ``finish``: see
        :meth:`ChunkPump.start`. None (nothing changed, nothing written: use
        :meth:`relay_to`) unless the body is chunked and not read another way."""
        pump = self._pump
        if pump is None or not pump.holding or self._closed:  # (read another way: no pump)
            return None
        self._on_end = on_end
        pump.start(client, flow, on_first, head, finish)
        self._wake()  # already ended: on_end now
        return pump

    async def peek(self, marker: bytes, limit: int) -> bytes:
        """The body's first bytes, left unread, once they hold ``marker`` or ``limit``
        bytes or the answer ended: for a reader that must see a stream's first event
        before relaying it (the body is then read by the parser, not pumped)."""
        self._unhold()
        while True:
            head = b"".join(self._chunks)
            if (marker in head or len(head) >= limit or self._complete or self._closed
                    or self._error is not None):
                return head
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
            self._wakeup = None

    def _unhold(self) -> None:
        """The body read another way than pumped: what the pump kept goes through the
        connection's parser, and the connection reads again."""
        pump = self._pump
        if pump is not None and pump.holding:
            self._pump = None
            self._dirty = pump.extra > 0
            self._conn.unpump(pump.raw())

    def _pumped(self, error: str | None) -> None:
        self._finish(None if error is None else UpstreamProtocolError(error))

    def tail(self) -> bytes:
        """The last bytes of a pumped body (see :meth:`pump_to`)."""
        return b"" if self._pump is None else self._pump.tail()

    @property
    def error(self) -> UpstreamError | None:
        """Why the answer ended before its end (None: it did not, or not yet)."""
        return None if self._complete else self._error

    def pause_reading(self) -> None:
        """Stop reading the engine (the client's socket is full)."""
        self._conn.pause()

    def resume_reading(self) -> None:
        self._conn.resume()

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.aiter_raw()])

    def body_now(self) -> bytes | None:
        """The whole body if the answer has ended cleanly and none of it was read yet,
        without a turn of the event loop; else None (read it with :meth:`aread`)."""
        self._unhold()
        if not self._complete or self._closed or self._sink is not None:
            return None
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return body

    async def aclose(self) -> None:
        """Done with the answer (see :meth:`close`)."""
        self.close()

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer
        ended cleanly and was read whole and the engine keeps it alive; else it is closed
        now (the engine sees the connection end and aborts the request), and a reader
        waiting for more gets :class:`UpstreamClosed`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        reuse = (self._complete and not self._chunks and not self._dirty
                 and (self._pump is None or not self._pump.extra))
        self._chunks.clear()
        self._buffered = 0
        if not self._complete and self._error is None:
            self._error = UpstreamClosed("the answer was closed before its end")
        self._wake()
        self._conn.release(reuse=reuse)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one engine, one request at a time."""

    def __init__(self, pool: Any, key: tuple) -> None:  # (pool.UpstreamPool: its idle lists)
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers_ready: asyncio.Future | None = None
        self.got_bytes = False  # any byte of the current answer
        self.keep_alive = True
        self.closed = False
        self._paused = False
        self.pump: ChunkPump | None = None  # the transport's protocol while a body is pumped
        # The last 3 bytes read while the answer's head arrives (None: the head is in):
        # its end, CRLF CRLF, may straddle two reads.
        self._head_tail: bytes | None = b""

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._head_tail is not None:
            # The head goes to the parser alone: a chunked body is then the pump's, from
            # its first byte (the parser would hand it over a Python call per chunk).
            probe = self._head_tail + data
            end = probe.find(b"\r\n\r\n")
            if end < 0:
                self._head_tail = probe[-3:]
            else:
                cut = end + 4 - len(self._head_tail)
                self._parse(data[:cut])
                data = data[cut:]
                if self._hold():
                    if data:
                        self.pump.data_received(data)
                    return
                if not data:
                    return
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamProtocolError(f"malformed answer: {exc}"))
            self.close()

    def _hold(self) -> bool:
        """The head is in: a chunked body of a 2xx/3xx answer goes to a pump, which holds
        it until :meth:`UpstreamResponse.pump_to` gives it the client (or
        :meth:`unpump` hands it back to the parser)."""
        resp = self.response
        if (resp is None or self.closed or self.transport is None or not 200 <= resp.status_code < 400
                or resp.headers.get("transfer-encoding", "").strip().lower() != "chunked"):
            return False
        self.keep_alive = self.parser.should_keep_alive()
        resp._pump = self.pump = ChunkPump(None, None, None, resp._pumped, self.connection_lost,
                                           TAIL_BYTES, HIGH_WATER)
        self.pump.attach(self.transport)
        return True

    def unpump(self, raw: bytes) -> None:
        """Back from a holding pump: this protocol reads again, and ``raw`` (the body so
        far) goes through the parser."""
        self.pump = None
        if not self.closed and self.transport is not None and not self.transport.is_closing():
            self.transport.set_protocol(self)
            self.transport.resume_reading()
            self._paused = False
        if raw:
            self._parse(raw)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if (exc is None and resp is not None and resp.status_code and "content-length" not in
                resp.headers and "transfer-encoding" not in resp.headers):
            resp._finish()  # an answer delimited by the connection's end (HTTP/1.0 style)
            return
        self.fail(UpstreamProtocolError("the engine closed the connection before the end of "
                                         f"its answer{f': {exc}' if exc else ''}"))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.status_code = self.parser.get_status_code()
        self._head_tail = None
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.response is not None:
            self.response._finish()

    # -- the pool's side -------------------------------------------------------------------------

    def fail(self, error: UpstreamError) -> None:
        """The current answer ends with ``error`` (its head, if still awaited, too)."""
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(error)
        if self.response is not None:
            self.response._finish(error)

    def start(self, request: bytes) -> UpstreamResponse:
        self.response = UpstreamResponse(self)
        self._head_tail = b""
        self.headers_ready = asyncio.get_running_loop().create_future()
        self.got_bytes = False
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(request)
        return self.response

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def release(self, reuse: bool) -> None:
        self.response = None
        self.headers_ready = None
        if self.pump is not None:
            self.pump = None
            if self.transport is not None and not self.closed:
                self.transport.set_protocol(self)  # the answer is over: this reads again
                self.transport.resume_reading()  # (the pump may have paused it at the end)
                self._paused = False
        if reuse and self.keep_alive and self.usable():
            self.resume()
            idle = self.pool._idle[self.key]
            idle.append(self)
            if len(idle) > self.pool.max_idle:
                idle.popleft().close()
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True
