"""Hostile clients against the gateway's streams, with real sockets: a real ``kvevents
serve`` process in front of fake engines (:mod:`hostile_engine`) that count the answers
they are streaming now. Each test starts its own gateway (a fresh process per attack).

* clients that leave at every moment (right after sending, after the first chunk,
  mid-stream; FIN or RST): every engine stream closes within a second of its client
  leaving, and the gateway's files come back;
* more clients than ``--max-inflight``, bodies sent at once or 100 ms after the head: at
  most ``--max-inflight`` streams on the engines at once, the rest answered 503;
* clients that read slowly or not at all from large answers: the gateway's memory
  follows the streams open now (the engines are paused instead).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from hostile_support import fleet, tokenizer  # noqa: F401 (fixtures)
from hostile_support import GatewayProcess, chat_body, connect, raw_request, reset, wait_for


def _read_until(s: socket.socket, marker: bytes, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    buf = b""
    while marker not in buf:
        got = s.recv(65536)
        if not got:
            break
        buf += got
    return buf


def test_every_engine_stream_closes_within_a_second_of_its_client_leaving(fleet, tokenizer):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        # One complete request first: the process has its pools and caches.
        s = connect(g.port)
        s.sendall(raw_request(g.port, chat_body(True, 4)))
        assert b"[DONE]" in _read_until(s, b"0\r\n\r\n")
        s.close()
        assert wait_for(lambda: fleet.stats.open == 0, 2)
        fds0 = g.fds()
        late = []
        for moment in ("sent", "first chunk", "mid-stream"):
            for how in ("fin", "rst"):
                for _ in range(5):
                    s = connect(g.port)
                    s.sendall(raw_request(g.port, chat_body(True, 3000)))
                    if moment == "first chunk":
                        _read_until(s, b"data: ")
                    elif moment == "mid-stream":
                        buf = b""
                        while buf.count(b"data: ") < 20:
                            buf += _read_until(s, b"data: ")
                    reset(s) if how == "rst" else s.close()
                    left = time.monotonic()
                    if not wait_for(lambda: fleet.stats.open == 0, 1.0, 0.01):
                        late.append((moment, how, fleet.stats.open))
                    assert time.monotonic() - left < 1.5
                    time.sleep(0.05)
        assert not late, f"engine streams still open a second after their client left: {late}"
        assert wait_for(lambda: g.fds() <= fds0 + 2, 5), (fds0, g.fds())  # +2: pooled connections
        assert wait_for(lambda: g.metric("kvevents_gateway_inflight_requests") == 0, 5)
        # Every stream an engine started was aborted (only the first request finished),
        # and each is a 499 (a request whose RST came before the server read it is none).
        assert fleet.stats.finished == 1 and fleet.stats.aborted == fleet.stats.started - 1
        assert fleet.stats.started - 1 <= g.metric("kvevents_gateway_requests_total", status="499") <= 30
        assert "Exception in ASGI application" not in g.log_text()


async def _one(port: int, body: bytes, late: bool) -> tuple[int, bool]:
    """One streamed chat on a raw socket, the body with the head or 100 ms after it:
    (status, whether the whole answer came)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        request = raw_request(port, body)
        if late:
            writer.write(request[:-len(body)])
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(body)
        else:
            writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        status = int(head.split(b" ", 2)[1])
        rest = b""
        if status == 200:
            while not rest.endswith(b"0\r\n\r\n"):
                got = await asyncio.wait_for(reader.read(65536), 30)
                if not got:
                    break
                rest += got
        return status, b"[DONE]" in rest
    finally:
        writer.close()


@pytest.mark.parametrize("late", [False, True], ids=["body-early", "body-late"])
def test_no_more_streams_on_the_engines_than_max_inflight(fleet, tokenizer, late):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}",
                        "--max-inflight", "8") as g:
        body = chat_body(True, 150, fake_interval_ms=4)  # ~0.6 s per answer

        async def client(until: float) -> list[tuple[int, bool]]:
            out = []  # one request after another, for 2 s
            while time.monotonic() < until:
                out.append(await _one(g.port, body, late))
                if out[-1][0] == 503:
                    await asyncio.sleep(0.02)
            return out

        async def attack():
            until = time.monotonic() + 2
            return await asyncio.gather(*(client(until) for _ in range(60)))

        got = [r for rs in asyncio.run(attack()) for r in rs]
        peak = fleet.stats.peak  # both engines' streams at once
        assert peak <= 8, f"{peak} streams on the engines at once with --max-inflight 8"
        served = [ok for status, ok in got if status == 200]
        assert len(served) >= 8 and all(served), got
        assert all(status in (200, 503) for status, _ in got), got
        assert wait_for(lambda: g.metric("kvevents_gateway_inflight_requests") == 0, 5)


def test_slow_readers_cost_memory_only_while_they_stream(fleet, tokenizer):
    """40 clients ask for 12 MB answers and read nothing (half of them) or 1 KB now and
    then: the engines are paused, and the gateway's RSS stays near where it was, and
    goes back once they leave."""
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        body = chat_body(True, 3000, fake_chunk_bytes=4096, fake_interval_ms=0)
        warm = connect(g.port)
        warm.sendall(raw_request(g.port, chat_body(True, 200, fake_chunk_bytes=4096, fake_interval_ms=0)))
        _read_until(warm, b"0\r\n\r\n")
        warm.close()
        time.sleep(0.5)
        rss0 = g.rss_mb()
        socks, stop = [], threading.Event()
        for i in range(40):
            s = connect(g.port)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(raw_request(g.port, body))
            socks.append(s)

        def sip(s: socket.socket) -> None:
            # A bounded recv: the socket is reset below only after this thread let go of
            # it (a close while another thread is blocked in recv on the same socket is
            # deferred by the kernel until that recv returns, and the client never leaves).
            s.settimeout(0.3)
            while not stop.wait(0.2):
                try:
                    s.recv(1024)
                except TimeoutError:
                    continue
                except OSError:
                    return

        readers = [threading.Thread(target=sip, args=(s,), daemon=True) for s in socks[::2]]
        for t in readers:
            t.start()
        peak = rss0
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            peak = max(peak, g.rss_mb())
            time.sleep(0.1)
        assert fleet.stats.open >= 20  # still streaming: paused, not finished
        stop.set()
        for t in readers:
            t.join(5)
        for s in socks:
            reset(s)
        assert wait_for(lambda: fleet.stats.open == 0, 2)
        time.sleep(2)
        after = g.rss_mb()
        # About 250 KB per stream here (what is buffered for it on both sides); 1 MB per
        # stream before the per-stream buffer was bounded, and it stayed.
        assert peak - rss0 < 25, f"RSS {rss0:.0f} -> peak {peak:.0f} MB for 40 slow streams"
        assert after - rss0 < 20, f"RSS {rss0:.0f} -> {after:.0f} MB after the slow streams left"


def test_an_engine_that_breaks_off_mid_stream_is_said_in_the_stream_and_counted(fleet, tokenizer):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        s = connect(g.port)
        s.sendall(raw_request(g.port, chat_body(True, 50, fake_break_after=10)))
        got = _read_until(s, b"0\r\n\r\n")
        s.close()
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"\r\n0\r\n\r\n"), got[-300:]
        assert got.count(b'"delta"') == 10 and b"[DONE]" not in got
        error = got[got.rindex(b"data: {\"error\""):].split(b"\n\n")[0]
        assert b"broke off its answer" in error and b'"upstream_error"' in error, error
        assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="502") == 1, 5)
        assert fleet.stats.open == 0


def test_an_engine_that_breaks_off_after_its_done_gave_a_whole_answer(fleet, tokenizer):
    """``[DONE]`` reached the client, then the engine died before its body's end marker:
    the answer is whole, so it ends as one (no error event after ``[DONE]``), counted 200."""
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        s = connect(g.port)
        s.sendall(raw_request(g.port, chat_body(True, 12, fake_break_at_end=True)))
        got = _read_until(s, b"0\r\n\r\n")
        s.close()
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"\r\n0\r\n\r\n"), got[-300:]
        body = _dechunk(got)
        assert body.count(b'"delta"') == 12 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
        assert b'"error"' not in body
        assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="200") == 1, 5)
        assert g.metric("kvevents_gateway_requests_total", status="502") == 0


def _dechunk(raw: bytes) -> bytes:
    """The payload of a chunked HTTP/1.1 body (the head stripped)."""
    rest, out = raw.partition(b"\r\n\r\n")[2], b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, rest = out + rest[:n], rest[n + 2:]


def _direct_answer(port: int, n: int) -> bytes:
    s = connect(port)
    s.sendall(raw_request(port, chat_body(True, n)))
    got = _read_until(s, b"\r\n0\r\n\r\n")
    s.close()
    return _dechunk(got)


def test_the_same_bytes_written_straight_to_the_socket_or_through_the_servers_send(fleet, tokenizer):
    """``kvevents serve`` writes a streamed answer's chunks to the client's socket from the
    engine connection's read callback; under another server (uvicorn's h11 protocol here)
    they go through ASGI ``send``. The same bytes either way, and either way a client that
    leaves closes the engine's stream."""
    import uvicorn

    from kvevents.api import create_app
    from kvevents.service.settings import load_settings
    from support import free_port

    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        direct = _direct_answer(g.port, 300)
        # Accounted once, at the end: the status, TTFT, and the usage chunk's cached tokens.
        assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="200") == 1, 5)
        assert g.metric("kvevents_gateway_ttft_seconds_count") == 1
        assert g.metric("kvevents_gateway_usage_reports_total") == 1
    settings = load_settings(None, env={}, engines=[
        f"e{i}=tcp://127.0.0.1:{free_port()},model=fake,http={u}" for i, u in enumerate(fleet.urls)],
        tokenizers=[f"fake={tokenizer}"])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, http="h11",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, 10)
        import httpx
        assert wait_for(lambda: all(e["gateway"]["reachable"] for e in httpx.get(
            f"http://127.0.0.1:{port}/v1/engines").json()["engines"]), 10)
        through = _direct_answer(port, 300)
        assert through == direct and through.count(b'"delta"') == 300 and through.endswith(b"[DONE]\n\n")
        s = connect(port)
        s.sendall(raw_request(port, chat_body(True, 3000)))
        _read_until(s, b"data: ")
        reset(s)
        assert wait_for(lambda: fleet.stats.open == 0, 1.0, 0.01)
    finally:
        server.should_exit = True
        thread.join(10)
