"""The compiled ZeroMQ drain gives exactly what pyzmq gives, over real sockets."""

from __future__ import annotations

import time

import pytest
import zmq

from kvevents.ingest import _zmqrecv
from kvevents.ingest.subscriber import _DRAIN, _drain_compiled, _drain_python

MESSAGES = [
    [b"topic", (7).to_bytes(8, "big"), b"payload"],
    [b"only-one-frame"],
    [b"", b"", b""],
    [b"a", b"b", b"c", b"d", b"e"],
    [b"kv", (8).to_bytes(8, "big"), bytes(range(256)) * 40_000],  # 10 MB payload
]


@pytest.fixture()
def pair():
    """A PUSH -> PULL pair over TCP on 127.0.0.1."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)
    ctx.term()


def _send_all(push: zmq.Socket, pull: zmq.Socket, msgs: list[list[bytes]]) -> None:
    for m in msgs:
        push.send_multipart(m)
    deadline = time.monotonic() + 10
    while not pull.poll(100) and time.monotonic() < deadline:
        pass
    time.sleep(0.2)  # let the whole set arrive (frames of one message arrive together)


def test_compiled_drain_is_the_default_here():
    """This machine (Linux, pyzmq wheel with its shared libzmq) takes the compiled path:
    otherwise the ingest loop silently pays pyzmq's per-frame cost."""
    _zmqrecv.load()
    assert _DRAIN is _drain_compiled


@pytest.mark.parametrize("drain", [_drain_compiled, _drain_python], ids=["compiled", "pyzmq"])
def test_drain_returns_whole_messages_in_order(pair, drain):
    push, pull = pair
    _send_all(push, pull, MESSAGES)
    out: list[list[bytes]] = []
    got = 0
    deadline = time.monotonic() + 10
    while got < len(MESSAGES) and time.monotonic() < deadline:
        got += drain(pull, 100, 1 << 30, out)
    assert out == MESSAGES
    assert drain(pull, 100, 1 << 30, out) == 0  # nothing waiting: returns at once, appends nothing
    assert len(out) == len(MESSAGES)


@pytest.mark.parametrize("drain", [_drain_compiled, _drain_python], ids=["compiled", "pyzmq"])
def test_drain_is_bounded(pair, drain):
    push, pull = pair
    msgs = [[b"t", i.to_bytes(8, "big"), b"x" * 100] for i in range(50)]
    _send_all(push, pull, msgs)
    out: list[list[bytes]] = []
    assert drain(pull, 7, 1 << 30, out) == 7
    assert out == msgs[:7]
    deadline = time.monotonic() + 10
    while len(out) < 50 and time.monotonic() < deadline:
        drain(pull, 7, 1 << 30, out)
    assert out == msgs


@pytest.mark.parametrize("drain", [_drain_compiled, _drain_python], ids=["compiled", "pyzmq"])
def test_drain_stops_at_the_byte_bound_after_a_whole_message(pair, drain):
    push, pull = pair
    msgs = [[b"t", i.to_bytes(8, "big"), b"x" * 1000] for i in range(20)]
    _send_all(push, pull, msgs)
    out: list[list[bytes]] = []
    assert drain(pull, 100, 2500, out) == 3  # 1,009 bytes each: the third crosses 2,500
    assert out == msgs[:3]


def test_error_on_an_invalid_handle_is_an_oserror():
    """A handle libzmq does not know (NULL) raises OSError (ENOTSOCK), never crashes."""
    _zmqrecv.load()
    with pytest.raises(OSError):
        _zmqrecv.drain(0, 10, 1 << 30, [])
