"""Keep-alive connections to the engines, and one request sent on one of them.

Lifecycle: :class:`UpstreamPool` lives as long as the gateway (:meth:`UpstreamPool.close`
at its end). :meth:`UpstreamPool.send` writes the request on an idle connection (or a new
one) and returns the :class:`~kvevents.gateway.upstream.UpstreamResponse` once the
answer's head arrived; the connection comes back to the pool when that answer is closed
after a clean end (see :mod:`kvevents.gateway.upstream`). The event loop's thread only.

Waiting for the head runs in the caller's task, with no task or ``asyncio.wait`` of its
own: a timer and a callback on the caller's ``abort`` future fail the connection's head
future, so the wait costs no extra turns of the event loop (a request waits for its
engine's head once; a task per wait was a tenth of the gateway's CPU per non-streamed
request). Only opening a new connection runs as a task.

Failure: a connection that cannot be opened raises :class:`UpstreamConnectError`; a
malformed answer, or a connection that closes before the head, raises
:class:`UpstreamProtocolError`; no head within ``timeout_s`` (the connect included) raises
:class:`UpstreamTimeout`; ``abort`` done first (the client left) raises
:class:`UpstreamAborted`. In every one of these cases the connection is closed: the engine
sees it end and drops the request. A pooled connection the engine closed while idle (its
keep-alive timeout) is detected before reuse; if the engine closes it just as the request
goes out (nothing answered), the request is sent once more on a new connection. A
connection whose opening is abandoned is closed when it completes, never handed back
(``asyncio.wait_for`` on Python 3.11 could return it when the cancel landed as the
connect completed, and nobody owned it). A cancelled ``send`` closes its connection.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

from kvevents.gateway.upstream import UpstreamResponse, _Connection
from kvevents.gateway.upstream_errors import (UpstreamAborted, UpstreamConnectError, UpstreamError,
                                              UpstreamProtocolError, UpstreamTimeout)

__all__ = ["UpstreamPool", "retry_reason"]


class UpstreamPool:
    """Keep-alive connections per engine (see the module docstring)."""

    def __init__(self, connect_timeout_s: float = 5.0, max_idle_per_engine: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_engine
        self._idle: collections.defaultdict[tuple, collections.deque[_Connection]] = \
            collections.defaultdict(collections.deque)
        self._targets: dict[str, tuple[tuple, bytes, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target(self, base: str) -> tuple[tuple, bytes, bytes]:
        """(connection key, path prefix, Host header) of an engine URL, parsed once."""
        got = self._targets.get(base)
        if got is None:
            parts = urlsplit(base)
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            host = parts.hostname or ""
            netloc = f"[{host}]" if ":" in host else host
            got = ((host, port, tls), parts.path.rstrip("/").encode(), f"{netloc}:{port}".encode())
            self._targets[base] = got
        return got

    async def _connect(self, key: tuple) -> _Connection:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        made: list[_Connection] = []

        def factory() -> _Connection:
            made.append(_Connection(self, key))
            return made[-1]

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(factory, host, port, ssl=self._ssl if tls else None)
        except BaseException as exc:
            for conn in made:  # opened, but nobody will use it
                conn.close()
            if isinstance(exc, (OSError, TimeoutError)):
                raise UpstreamConnectError(f"cannot connect to {host}:{port}: "
                                           f"{exc or type(exc).__name__}") from None
            raise
        return made[-1]

    async def _connect_within(self, key: tuple, timeout_s: float | None,
                              abort: asyncio.Future | None) -> _Connection:
        """A new connection, unless ``timeout_s`` passes or ``abort`` completes first."""
        opening = asyncio.ensure_future(self._connect(key))
        waits = (opening,) if abort is None else (opening, abort)
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not opening.done():  # given up (or this task cancelled): close what it opens
                opening.cancel()
                opening.add_done_callback(_close_opened)
        if not opening.done():
            if abort is not None and abort.done():
                raise UpstreamAborted("the client left before the engine answered")
            raise UpstreamTimeout(f"no answer within {timeout_s:g} s")
        return opening.result()

    def _pooled(self, key: tuple) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recent: least likely timed out by the engine
            if conn.usable():
                return conn
        return None

    async def send(self, base: str, path: str, body: bytes,
                   headers: list[tuple[bytes | str, bytes | str]],
                   timeout_s: float | None = None, abort: asyncio.Future | None = None,
                   on_way: Callable[[], None] | None = None) -> UpstreamResponse:
        """POST ``body`` to ``base + path`` with ``headers`` (as the client sent them:
        bytes, or latin-1 text); the answer once its head arrived. Raises as the module
        docstring says; ``abort``: a future whose completion ends the wait. ``on_way()``
        is called once, before this call first waits: right after the request is
        written to a pooled connection, else before connecting (a caller's accounting
        then costs the engine no time, and no other request is decided in between)."""
        key, prefix, host = self._target(base)
        head = [b"POST ", prefix, path.encode(), b" HTTP/1.1\r\nhost: ", host,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            head += [_latin1(name), b": ", _latin1(value), b"\r\n"]
        head += [b"\r\n", body]
        request = b"".join(head)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        for attempt in (0, 1):
            conn = self._pooled(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                on_way = _tell(on_way)
                left = None if deadline is None else max(0.0, deadline - loop.time())
                conn = await self._connect_within(key, left, abort)
            resp = conn.start(request)
            try:
                on_way = _tell(on_way)
                await _head(conn, loop, deadline, timeout_s, abort)
                return resp
            except UpstreamProtocolError:
                conn.close()
                # The engine closed an idle connection as the request went out: nothing
                # was answered, so nothing was done; once more on a fresh connection.
                if reused and not conn.got_bytes:
                    continue
                raise
            except BaseException:  # timed out, aborted, cancelled: the answer is moot
                conn.close()
                raise
        raise AssertionError("unreachable")

    def forget(self, keep: set[str]) -> None:
        """Close the idle connections of engines whose URL is not in ``keep``."""
        keys = {self._target(base)[0] for base in keep}
        for key in [k for k in self._idle if k not in keys]:
            for conn in self._idle.pop(key):
                conn.close()
        self._targets = {b: t for b, t in self._targets.items() if b in keep}

    def idle_connections(self) -> int:
        return sum(len(d) for d in self._idle.values())

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _head(conn: _Connection, loop: asyncio.AbstractEventLoop, deadline: float | None,
                timeout_s: float | None, abort: asyncio.Future | None) -> None:
    """Wait for ``conn``'s answer head in the caller's task: the deadline's timer and
    ``abort``'s callback fail the head future instead of racing it with ``asyncio.wait``."""
    ready = conn.headers_ready
    assert ready is not None
    if abort is not None and abort.done():
        raise UpstreamAborted("the client left before the engine answered")

    def expire(error: Exception) -> None:
        if not ready.done():  # (the head may be in, its reader not yet resumed)
            conn.fail(error)

    timer = None if deadline is None else loop.call_at(
        deadline, expire, UpstreamTimeout(f"no answer within {timeout_s:g} s"))

    def aborted(f: asyncio.Future) -> None:
        if not f.cancelled():
            expire(UpstreamAborted("the client left before the engine answered"))

    if abort is not None:
        abort.add_done_callback(aborted)
    try:
        await ready
    finally:
        if timer is not None:
            timer.cancel()
        if abort is not None:
            abort.remove_done_callback(aborted)


def _tell(on_way: Callable[[], None] | None) -> None:
    """Call ``on_way`` if not yet called; the caller keeps the None returned (once only)."""
    if on_way is not None:
        on_way()


def _latin1(text: bytes | str) -> bytes:
    return text if isinstance(text, bytes) else text.encode("latin-1")


def _close_opened(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def retry_reason(upstream: UpstreamResponse | UpstreamError, tried: set[str], engines: int) -> str | None:
    """Why to send a request again to another engine, or None: once at most, and only
    when another of its ``engines`` is left and nothing reached the client yet."""
    if tried or engines < 2:
        return None
    if isinstance(upstream, (UpstreamConnectError, UpstreamProtocolError)):
        return "connect"
    if isinstance(upstream, UpstreamResponse) and upstream.status_code >= 500:
        return "5xx"
    return None
