"""Receiving: whole ZeroMQ messages taken from one socket per poll, bounded.

Contract: a drain takes at most ``_DRAIN_MAX`` messages and about ``_DRAIN_MAX_BYTES``
bytes from one socket, so one busy publisher cannot starve the others and a flood waits
in libzmq's bounded queue (``recv_hwm``), not in Python memory. Every message comes
whole (all its frames), never blocking; what was taken before a receive error is kept.

No state of its own: plain functions called by the :class:`~kvevents.ingest.subscriber.
Subscriber`'s loop thread (the thread that owns the socket). ``_DRAIN`` is the compiled
drain (:mod:`kvevents.ingest._zmqrecv`) where it loaded, else the pyzmq one; both give
the same messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

# The subscriber's logger: its records keep the name they always had.
log = logging.getLogger("kvevents.ingest.subscriber")

# Plain ints: pyzmq turns enum members back into enums on every call (measurable at
# tens of thousands of messages a second).
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


#: Most messages, and bytes, taken from one socket per poll: one busy publisher cannot
#: starve the others, and a flood of large messages waits in libzmq's bounded queue
#: (``recv_hwm``), not in Python memory.
_DRAIN_MAX = 1000
_DRAIN_MAX_BYTES = 4 << 20


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One whole message without waiting (``zmq.Again`` when none is ready); what
    ``recv_multipart(NOBLOCK)`` does, at less cost per frame. A message's frames arrive
    together, so the later ones never block."""
    frames = [sock.recv(_NOBLOCK)]
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(_NOBLOCK))
    return frames


def _drain_python(sock: zmq.Socket, max_msgs: int, max_bytes: int,
                  out: list[list[bytes]]) -> int:
    """:func:`kvevents.ingest._zmqrecv.drain` through pyzmq's calls (the fallback)."""
    n = taken = 0
    while n < max_msgs and taken < max_bytes:
        try:
            frames = _recv_frames(sock)
        except zmq.Again:
            break
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, str(exc)) from exc
        out.append(frames)
        taken += sum(map(len, frames))
        n += 1
    return n


def _drain_compiled(sock: zmq.Socket, max_msgs: int, max_bytes: int,
                    out: list[list[bytes]]) -> int:
    return _zmqrecv.drain(sock.underlying, max_msgs, max_bytes, out)


try:
    from kvevents.ingest import _zmqrecv

    _zmqrecv.load()
    _DRAIN: Callable[[zmq.Socket, int, int, list[list[bytes]]], int] = _drain_compiled
except (ImportError, OSError) as _exc:  # not built, or no shared libzmq to borrow
    log.info("compiled ZeroMQ drain unavailable (%s); receiving through pyzmq", _exc)
    _DRAIN = _drain_python
