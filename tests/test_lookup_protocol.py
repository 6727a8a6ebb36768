"""Common lookups answered in uvicorn's HTTP protocol (kvevents/api/server_protocol.py).

A real uvicorn server configured as ``kvevents serve`` configures it, raw sockets as
clients: the protocol's answers are the route's, it never answers what the app must
(other bodies, limits, a busy index lock, pipelined requests behind one of the app's),
and keep-alive, ``Connection: close``, HTTP/1.0, ``Expect: 100-continue`` and bodies
split across packets work as with uvicorn alone.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kvevents.api import create_app
from kvevents.api.server_protocol import LOOKUP_PATH, HotPathProtocol, path_table
from kvevents.service.settings import AggregatorSettings
from kvevents.wire.schema import BlockStored, KVEventBatch

from support import ServerThread

TOKENS = list(range(16))


class AppCalls:
    """ASGI middleware counting the HTTP requests that reach the app, per path."""

    def __init__(self, app, calls: list[str]) -> None:
        self.app, self.calls = app, calls

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.calls.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture
def server():
    calls: list[str] = []
    app = create_app(AggregatorSettings(engines=(), max_body_bytes=4096, max_prompt_tokens=64))
    app.add_middleware(AppCalls, calls=calls)
    with ServerThread(app) as srv:
        batch = KVEventBatch(1.0, [BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None,
                                               token_ids=TOKENS, block_size=4)])
        app.state.aggregator.index.apply_batch("e0", batch, model="m")
        srv.app, srv.calls = app, calls
        yield srv


def request(body: bytes, *, headers: str = "", version: str = "1.1", path: str = "/v1/lookup") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{headers}\r\n").encode() + body


def lookup_body(tokens=TOKENS, **extra) -> bytes:
    return json.dumps({"token_ids": tokens, **extra}).encode()


class Conn:
    """One client connection; reads responses framed by content-length."""

    def __init__(self, srv) -> None:
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        self.buf = b""

    def send(self, data: bytes, *, pieces: int = 1) -> None:
        step = max(1, -(-len(data) // pieces))
        for i in range(0, len(data), step):
            self.sock.sendall(data[i:i + step])
            if pieces > 1:
                time.sleep(0.01)  # separate packets

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), "connection closed before a response"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if status == 100:
            return self.response()
        size = int(headers["content-length"])
        while len(self.buf) < size:
            assert self._fill(), "connection closed inside a body"
        body, self.buf = self.buf[:size], self.buf[size:]
        return status, headers, body

    def closed(self) -> bool:
        self.sock.settimeout(5)
        return self.buf == b"" and not self._fill()


def routed(srv, body: bytes) -> bytes:
    """The route's answer to the same request: ``"prompt": null`` is not a common
    body, so the app answers it."""
    obj = json.loads(body)
    r = httpx.post(f"{srv.url}/v1/lookup", json={**obj, "prompt": None})
    assert r.status_code == 200
    return r.content


def test_the_server_uses_the_protocol(server):
    cls = server.server.config.http_protocol_class
    assert issubclass(cls, HotPathProtocol) and LOOKUP_PATH in cls.routes


def test_common_lookups_are_answered_in_the_protocol_as_the_route_answers(server):
    conn = Conn(server)
    bodies = [lookup_body(), lookup_body(TOKENS[:9]), lookup_body(model="m"),
              lookup_body(model="other", lora_name=None), lookup_body([])]
    answers = []
    for body in bodies:
        conn.send(request(body))
        status, headers, got = conn.response()
        assert status == 200 and headers["content-type"] == "application/json"
        assert "date" in headers and headers["server"] == "uvicorn"
        assert got == routed(server, body)
        answers.append(json.loads(got))
    assert [a["engines"][0]["matched_tokens"] if a["engines"] else 0 for a in answers] == [16, 8, 16, 0, 0]
    assert server.calls.count("/v1/lookup") == len(bodies)  # only the routed ones reached the app
    text = httpx.get(f"{server.url}/metrics").text
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('kvevents_lookups_total{api="lookup"'))
    assert counted == 2 * len(bodies)  # timed into the same metrics both ways


def test_what_is_not_common_is_the_apps_with_its_errors(server):
    conn = Conn(server)
    cases = [
        (lookup_body([1, -5]), 422, "token_ids[1]"),
        (lookup_body(list(range(65))), 400, "token_ids"),  # over max_prompt_tokens
        (b'{"token_ids": [1], "modle": "x"}', 422, "modle"),
        (b"{not json", 422, None),
        (b"", 422, None),
    ]
    for body, status, field in cases:
        conn.send(request(body), pieces=3)
        got_status, _, got = conn.response()
        assert got_status == status, got
        assert json.loads(got)["field"] == field
    assert server.calls.count("/v1/lookup") == len(cases)
    # The connection still serves a common lookup after them.
    conn.send(request(lookup_body()))
    assert conn.response()[0] == 200 and server.calls.count("/v1/lookup") == len(cases)
    # Over max_body_bytes, handed over as it grows: the app's 413, and the connection is
    # closed (the rest of the body is not read).
    big = Conn(server)
    big.send(request(b"[" + b"1," * 3000 + b"1]"), pieces=3)
    got_status, headers, got = big.response()
    assert (got_status, headers.get("connection"), json.loads(got)["field"]) == (413, "close", None)
    assert big.closed() and server.calls.count("/v1/lookup") == len(cases) + 1


def test_keep_alive_close_http10_expect_and_split_bodies(server):
    want = routed(server, lookup_body())
    conn = Conn(server)
    conn.send(request(lookup_body()), pieces=7)  # body across packets
    assert conn.response()[2] == want
    conn.send(request(lookup_body(), headers="connection: close\r\n"))
    status, headers, got = conn.response()
    assert (status, headers.get("connection"), got) == (200, "close", want)
    assert conn.closed()

    conn = Conn(server)
    conn.send(request(lookup_body(), version="1.0"))
    status, headers, got = conn.response()
    assert (status, headers.get("connection"), got) == (200, "close", want)
    assert conn.closed()

    calls = len(server.calls)
    conn = Conn(server)
    conn.send(request(lookup_body(), headers="expect: 100-continue\r\n"))
    assert conn.response()[2] == want
    assert len(server.calls) == calls + 1  # uvicorn's own cycle sends the 100 Continue


def test_pipelined_requests_are_answered_in_order(server):
    want = routed(server, lookup_body())
    conn = Conn(server)
    engines = b"GET /v1/engines HTTP/1.1\r\nhost: x\r\n\r\n"
    conn.send(request(lookup_body()) + request(lookup_body(TOKENS[:4])) + engines
              + request(lookup_body()) + request(b'{"prompt": "x"}') + request(lookup_body()))
    replies = [conn.response() for _ in range(6)]
    assert [r[0] for r in replies] == [200, 200, 200, 200, 422, 200]
    assert replies[0][2] == replies[3][2] == replies[5][2] == want
    assert "engines" in json.loads(replies[2][2])
    assert json.loads(replies[1][2])["engines"][0]["matched_tokens"] == 4


def test_a_busy_index_lock_sends_the_lookup_to_the_app(server):
    want = routed(server, lookup_body())
    calls = server.calls.count("/v1/lookup")
    lock = server.app.state.aggregator.index.lock
    held = threading.Event()

    def hold():
        with lock:
            held.set()
            time.sleep(0.3)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    conn = Conn(server)
    conn.send(request(lookup_body()))
    status, _, got = conn.response()
    t.join()
    assert (status, got) == (200, want)
    assert time.monotonic() - t0 > 0.1  # it waited for the lock, off the event loop
    assert server.calls.count("/v1/lookup") == calls + 1


def test_a_lookup_arriving_at_shutdown_is_answered_then_closed(server):
    want = routed(server, lookup_body())
    conn = Conn(server)
    raw = request(lookup_body())
    conn.send(raw[:-10])
    time.sleep(0.2)
    server.server.should_exit = True  # uvicorn's graceful shutdown asks each connection
    time.sleep(0.5)
    conn.send(raw[-10:])
    status, headers, got = conn.response()
    assert (status, headers.get("connection"), got) == (200, "close", want)
    assert conn.closed()
    server._thread.join(10)
    assert not server._thread.is_alive()


def test_the_setting_turns_it_off():
    from kvevents.cli.serve import uvicorn_config

    app = create_app(AggregatorSettings(engines=()))
    on, off = uvicorn_config(app), uvicorn_config(app, lookup_in_protocol=False)
    neither = uvicorn_config(app, lookup_in_protocol=False, openai_in_protocol=False)
    for config in (on, off, neither):
        config.load()
    assert on.http_protocol_class.guard_app is app
    assert on.http_protocol_class.routes.keys() == path_table().keys()
    assert off.http_protocol_class.routes.keys() == path_table(lookup=False).keys()  # OpenAI only
    assert LOOKUP_PATH not in off.http_protocol_class.routes
    assert off.http_protocol_class.__name__ == "HotPathProtocol"
    assert neither.http_protocol_class.__name__ == "GuardedHttpProtocol"  # the limits only


class _Parser:
    """The parts of httptools' parser the table's gate reads: a plain POST."""

    def get_method(self) -> bytes:
        return b"POST"

    def should_upgrade(self) -> bool:
        return False


def test_the_path_table_holds_every_hot_path_and_the_switches_remove_exactly_theirs(monkeypatch):
    from kvevents.api.conn_guard import GuardedHttpProtocol
    from kvevents.api.server_protocol import protocol_class
    from kvevents.gateway.endpoints import ENDPOINTS

    full = path_table()
    openai_rows = {row.path.encode(): (HotPathProtocol.take_openai, row.kind) for row in ENDPOINTS.values()}
    assert full == {LOOKUP_PATH: (HotPathProtocol.take_lookup, "lookup"), **openai_rows}
    assert path_table(lookup=False) == openai_rows
    assert path_table(openai=False) == {LOOKUP_PATH: full[LOOKUP_PATH]}
    assert path_table(lookup=False, openai=False) == {}

    app = create_app(AggregatorSettings(engines=()))
    for lookup, openai in ((True, True), (False, True), (True, False)):
        cls = protocol_class(app, lookup=lookup, openai=openai)
        assert cls.guard_app is app and cls.routes == path_table(lookup=lookup, openai=openai)
    neither = protocol_class(app, lookup=False, openai=False)
    assert neither.__name__ == "GuardedHttpProtocol" and not hasattr(neither, "routes")

    # Dispatch: the head of a table path calls its row with the row's kind, and only
    # that; any other path (or a row that declines) goes to uvicorn's own cycle.
    seen: list[tuple[bytes, str]] = []
    to_app: list[bytes] = []
    monkeypatch.setattr(GuardedHttpProtocol, "on_headers_complete", lambda self: to_app.append(self.url))
    cls = protocol_class(app)
    probe = type("Probe", (cls,), {"routes": {
        path: (lambda proto, kind: seen.append((proto.url, kind)) or kind != "tokenize", kind)
        for path, (_, kind) in cls.routes.items()}})
    for path in [*full, b"/v1/route", b"/v1/lookup?x=1", b"/v1/chat/completions/"]:
        proto = probe.__new__(probe)
        proto.url, proto.parser, proto.expect_100_continue, proto.cycle = path, _Parser(), False, None
        proto.on_headers_complete()
    assert seen == [(path, kind) for path, (_, kind) in full.items()]
    assert to_app == [b"/tokenize", b"/v1/route", b"/v1/lookup?x=1", b"/v1/chat/completions/"]
