"""One OpenAI request answered in the server's protocol
(:mod:`~kvevents.api.server_protocol`): the ASGI ``receive`` and ``send`` the gateway's
handler and its responses use, over the connection's transport, and the handler's run.

Why: the gateway's handler is called from the protocol, in one task, with no uvicorn
cycle, middleware stack or route matching around it; this is what stands in for them.

Lifecycle: made by the protocol when an OpenAI request's head is complete, it takes
uvicorn's cycle's place on the protocol (``cycle``: a pipelined request waits behind it
as behind a cycle; a lost connection marks it ``disconnected``; a shutdown clears its
``keep_alive``) until its answer's last byte, then hands the connection back
(keep-alive, the next pipelined request). Failure: a handler that raises (a bug: it
answers every error itself) is logged; the client gets a 500 in OpenAI's shape if nothing
was sent yet, else its connection is closed.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request

from kvevents.api.http_head import JSON, error_bytes, response_head

log = logging.getLogger(__name__)

__all__ = ["Exchange"]

_FAILED = error_bytes(500, "the gateway failed on this request; see its log", openai=True)


class Exchange:
    """One OpenAI request answered in the protocol: its ``receive`` and ``send`` (the
    ASGI messages the gateway's handler and its responses use) over the protocol's
    transport, and the attributes of uvicorn's cycle that the protocol and the relay read
    (``response_started``, ``response_complete``, ``disconnected``, ``keep_alive``,
    ``chunked_encoding``, ``message_event``).

    The head of an answer is kept until its body's first bytes, and goes out in the same
    write. The relay may frame a streamed answer itself (``relay_frames``): it takes the
    head (:meth:`take_head`) to write with the first chunks, and says when it wrote the
    chunked terminator with the last ones (:meth:`end_written`)."""

    __slots__ = ("protocol", "keep_alive", "response_started", "response_complete",
                 "disconnected", "chunked_encoding", "reading", "body", "_head", "_waiters",
                 "_body_taken", "_gone", "_end_written", "__weakref__")

    relay_frames = True

    def __init__(self, protocol, keep_alive: bool) -> None:
        self.protocol = protocol
        self.keep_alive = keep_alive
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.chunked_encoding: bool | None = None
        self.reading = True  # the body is still arriving
        self.body: list[bytes] = []
        self._head: bytes | None = None  # the answer's head, written with its body
        self._end_written = False  # the relay wrote the chunked terminator
        self._waiters: list[asyncio.Future] = []
        self._gone: list[asyncio.Future] = []  # watch()es waiting for the client to leave
        self._body_taken = False

    # -- what the protocol tells it ----------------------------------------------------------

    @property
    def message_event(self) -> Exchange:
        return self  # uvicorn's connection_lost calls message_event.set()

    def set(self) -> None:
        """Something a waiting ``receive`` waits for happened (body complete, client gone)."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def body_complete(self) -> None:
        self.reading = False
        self.set()

    def lost(self) -> None:
        if not self.response_complete:
            self.disconnected = True
        self.set()
        gone, self._gone = self._gone, []
        for fut in gone:
            if not fut.done():
                fut.set_result(None)

    def watch(self) -> asyncio.Future:
        """A future done when the client has gone (``scope["extensions"][GONE]``)."""
        fut = self.protocol.loop.create_future()
        if self.disconnected:
            fut.set_result(None)
        else:
            self._gone = [f for f in self._gone if not f.done()]  # cancelled ones go
            self._gone.append(fut)
        return fut

    def take_head(self) -> bytes | None:
        """The answer's head, not written yet; the caller writes it (before any body)."""
        head, self._head = self._head, None
        return head

    def end_written(self) -> None:
        """The relay wrote ``0\\r\\n\\r\\n``: the last ``send`` writes no terminator."""
        self._end_written = True

    def take_body(self) -> bytes | None:
        """The whole body if it has arrived and was not taken (then ``receive`` gives it
        no more), without a turn of the event loop; else None (``receive`` it)."""
        if self.reading or self.disconnected or self._body_taken:
            return None
        self._body_taken = True
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        return body

    # -- ASGI ------------------------------------------------------------------------------------

    async def _wait(self) -> None:
        fut = self.protocol.loop.create_future()  # one per call: a cancelled wait is its own
        self._waiters.append(fut)
        await fut

    async def receive(self) -> dict:
        while self.reading and not self.disconnected:
            await self._wait()
        body = self.take_body()
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        while not self.disconnected and not self.response_complete:
            await self._wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message["type"]
        transport = self.protocol.transport
        if kind == "http.response.start":
            assert not self.response_started, "the response has started already"
            self.response_started = True
            # Kept back: written with the body's first bytes.
            self._head, self.chunked_encoding, self.keep_alive = response_head(
                message["status"], self.protocol.server_state.default_headers,
                message.get("headers", ()), self.keep_alive)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        assert self.response_started and not self.response_complete, "no response in progress"
        body, more = message.get("body", b""), message.get("more_body", False)
        if not self.disconnected:
            if self.chunked_encoding:
                out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
                if not more and not self._end_written:
                    out += b"0\r\n\r\n"
            else:
                out = body
            if self._head is not None:
                out, self._head = self._head + out, None
            if out:
                transport.write(out)
        if not more:
            self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        self.set()  # a receive waiting for the client's disconnect: the answer is over
        protocol = self.protocol
        if protocol._ex is self:
            protocol._ex = None
        if not self.keep_alive:
            protocol.close_after_answer()  # lingering if the body is still arriving
        protocol.on_response_complete()

    # -- the handler -------------------------------------------------------------------------------

    async def run(self, gateway, scope: dict, kind: str) -> None:
        """The gateway's handler and its answer; see the module docstring for failure."""
        try:
            response = await gateway.handle(Request(scope, self.receive, self.send), kind)
            await response(scope, self.receive, self.send)
        except Exception:
            log.exception("the gateway failed on a request")
            self._fail()
        except BaseException:
            self._fail()
            raise
        if not self.response_complete:
            self._fail()

    def _fail(self) -> None:
        """The handler ended without a whole answer: a 500 if nothing was sent, else the
        connection closed (the client sees its answer cut short)."""
        if self.response_complete:
            return
        transport = self.protocol.transport
        if (not self.response_started or self._head is not None) and not self.disconnected \
                and not transport.is_closing():  # (a head kept back was never written)
            transport.write(response_head(500, self.protocol.server_state.default_headers, JSON, False,
                                          _FAILED)[0])
        self._head = None
        self.keep_alive = False
        self.response_started = True
        self._complete()
