"""What the gateway may ask of the HTTP server beyond ASGI: three scope extensions, and
the functions that use each one when the server offers it and plain ASGI when it does not.

Why: per request, plain ASGI costs the gateway a task to watch for the client's
disconnect, a turn of the event loop to read a body the server already holds, and a
``send`` message per streamed chunk. ``kvevents serve``'s protocol
(:mod:`kvevents.api.server_protocol`) offers a cheaper way for each; under any other
server the same code runs on ASGI alone, with the same answers.

The extensions, in ``scope["extensions"]``:

* :data:`DIRECT`: the connection, for writing a streamed body straight to the client's
  socket (:func:`direct_protocol` says whether this response may; backpressure on that
  path: :mod:`.flow`);
* :data:`GONE`: ``watch()``, a new future done when the client has gone (no task per
  watch; :func:`client_gone`);
* :data:`BODY`: ``take_body()``, the request's whole body if it has all arrived
  (:func:`body_now`).

Lifecycle: the server puts them in the scope when the request's head is in; they are
valid for that request only (``DIRECT`` holds weak references, so a finished connection
is not kept alive by a scope that outlives it). Failure: none raise; a server that
offers none is served through ``receive`` and ``send``.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope

#: The scope extension under which the server's protocol offers the connection: weak
#: references to ``(protocol, cycle)``, uvicorn's ``HttpToolsProtocol`` (with
#: ``on_writable``, see :mod:`.flow`) and the request's cycle (see :func:`direct_protocol`).
DIRECT = "kvevents.direct"
#: The scope extension under which a server offers ``watch()``: a new future, done when
#: the client has gone (see :func:`client_gone`).
GONE = "kvevents.gone"
#: The scope extension under which a server offers ``take_body()``: the request's whole
#: body if it has all arrived (taken: ``receive`` will not give it again), else None.
BODY = "kvevents.body"

__all__ = ["BODY", "DIRECT", "GONE", "body_now", "client_gone", "direct_protocol", "while_present"]


def client_gone(scope: Scope, receive: Receive) -> asyncio.Future:
    """A future done when the client goes away (its body was already read): the
    server's own watch when it offers one (:data:`GONE`), else a task reading
    ``receive`` until ``http.disconnect``. Cancel it when done with it."""
    watch = scope.get("extensions", {}).get(GONE)
    if watch is not None:
        return watch()
    return asyncio.ensure_future(_disconnected(receive))


async def while_present(waited: asyncio.Future, scope: Scope, receive: Receive, timeout_s: float) -> str:
    """Wait for ``waited`` while the client stays: ``"done"``, or ``"gone"`` (the client
    left) or ``"timeout"`` (``timeout_s`` passed), ``waited`` then cancelled."""
    gone = client_gone(scope, receive)
    try:
        done, _ = await asyncio.wait((waited, gone), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if waited in done:
        return "done"
    waited.cancel()
    return "gone" if gone in done else "timeout"


def body_now(scope: Scope) -> bytes | None:
    """The request's body if the server holds it whole already (:data:`BODY`: no async
    generator and turn of the loop to read it), else None (read it with ``receive``)."""
    take = scope.get("extensions", {}).get(BODY)
    return None if take is None else take()


def direct_protocol(scope: Scope):
    """The connection the server offers for writing this response's body straight to the
    socket (:data:`DIRECT`), if it offers one, its request cycle is this one, the head has
    been sent and it frames the response as chunked (what a direct relay writes); else
    None (the body goes through ``send``)."""
    got = scope.get("extensions", {}).get(DIRECT)
    if got is None:
        return None
    protocol, cycle = got[0](), got[1]()
    if protocol is None or cycle is None:
        return None
    if (getattr(cycle, "response_started", False) and getattr(cycle, "chunked_encoding", None) is True
            and not cycle.response_complete and not cycle.disconnected
            and getattr(protocol, "cycle", None) is cycle and hasattr(protocol, "on_writable")):
        return protocol
    return None


async def _disconnected(receive: Receive) -> None:
    """Returns when the client goes away (its body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
