"""The compiled relay of chunked answers (``kvevents.gateway._pump.ChunkPump``, through
``UpstreamResponse.pump_to``), with real sockets: an engine (a raw asyncio server) that
writes a chunked answer in pieces of any size, the gateway's pool reading it, and a real
client connection on the other side whose bytes are checked.

* whatever the pieces' sizes, the client gets every chunk exactly as the engine framed it,
  the end marker left to the caller, the tail is the decoded body's end, and the engine
  connection goes back to the pool and serves the next request;
* a chunk cut across reads is held until it is whole (the client stays at a chunk
  boundary), unless it is bigger than ``hold_max``;
* malformed framing, an engine that closes mid-answer, and bytes after the end: the answer
  ends with an error (or is not reused), and nothing malformed reaches the client;
* a client that does not read pauses the engine; reading resumes it;
* ``finish`` and ``head``: the server's head goes out with the first body bytes and the
  end with the last chunks (canonical, only at a clean end).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket

import pytest

from uvicorn.protocols.http.flow_control import FlowControl

from kvevents.gateway.pool import UpstreamPool
from kvevents.gateway.upstream import TAIL_BYTES, UpstreamProtocolError

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def framed(chunks: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks)


def events(n: int, seed: int = 1) -> list[bytes]:
    rnd = random.Random(seed)
    return [b"data: {\"i\": %d, \"t\": \"%s\"}\n\n" % (i, b"x" * rnd.randint(0, 400)) for i in range(n)]


def split_writes(body: bytes, rnd: random.Random, sizes: list[int]) -> list[tuple[bytes, float]]:
    """The engine's script for ``body``: the head, then the body in pieces of random
    ``sizes``, some of them after a pause."""
    pieces, i = [(HEAD, 0.005)], 0
    while i < len(body):
        k = rnd.choice(sizes)
        pieces.append((body[i:i + k], 0.001 if rnd.random() < 0.3 else 0))
        i += k
    return pieces


class Engine(asyncio.Protocol):
    """Answers each request with ``script(n)``: a list of (bytes, delay_s) to write."""

    script = None
    requests = 0
    writes_paused = 0

    def connection_made(self, transport) -> None:
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        if len(rest) < length:
            return
        self.buf = rest[length:]
        Engine.requests += 1
        asyncio.get_running_loop().create_task(self._answer(type(self).script(Engine.requests)))

    async def _answer(self, pieces) -> None:
        for data, delay in pieces:
            if self.t.is_closing():
                return
            self.t.write(data)
            if delay:
                await asyncio.sleep(delay)
        if getattr(self, "close_after", False):
            self.t.close()

    def pause_writing(self) -> None:
        Engine.writes_paused += 1


class Client(asyncio.Protocol):
    """The gateway's side of a client connection (what uvicorn's protocol would be)."""

    def connection_made(self, transport) -> None:
        self.t = transport
        self.flow = FlowControl(transport)
        self.on_writable = None

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()
        if self.on_writable is not None:
            self.on_writable()


@contextlib.asynccontextmanager
async def rig(script, engine_cls=Engine):
    """An engine answering ``script(n)``, the gateway's pool, and a client connection:
    (engine URL, the client's gateway side, the client's own socket, the pool)."""
    loop = asyncio.get_running_loop()
    engine_cls.script = staticmethod(script)
    server = await loop.create_server(engine_cls, "127.0.0.1", 0)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    reader = socket.create_connection(lsock.getsockname())
    accepted, _ = lsock.accept()
    lsock.close()
    _, client = await loop.connect_accepted_socket(Client, accepted)
    reader.setblocking(False)
    pool = UpstreamPool()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", client, reader, pool
    finally:
        pool.close()
        client.t.close()
        reader.close()
        server.close()


async def read_all(reader: socket.socket, until: int, timeout: float = 10.0) -> bytes:
    loop = asyncio.get_running_loop()
    buf = b""
    deadline = loop.time() + timeout
    while len(buf) < until and loop.time() < deadline:
        try:
            buf += await asyncio.wait_for(loop.sock_recv(reader, 1 << 20), deadline - loop.time())
        except asyncio.TimeoutError:
            break
    return buf


class Writes:
    """The client's transport, with every write the pump makes recorded."""

    def __init__(self, transport) -> None:
        self.t = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.t.write(data)

    def is_closing(self) -> bool:
        return self.t.is_closing()


async def pumped(pool: UpstreamPool, url: str, client: Client, before_s: float = 0.0,
                 head: bytes | None = None, finish: bool = False, to=None):
    """Send a request; ``before_s`` later, pump its answer to ``client`` (through ``to``,
    a wrapper of its transport, if given); (response, pump, ended-future, firsts)."""
    resp = await pool.send(url, "/v1/chat/completions", b"{}", [])
    if before_s:
        await asyncio.sleep(before_s)
    ended = asyncio.get_running_loop().create_future()
    firsts: list[int] = []
    pump = resp.pump_to(to or client.t, client.flow, lambda: firsts.append(1),
                        lambda: ended.done() or ended.set_result(None), head, finish)
    if pump is not None:
        client.on_writable = pump.resume
    return resp, pump, ended, firsts


@pytest.mark.parametrize("seed", range(6))
def test_any_split_of_the_answer_reaches_the_client_as_the_engine_framed_it(seed):
    chunks = events(120, seed)
    body = framed(chunks) + b"0\r\n\r\n"

    def script(n):
        return split_writes(body, random.Random(seed * 100 + n), [1, 2, 5, 50, 300, 2000])

    async def go():
        async with rig(script) as (url, client, reader, pool):
            for _ in range(2):  # the second on the same (pooled) connection
                resp, pump, ended, firsts = await pumped(pool, url, client)
                assert pump is not None
                await asyncio.wait_for(ended, 10)
                got = await read_all(reader, len(body) - 5)
                assert got == body[:-5]  # every chunk as framed; the end marker is the caller's
                assert resp.error is None and firsts == [1]
                assert resp.tail() == b"".join(chunks)[-TAIL_BYTES:]
                resp.close()
                assert pool.idle_connections() == 1
            assert Engine.requests >= 2

    Engine.requests = 0
    asyncio.run(go())


def test_a_chunk_cut_across_reads_is_held_until_whole():
    big = b"y" * 5000
    body = framed([b"data: a\n\n", big]) + b"0\r\n\r\n"
    cut = body.index(big) + 1000  # inside the big chunk

    def script(n):
        return [(HEAD, 0.005), (body[:cut], 0.2), (body[cut:], 0)]

    async def go():
        async with rig(script) as (url, client, reader, pool):
            resp, pump, ended, _ = await pumped(pool, url, client)
            assert pump is not None
            await asyncio.sleep(0.1)  # the first piece is in; the second is 0.2 s away
            early = await read_all(reader, 1, timeout=0.05)
            await asyncio.wait_for(ended, 10)
            rest = await read_all(reader, len(body) - 5 - len(early))
            assert early + rest == body[:-5]
            return early

    early = asyncio.run(go())
    assert early == framed([b"data: a\n\n"])  # the whole first chunk, none of the cut one


def test_a_chunk_bigger_than_the_hold_bound_goes_out_as_it_comes():
    big = b"y" * 200_000  # over hold_max (64 KiB)
    body = framed([b"data: a\n\n", big]) + b"0\r\n\r\n"
    cut = body.index(big) + 100_000

    async def go():
        async with rig(lambda n: [(HEAD, 0.005), (body[:cut], 0.3), (body[cut:], 0)]) as (
                url, client, reader, pool):
            resp, pump, ended, _ = await pumped(pool, url, client)
            await asyncio.sleep(0.15)
            early = await read_all(reader, cut, timeout=0.1)
            assert len(early) > len(framed([b"data: a\n\n"])) and pump.mid_chunk
            await asyncio.wait_for(ended, 10)
            assert early + await read_all(reader, len(body) - 5 - len(early)) == body[:-5]
            assert not pump.mid_chunk  # the big chunk ended: at a boundary again
            resp.close()

    asyncio.run(go())


@pytest.mark.parametrize("tail, error", [
    (b"zz\r\n", "bad chunk size"),
    (b"5\r\nabcdefgh\r\n", "chunk longer than its size"),
    (b"5\r\nab", "closed the connection"),
])
def test_a_broken_answer_ends_with_an_error_and_the_client_gets_whole_chunks_only(tail, error):
    good = framed(events(3))

    class Closing(Engine):
        close_after = True

    async def go():
        async with rig(lambda n: [(HEAD, 0.005), (good, 0.01), (tail, 0)], Closing) as (url, client, reader, pool):
            resp, pump, ended, _ = await pumped(pool, url, client)
            await asyncio.wait_for(ended, 10)
            assert isinstance(resp.error, UpstreamProtocolError) and error in str(resp.error)
            assert not pump.mid_chunk
            assert await read_all(reader, len(good) + 1, timeout=0.3) == good
            resp.close()
            assert pool.idle_connections() == 0

    asyncio.run(go())


def test_bytes_after_the_end_keep_the_connection_out_of_the_pool():
    body = framed(events(2)) + b"0\r\n\r\nHTTP/1.1 200 OK\r\n"

    async def go():
        async with rig(lambda n: [(HEAD, 0.005), (body, 0)]) as (url, client, reader, pool):
            resp, pump, ended, _ = await pumped(pool, url, client)
            await asyncio.wait_for(ended, 10)
            assert resp.error is None and pump.extra > 0
            resp.close()
            assert pool.idle_connections() == 0

    asyncio.run(go())


def test_a_client_that_does_not_read_pauses_the_engine_and_reading_resumes_it():
    chunk = b"data: " + b"z" * 16000 + b"\n\n"
    n = 2000  # ~32 MB: far more than the sockets' buffers
    body = framed([chunk] * n) + b"0\r\n\r\n"

    def script(_):
        return [(HEAD, 0.005)] + [(framed([chunk]), 0) for _ in range(n)] + [(b"0\r\n\r\n", 0)]

    async def go():
        async with rig(script) as (url, client, reader, pool):
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            resp, pump, ended, _ = await pumped(pool, url, client)
            await asyncio.sleep(1.0)  # nobody reads
            assert not ended.done()
            assert client.flow.write_paused  # the client's socket is full ...
            assert client.t.get_write_buffer_size() < 1 << 20  # ... and the pump stopped there
            assert Engine.writes_paused >= 1  # the engine could not write on: paused
            got = await read_all(reader, len(body) - 5, timeout=30)
            await asyncio.wait_for(ended, 10)
            assert got == body[:-5]
            resp.close()

    Engine.writes_paused = 0
    asyncio.run(go())


@pytest.mark.parametrize("how", ["pump", "aread"])
def test_a_body_that_came_with_its_head_is_held_then_pumped_at_once_or_read_decoded(how):
    chunks = events(64, 7)
    body = framed(chunks) + b"0\r\n\r\n"

    async def go():
        async with rig(lambda n: [(HEAD + body, 0)]) as (url, client, reader, pool):
            for _ in range(2):
                if how == "pump":  # the whole answer is in before the relay asks for it
                    resp, pump, ended, firsts = await pumped(pool, url, client, before_s=0.1)
                    assert pump is not None and ended.done() and firsts == [1]
                    assert await read_all(reader, len(body) - 5) == body[:-5]
                    assert resp.tail() == b"".join(chunks)[-TAIL_BYTES:]
                else:
                    resp = await pool.send(url, "/v1/chat/completions", b"{}", [])
                    await asyncio.sleep(0.1)
                    assert await resp.aread() == b"".join(chunks)
                resp.close()
                assert pool.idle_connections() == 1  # whole and clean: kept for the next

    asyncio.run(go())


GATEWAY_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("seed", range(3))
def test_finish_ends_the_answer_in_the_write_of_its_last_chunks(seed):
    """``finish``: the pump writes the end (canonical, the engine's trailers dropped) with
    the last chunks, and the head given to ``start`` goes out before any body byte."""
    chunks = events(40, seed)
    body = framed(chunks) + b"0\r\nx-trailer: 1\r\n\r\n"

    def script(n):
        return split_writes(body, random.Random(seed * 7 + n), [3, 40, 700])

    async def go():
        async with rig(script) as (url, client, reader, pool):
            to = Writes(client.t)
            resp, pump, ended, _ = await pumped(pool, url, client, head=GATEWAY_HEAD, finish=True, to=to)
            await asyncio.wait_for(ended, 10)
            expected = GATEWAY_HEAD + framed(chunks) + b"0\r\n\r\n"
            assert await read_all(reader, len(expected)) == expected
            assert pump.wrote_end and resp.error is None
            assert to.writes[0].startswith(GATEWAY_HEAD) and to.writes[-1].endswith(b"0\r\n\r\n")
            assert b"".join(to.writes) == expected
            resp.close()
            assert pool.idle_connections() == 1

    asyncio.run(go())


def test_an_answer_held_whole_goes_out_with_its_head_and_end_in_one_write():
    chunks = events(64, 3)
    body = framed(chunks) + b"0\r\n\r\n"

    async def go():
        async with rig(lambda n: [(HEAD + body, 0)]) as (url, client, reader, pool):
            to = Writes(client.t)
            resp, pump, ended, _ = await pumped(pool, url, client, before_s=0.1, head=GATEWAY_HEAD,
                                                finish=True, to=to)
            assert ended.done() and pump.wrote_end
            assert to.writes == [GATEWAY_HEAD + body]  # one write: head, chunks, end
            assert await read_all(reader, len(GATEWAY_HEAD + body)) == GATEWAY_HEAD + body
            resp.close()

    asyncio.run(go())


def test_finish_writes_no_end_for_an_answer_that_broke_off():
    good = framed(events(3))

    class Closing(Engine):
        close_after = True

    async def go():
        async with rig(lambda n: [(HEAD, 0.005), (good, 0.01), (b"zz\r\n", 0)], Closing) as (
                url, client, reader, pool):
            resp, pump, ended, _ = await pumped(pool, url, client, head=GATEWAY_HEAD, finish=True)
            await asyncio.wait_for(ended, 10)
            assert resp.error is not None and not pump.wrote_end
            assert await read_all(reader, len(GATEWAY_HEAD + good) + 1, timeout=0.3) == GATEWAY_HEAD + good
            resp.close()

    asyncio.run(go())
