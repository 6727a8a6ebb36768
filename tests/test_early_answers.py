"""Answers sent before the request's body is read whole reach the client: a real
``kvevents serve`` process in front of fake engines (:mod:`hostile_engine`).

A body over ``max_body_bytes`` is answered 413 as soon as its head says so, while the
client is still uploading. Closing the connection then would make the kernel reset it
(unread data in the receive buffer), and the client, which sends the whole body before
reading (httpx, and the ``openai`` SDK over it), would see a ``ReadError`` instead of the
413, and the SDK would send the whole upload again as a connection error. The server
closes lingering instead (:mod:`kvevents.api.conn_guard`): FIN after the answer, the rest
of the body read and discarded within bounds, then the close. Checked here: httpx sync
and async on kept-alive connections and the SDK sync and async each read the 413 every
time and the SDK does not retry (counted at the server); an early answer on the
in-protocol OpenAI path does the same; and a client that keeps sending forever is still
cut off within the bounds, with no memory kept.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from hostile_support import fleet, tokenizer  # noqa: F401 (fixtures)
from hostile_support import GatewayProcess, connect, head_fields, read_response

LIMIT = 8 << 20  # the default max_body_bytes
BIG = 20 << 20  # a 20 MB chat
LINGER_S, LINGER_BYTES = 5.0, 64 << 20  # ConnLimits' defaults


def _big_chat() -> bytes:
    return json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x" * BIG}]}).encode()


def _is_limit_413(status: int, body: bytes) -> bool:
    if status != 413:
        return False
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert str(LIMIT) in err["message"], err  # names the limit
    return True


def _early(g: GatewayProcess) -> float:
    return g.metric("kvevents_gateway_connections_closed_total", reason="early_answer")


def test_httpx_and_the_openai_sdk_read_the_413_every_time(fleet, tokenizer):
    body = _big_chat()
    headers = {"content-type": "application/json"}
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        url = g.url + "/v1/chat/completions"
        before = _early(g)

        async def async_httpx() -> list:
            got = []
            async with httpx.AsyncClient(timeout=30) as c:
                assert (await c.get(g.url + "/v1/models")).status_code == 200  # kept alive
                for _ in range(10):
                    try:
                        r = await c.post(url, content=body, headers=headers)
                        got.append(_is_limit_413(r.status_code, r.content))
                    except httpx.HTTPError as exc:
                        got.append(repr(exc))
                    # and the client's next request, on a new connection, is served
                    assert (await c.get(g.url + "/v1/models")).status_code == 200
            return got

        got = asyncio.run(async_httpx())
        assert got == [True] * 10, got

        with httpx.Client(timeout=30) as c:  # sync, kept alive
            assert c.get(g.url + "/v1/models").status_code == 200
            got = []
            for _ in range(3):
                r = c.post(url, content=body, headers=headers)
                got.append(_is_limit_413(r.status_code, r.content))
            assert got == [True] * 3, got
        assert wait_until(lambda: _early(g) == before + 13), (_early(g), before)

        # The official SDK, which retries connection errors (max_retries=2 by default):
        # every call gets the 413 as an APIStatusError, and each is one request at the server.
        sent = []
        hook = {"request": [lambda request: sent.append(request.url.path)]}
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=2,
                               http_client=httpx.Client(event_hooks=hook, timeout=30))
        messages = [{"role": "user", "content": "x" * BIG}]
        for _ in range(10):
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="fake", messages=messages)
            assert err.value.status_code == 413 and str(LIMIT) in err.value.message, err.value

        async def async_sdk() -> None:
            async def count(request):
                sent.append(request.url.path)
            aclient = openai.AsyncOpenAI(
                base_url=g.url + "/v1", api_key="x", max_retries=2,
                http_client=httpx.AsyncClient(event_hooks={"request": [count]}, timeout=30))
            for _ in range(3):
                with pytest.raises(openai.APIStatusError) as err:
                    await aclient.chat.completions.create(model="fake", messages=messages)
                assert err.value.status_code == 413, err.value
            await aclient.close()

        asyncio.run(async_sdk())
        assert len(sent) == 13, sent  # no retry
        assert wait_until(lambda: _early(g) == before + 26), (_early(g), before)
        assert fleet.stats.started == 0
        log = g.log_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def wait_until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class _Sender(threading.Thread):
    """Sends ``data`` on ``s`` in ``piece``-byte writes, ``every`` seconds apart (0: as
    fast as the socket takes them), until an error; records how much went and when it
    stopped."""

    def __init__(self, s: socket.socket, piece: int, every: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.s, self.piece, self.every = s, piece, every
        self.sent = 0
        self.stopped_at: float | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        chunk = b"x" * self.piece
        try:
            while True:
                self.s.sendall(chunk)
                self.sent += len(chunk)
                if self.every:
                    time.sleep(self.every)
        except OSError as exc:
            self.error = exc
        self.stopped_at = time.monotonic()


def _hostile(port: int, length: int, piece: int, every: float) -> tuple[int, bytes, _Sender, float]:
    """A client declaring ``length`` bytes of body and sending forever: the answer it
    reads meanwhile, its sender, and when the answer came."""
    s = connect(port, timeout=20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % length)
    sender = _Sender(s, piece, every)
    sender.start()
    head, body, _ = read_response(s, timeout=10)
    status, _ = head_fields(head)
    return status, body, sender, time.monotonic()


def test_a_client_that_keeps_sending_is_cut_off_within_the_bounds(fleet, tokenizer):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        rss0 = g.rss_mb()
        # As fast as it can, declaring 10 GB: cut off once the byte bound is discarded
        # (or the time bound, on a slow machine).
        status, body, sender, t = _hostile(g.port, 10 << 30, 1 << 20, 0.0)
        assert _is_limit_413(status, body)
        sender.join(LINGER_S + 5)
        assert sender.stopped_at is not None, "the server never cut the sender off"
        assert sender.stopped_at - t < LINGER_S + 2, sender.stopped_at - t
        # what it sent: the discarded bytes, plus what the sockets' buffers held
        assert sender.sent < LINGER_BYTES + (16 << 20), sender.sent
        sender.s.close()

        # Slowly, forever (1 KB every 50 ms): cut off at the time bound.
        status, body, sender, t = _hostile(g.port, 10 << 30, 1024, 0.05)
        assert _is_limit_413(status, body)
        sender.join(LINGER_S + 5)
        assert sender.stopped_at is not None, "the server never cut the sender off"
        assert LINGER_S - 1 < sender.stopped_at - t < LINGER_S + 2, sender.stopped_at - t
        sender.s.close()

        # Chunked, no declared length (the app counts it as it streams): the same.
        s = connect(g.port, timeout=20)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
        sender = _Sender(s, 0)
        sender.run = lambda: _send_forever(sender, piece)  # type: ignore[method-assign]
        sender.start()
        head, body, _ = read_response(s, timeout=10)
        t = time.monotonic()
        assert _is_limit_413(head_fields(head)[0], body)
        sender.join(LINGER_S + 5)
        assert sender.stopped_at is not None and sender.stopped_at - t < LINGER_S + 2
        s.close()

        assert g.rss_mb() - rss0 < 40, (g.rss_mb(), rss0)
        # The connections are gone: the process's files are back where they were.
        assert wait_until(lambda: _early(g) == 3)
        r = httpx.post(g.url + "/v1/chat/completions", timeout=10, json={
            "model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert "Traceback" not in g.log_text()


def _send_forever(sender: _Sender, piece: bytes) -> None:
    try:
        while True:
            sender.s.sendall(piece)
            sender.sent += len(piece)
    except OSError as exc:
        sender.error = exc
    sender.stopped_at = time.monotonic()


def test_an_early_answer_on_the_in_protocol_path_reaches_the_client(fleet, tokenizer):
    """The in-protocol OpenAI path answers a wrong API key before reading the body; with
    ``connection: close`` the connection closes lingering: the client sends its whole
    body, then reads the 401."""
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}", "--api-key", "k") as g:
        body = _big_chat()[:4 << 20]  # within the body limit: the in-protocol path takes it
        s = connect(g.port, timeout=20)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer wrong\r\nconnection: close\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body[:65536])
        time.sleep(0.3)  # the 401 is written now, the body still arriving
        s.sendall(body[65536:])  # no reset: the server reads and discards it
        head, answer, _ = read_response(s, timeout=10)
        status, headers = head_fields(head)
        assert status == 401 and headers.get("connection") == "close", (head, answer)
        s.settimeout(LINGER_S + 2)
        assert s.recv(65536) == b""  # then closed, without a reset
        s.close()
        assert wait_until(lambda: _early(g) == 1)
