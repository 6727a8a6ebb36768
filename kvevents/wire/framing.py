"""ZeroMQ framing and endpoint rules shared by publisher and subscriber (no sockets here).

Live messages are ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian unsigned
integer. Replay requests carry the start seq in the same form. Replay replies are
``[b"", topic, seq, payload]`` (vLLM >= 0.26) or ``[b"", seq, payload]`` (older), the end
marker has seq ``0xFFFF_FFFF_FFFF_FFFF`` (-1 as signed) and an empty payload.
"""

from __future__ import annotations

import struct
from urllib.parse import urlsplit

_SEQ = struct.Struct(">Q")
END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
END_SEQ_BYTES = _SEQ.pack(END_SEQ)


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(frame: bytes) -> int:
    """Decode an 8-byte seq frame; raises ``ValueError`` on any other length."""
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return _SEQ.unpack(frame)[0]


def replay_end_marker(topic_frame: bool = True) -> list[bytes]:
    """The end-of-replay message after the ROUTER identity (current or legacy shape)."""
    if topic_frame:
        return [b"", b"", END_SEQ_BYTES, b""]
    return [b"", END_SEQ_BYTES, b""]


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind when the endpoint is a wildcard or a local transport."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel rank ``r`` uses: tcp port ``base + r``; local
    transports get a ``_dp{r}`` suffix. Raises ``ValueError`` for a tcp endpoint without
    a port or an unknown transport."""
    if endpoint is None:
        return None
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        head, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or head == "tcp":
            raise ValueError(f"tcp endpoint needs a port: {endpoint!r}")
        return f"{head}:{int(port) + data_parallel_rank}"
    raise ValueError(f"endpoint must be tcp://HOST:PORT, ipc:// or inproc://: {endpoint!r}")


def validate_endpoint(endpoint: str) -> str:
    """Check a user-given endpoint once, at the edge; returns it unchanged."""
    if endpoint.startswith(("inproc://", "ipc://")):
        if len(endpoint) <= len("ipc://"):
            raise ValueError(f"empty address in endpoint {endpoint!r}")
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint must be tcp://HOST:PORT, ipc:// or inproc://: {endpoint!r}")
    parts = urlsplit(endpoint.replace("*", "0.0.0.0", 1))
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"tcp endpoint needs HOST:PORT: {endpoint!r}")
    return endpoint


class EndpointError(ValueError):
    """An engine endpoint the subscriber could not use; ``field`` names which one."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_engine_endpoint(endpoint: str, field: str, *, connect: bool) -> None:
    """Raise :class:`EndpointError` unless ``endpoint`` works for the subscriber.

    Every tcp endpoint needs a port in 1..65535; one the subscriber connects to (the
    live endpoint unless ``bind``, and always the replay endpoint) also needs a real
    host, not a wildcard: ZeroMQ refuses ``connect("tcp://*:5557")``.
    """
    try:
        validate_endpoint(endpoint)
    except ValueError as exc:
        raise EndpointError(f"{field}: {exc}", field) from None
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"{field}: port must be 1..65535 in {endpoint!r}", field)
    if connect and host.strip("[]") in ("*", "0.0.0.0", "::", ""):
        raise EndpointError(
            f"{field}: {endpoint!r} is a wildcard address the subscriber cannot connect to; "
            "give the publisher's host (or bind=1 for publishers that connect to us)", field)


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of one replay reply after the ROUTER identity: the current
    shape ``[b"", topic, seq, payload]`` or the older ``[b"", seq, payload]``; ``seq``
    is :data:`END_SEQ` for the end marker. None for anything else (a wrong frame count
    or a seq frame that is not 8 bytes): the caller counts it and skips it."""
    if len(frames) == 4 and frames[0] == b"":
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3 and frames[0] == b"":
        seq_frame, payload = frames[1], frames[2]
    else:
        return None
    if len(seq_frame) != 8:
        return None
    return _SEQ.unpack(seq_frame)[0], payload
