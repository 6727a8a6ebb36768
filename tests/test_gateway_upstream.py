"""The gateway's HTTP/1.1 client to the engines (kvevents/gateway/upstream.py) against a
real uvicorn server and raw sockets: bodies whole and streamed, keep-alive reuse, an
engine that closes idle connections, refused connections, malformed and broken-off
answers, and a large body read with flow control."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from support import ServerThread, free_port
from kvevents.gateway.pool import UpstreamPool
from kvevents.gateway.upstream import UpstreamConnectError, UpstreamProtocolError

BIG = 5 * (1 << 20)


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"len": len(body), "path": request.url.path,
                         "x": request.headers.get("x-test"), "host": request.headers.get("host")})


async def stream(request: Request) -> Response:
    async def gen():
        for i in range(5):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.01)
    return StreamingResponse(gen(), media_type="text/event-stream")


async def big(request: Request) -> Response:
    return Response(b"x" * BIG, media_type="application/octet-stream")


APP = Starlette(routes=[Route("/p/v1/echo", echo, methods=["POST"]),
                        Route("/p/v1/stream", stream, methods=["POST"]),
                        Route("/p/v1/big", big, methods=["POST"])])


@pytest.fixture(scope="module")
def server():
    with ServerThread(APP) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


def test_whole_and_streamed_answers_on_one_kept_alive_connection(server):
    async def go():
        pool = UpstreamPool()
        base = server.url + "/p"
        try:
            r = await pool.send(base, "/v1/echo", b"hello", [("x-test", "1")])
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            import json
            doc = json.loads(await r.aread())
            await r.aclose()
            assert doc == {"len": 5, "path": "/p/v1/echo", "x": "1", "host": server.url[len("http://"):]}
            assert pool.idle_connections() == 1
            r = await pool.send(base, "/v1/stream", b"{}", [])
            chunks = [c async for c in r.aiter_raw()]
            await r.aclose()
            assert b"".join(chunks) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
            assert pool.idle_connections() == 1  # the same connection, reused twice
            r = await pool.send(base, "/v1/big", b"", [])
            assert len(await r.aread()) == BIG
            await r.aclose()
            pool.forget(set())
            assert pool.idle_connections() == 0
        finally:
            pool.close()
    run(go())


def test_refused_connection(server):
    async def go():
        pool = UpstreamPool(connect_timeout_s=2)
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await pool.send(f"http://127.0.0.1:{free_port()}", "/v1/x", b"", [])
    run(go())


class RawServer:
    """A TCP server on 127.0.0.1 answering each request with ``reply(n)`` (n: the
    connection's request count), then closing if ``reply`` says so."""

    def __init__(self, reply) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        n = 0
        with conn:
            while True:
                data = b""
                while b"\r\n\r\n" not in data:
                    got = conn.recv(65536)
                    if not got:
                        return
                    data += got
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
                while len(rest) < length:
                    rest += conn.recv(65536)
                out, close = self.reply(n)
                n += 1
                conn.sendall(out)
                if close:
                    return

    def close(self) -> None:
        self.sock.close()


def test_an_idle_connection_closed_by_the_engine_is_not_reused_and_a_race_is_retried():
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    srv = RawServer(lambda n: (ok, True))  # answers, then closes (as at its keep-alive timeout)

    async def go():
        pool = UpstreamPool()
        try:
            for _ in range(3):
                r = await pool.send(srv.url, "/", b"x", [])
                assert await r.aread() == b"ok"
                await r.aclose()
                await asyncio.sleep(0.05)  # the close arrives: the pooled connection is dropped
        finally:
            pool.close()
    run(go())
    assert srv.connections == 3
    srv.close()

    # The close races the next request (no time for it to arrive): the request goes out
    # on the dead connection, nothing comes back, and it is sent again on a new one.
    srv = RawServer(lambda n: (ok, True))

    async def race():
        pool = UpstreamPool()
        try:
            for _ in range(3):
                r = await pool.send(srv.url, "/", b"x", [])
                assert await r.aread() == b"ok"
                await r.aclose()
        finally:
            pool.close()
    run(race())
    srv.close()


@pytest.mark.parametrize("reply, match", [
    (b"NOT HTTP AT ALL\r\n\r\n", "malformed"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort", "closed the connection"),
])
def test_malformed_and_broken_off_answers(reply, match):
    srv = RawServer(lambda n: (reply, True))

    async def go():
        pool = UpstreamPool()
        try:
            r = None
            with pytest.raises(UpstreamProtocolError, match=match):
                r = await pool.send(srv.url, "/", b"x", [])
                await r.aread()
            if r is not None:
                await r.aclose()
            assert pool.idle_connections() == 0
        finally:
            pool.close()
    run(go())
    srv.close()


def test_an_answer_delimited_by_the_connection_end():
    srv = RawServer(lambda n: (b"HTTP/1.0 200 OK\r\n\r\nuntil the end", True))

    async def go():
        pool = UpstreamPool()
        try:
            r = await pool.send(srv.url, "/", b"x", [])
            assert await r.aread() == b"until the end"
            await r.aclose()
            assert pool.idle_connections() == 0
        finally:
            pool.close()
    run(go())
    srv.close()


class SilentServer:
    """Reads requests and never answers; records when each connection was closed."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            try:
                while conn.recv(65536):
                    pass
            except OSError:
                return
            self.closed.set()  # the gateway closed it: the engine would abort the request

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("how", ["timeout", "abort"])
def test_no_head_in_time_or_a_client_gone_ends_the_wait_and_closes_the_connection(how):
    from kvevents.gateway.upstream import UpstreamAborted, UpstreamTimeout

    srv = SilentServer()

    async def go():
        pool = UpstreamPool()
        loop = asyncio.get_running_loop()
        abort = loop.create_future()
        loop.call_later(0.2, abort.set_result, None)
        t0 = loop.time()
        try:
            with pytest.raises(UpstreamTimeout if how == "timeout" else UpstreamAborted):
                await pool.send(srv.url, "/", b"x", [], timeout_s=0.2 if how == "timeout" else 30,
                                abort=None if how == "timeout" else abort)
            assert 0.15 < loop.time() - t0 < 2
            assert pool.idle_connections() == 0
            assert await loop.run_in_executor(None, srv.closed.wait, 5)
        finally:
            pool.close()
    run(go())
    srv.close()


def test_a_body_that_came_with_its_head_is_taken_at_once(server):
    async def go():
        pool = UpstreamPool()
        try:
            r = await pool.send(server.url + "/p", "/v1/echo", b"abc", [])
            await asyncio.sleep(0.05)  # (the body follows the head within a read or two)
            body = r.body_now()
            assert body is not None and b'"len":3' in body
            await r.aclose()
            assert pool.idle_connections() == 1  # read whole: kept
        finally:
            pool.close()
    run(go())


def test_on_way_is_told_once_before_the_first_wait(server):
    """After the write on a pooled connection, before connecting on a new one, and
    before connecting even when that fails (so the caller's accounting is undone)."""
    async def go():
        pool = UpstreamPool(connect_timeout_s=2)
        seen: list[str] = []

        def on_way(label: str):
            def told() -> None:
                # Nothing awaited yet: a pooled connection was written to, a new one not
                # yet opened.
                seen.append(f"{label}:{pool.idle_connections()}")
            return told

        try:
            r = await pool.send(server.url, "/v1/echo", b"a", [], on_way=on_way("new"))
            await r.aread()
            await r.aclose()
            r = await pool.send(server.url, "/v1/echo", b"b", [], on_way=on_way("pooled"))
            await r.aread()
            await r.aclose()
            with pytest.raises(UpstreamConnectError):
                await pool.send(f"http://127.0.0.1:{free_port()}", "/v1/x", b"", [],
                                on_way=on_way("refused"))
        finally:
            pool.close()
        # (the pooled connection was taken off the idle list before the write)
        assert seen == ["new:0", "pooled:0", "refused:1"]
    run(go())
