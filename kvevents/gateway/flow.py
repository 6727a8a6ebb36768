"""Flow control of a proxied answer, from the engine's socket to the client's: the
watermarks and the rules that pause and resume the engine, in one place.

The bytes of an answer pass four stages; each one that can fill stops the one before:

1. **engine socket**: the engine's connection (:mod:`.upstream`) reads it while nothing
   downstream is full. Paused, the kernel's receive buffer fills and TCP slows the
   engine; nothing more is held in the process.
2. **answer buffer** (:class:`~.upstream.UpstreamResponse`): a body read by awaiting
   each piece (through ASGI ``send``, or whole) is buffered; past :data:`HIGH_WATER`
   bytes reading from the engine pauses, and resumes once the reader has taken it below
   :data:`LOW_WATER`. A chunked body held by the compiled pump before the client is
   known (:class:`~kvevents.gateway._pump.ChunkPump`, "hold" mode) is bounded the same:
   past :data:`HIGH_WATER` held, the engine pauses.
3. **relay** (:mod:`.relay`): a direct relay (``kvevents serve``) writes to the client's
   transport in the engine connection's read callback, so it holds nothing of its own.
   After each write, a client socket that is full (the server's flow control:
   ``flow.write_paused``, set when the transport passes its own high-water mark) pauses
   the engine (:func:`after_write`; the compiled pump checks the same flag itself). A
   relay through ``send`` awaits each ``send``, which waits while the socket is full;
   meanwhile stage 2 bounds what is buffered.
4. **client socket**: when it drains, the transport calls the server protocol's
   ``resume_writing``, which calls the connection's ``on_writable``; :func:`follow` sets
   that to what restarts the engine (the pump's ``resume``, or the answer's
   ``resume_reading``) for the answer's lifetime, :func:`unfollow` clears it.

So a client that reads slowly costs the process at most :data:`HIGH_WATER` bytes per
answer plus the transports' own buffers, and slows its engine instead of the gateway.
Request bodies are uvicorn's own flow control, not this.

Lifecycle: :func:`follow` when a direct relay starts, :func:`unfollow` when it ends
(always: a ``finally``), on the event loop's thread. Failure: none raise; pausing or
resuming a closed connection does nothing.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["HIGH_WATER", "LOW_WATER", "after_write", "follow", "unfollow"]

#: Bytes of an answer buffered (or held by the pump) before reading from the engine
#: pauses. Small: an SSE chunk is ~100-300 bytes, so 64 KiB still holds hundreds of them,
#: and a slow reader costs the process this much, not 1 MiB (100 slow streams kept
#: ~100 MB that the allocator did not give back).
HIGH_WATER = 1 << 16
#: Reading from the engine resumes once the buffer is below this: not at once below
#: :data:`HIGH_WATER`, so a reader at the mark does not pause and resume per chunk.
LOW_WATER = 1 << 14


def follow(protocol, resume: Callable[[], None]) -> None:
    """Until :func:`unfollow`: the client's socket draining (the server protocol's
    ``on_writable``) calls ``resume()``, which restarts reading from the engine."""
    protocol.on_writable = resume


def unfollow(protocol) -> None:
    """The answer has ended: the client's socket draining restarts nothing."""
    protocol.on_writable = None


def after_write(flow, engine) -> None:
    """After a write to the client: its socket full (``flow.write_paused``), stop reading
    from the engine (``engine.pause_reading()``) until :func:`follow`'s ``resume``."""
    if flow.write_paused:
        engine.pause_reading()
