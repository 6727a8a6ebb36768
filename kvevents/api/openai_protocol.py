"""uvicorn's HTTP/1.1 protocol with the OpenAI requests (``POST`` to each path of
:data:`kvevents.gateway.endpoints.ENDPOINTS`: chat completions, completions, responses,
embeddings, tokenize, detokenize) handed to the gateway from the protocol itself, for
``kvevents serve``.

Why: a proxied request is the gateway's unit of work, and around the gateway's own
handler the server spent a large part of its CPU per request on the framework: uvicorn's
request cycle (its task, the ASGI message dicts), the app's middleware stack (eight
layers, each wrapping ``receive`` and ``send`` again), route matching and Starlette's
request/response wrapper. Here the request is read in the protocol's callbacks and
:meth:`Gateway.handle <kvevents.gateway.Gateway.handle>` is called directly, in one task,
with this connection as its ``receive``/``send`` (:class:`Exchange`): the same handler,
answers, errors and accounting as through the app, and a streamed answer still goes
straight from the engine's connection to this socket (:mod:`kvevents.gateway.relay`).

What is handled here: those paths (exact, no query) by ``POST``, over HTTP/1.1, with
a ``Content-Length`` within the body limit (``max_body_bytes``), without
``Expect: 100-continue``, on a connection with no response of its own in progress, once
the app is started. Anything else goes to the app exactly as before (a chunked body, an
oversized one: its 413, ...). The handler starts when the head is complete, as uvicorn's
cycle would: it takes its slot (``max_inflight``) before the body arrives, and a client
that leaves mid-upload is its 499. The answer's head carries uvicorn's default headers
(``server``, ``date``); a non-streamed answer goes out in one write.

Lifecycle: one instance per connection, made by uvicorn (:func:`protocol_class
<kvevents.api.server_protocol.protocol_class>` makes the class for one app). An
:class:`Exchange` takes uvicorn's cycle's place on the protocol (``cycle``: a pipelined
request waits behind it as behind a cycle; a lost connection marks it ``disconnected``;
a shutdown clears its ``keep_alive``) until its answer's last byte, then hands the
connection back (keep-alive, the next pipelined request). Failure: a handler that raises
(a bug: it answers every error itself) is logged; the client gets a 500 in OpenAI's
shape if nothing was sent yet, else its connection is closed.
"""

from __future__ import annotations

import asyncio
import http
import logging
import weakref

from starlette.requests import Request

from kvevents.api.lookup_protocol import LookupHttpProtocol
from kvevents.gateway.errors import error_body
from kvevents.gateway.endpoints import ENDPOINTS
from kvevents.gateway.server_ext import BODY, DIRECT, GONE

log = logging.getLogger(__name__)

PATHS = {row.path.encode(): row.kind for row in ENDPOINTS.values()}
_STATUS: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b""
        line = _STATUS[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


class OpenAIHttpProtocol(LookupHttpProtocol):
    """See the module docstring; made per app by ``protocol_class``."""

    openai_app = None
    #: The OpenAI request answered here (from its head to its answer's last byte).
    _ex: Exchange | None = None

    def on_headers_complete(self) -> None:
        kind = PATHS.get(self.url)
        if kind is None or not self._take(kind):
            super().on_headers_complete()

    def _take(self, kind: str) -> bool:
        """Start the gateway's handler for this request here; False: the app answers."""
        parser = self.parser
        if (parser.get_method() != b"POST" or self.expect_100_continue or parser.should_upgrade()
                or parser.get_http_version() != "1.1"
                or not (self.cycle is None or self.cycle.response_complete)):
            return False
        state = self.openai_app.state
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
        self._held = None  # (the lookup path's: not this request)
        self._head_done()
        scope = self.scope
        scope["method"] = "POST"
        scope["path"] = self.url.decode("ascii")
        scope["raw_path"] = self.url
        scope["query_string"] = b""
        ex = self._ex = Exchange(self, parser.should_keep_alive())
        scope["extensions"] = {DIRECT: (weakref.ref(self), weakref.ref(ex)), GONE: ex.watch,
                               BODY: ex.take_body}
        self.cycle = ex
        task = self.loop.create_task(ex.run(gateway, scope, kind))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        return True

    def on_body(self, body: bytes) -> None:
        ex = self._ex
        if ex is not None and ex.reading:
            ex.body.append(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        ex = self._ex
        if ex is not None and ex.reading:
            self._message_done()
            ex.body_complete()
            return
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        ex = self._ex
        if ex is not None:  # (a pipelined request may have taken ``cycle`` since)
            ex.lost()
        super().connection_lost(exc)


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

    def __init__(self, protocol: OpenAIHttpProtocol, keep_alive: bool) -> None:
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
            out = [_status_line(message["status"])]
            for name, value in self.protocol.server_state.default_headers:
                out += (name, b": ", value, b"\r\n")
            chunked = True
            for name, value in message.get("headers", ()):
                lname = name.lower()
                if lname == b"content-length":
                    chunked = False
                elif lname == b"connection" and value.lower() == b"close":
                    self.keep_alive = False
                out += (name, b": ", value, b"\r\n")
            if chunked:
                out.append(b"transfer-encoding: chunked\r\n")
            if not self.keep_alive:
                out.append(b"connection: close\r\n")
            out.append(b"\r\n")
            self.chunked_encoding = chunked
            self._head = b"".join(out)  # written with the body's first bytes
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
            body = error_body(500, "the gateway failed on this request; see its log")
            transport.write(b"%scontent-type: application/json\r\ncontent-length: %d\r\n"
                            b"connection: close\r\n\r\n%s" % (_status_line(500), len(body), body))
        self._head = None
        self.keep_alive = False
        self.response_started = True
        self._complete()
