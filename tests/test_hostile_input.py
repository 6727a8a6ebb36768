"""Hostile requests against the gateway, with real sockets: a real ``kvevents serve``
process in front of fake engines (:mod:`hostile_engine`), a fresh one per test.

* malformed bodies (invalid UTF-8, JSON nested 10,000 deep, a 7.9 MB prompt or tool call,
  a declared 100 MB body, a client that leaves mid-upload): each an OpenAI-shaped 4xx within 2 s with
  little memory (the prompt's characters are checked before tokenizing), the connection
  closed after a 413, a client gone mid-upload a counted 499 and no traceback;
* slowloris: connections that trickle a head or a body are closed by the head and body
  timeouts (and, past ``--max-connections``, make room for new ones), while well-behaved
  requests keep being answered quickly; the process's files come back once the attacker
  goes silent.
"""

from __future__ import annotations

import collections
import json
import re
import socket
import threading
import time

import httpx
import pytest

from hostile_support import fleet, tokenizer  # noqa: F401 (fixtures)
from hostile_support import (GatewayProcess, chat_body, connect, head_fields, named_requests,
                             raw_request, read_response, reset, series_count, wait_for)


def _response(s: socket.socket, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    head, body, _ = read_response(s, timeout=timeout)
    return (*head_fields(head), body)


def _closed(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``s`` within ``timeout`` (whatever it sends first is read)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except OSError:  # timed out
        return False


def _openai_error(status: int, body: bytes) -> dict:
    assert 400 <= status < 500, (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _message(content: bytes) -> bytes:
    return b'{"model":"fake","stream":true,"messages":[{"role":"user","content":' + content + b"}]}"


def test_malformed_bodies_are_4xx_quickly_with_little_memory(fleet, tokenizer):
    deep = b"[" * 10_000 + b"]" * 10_000
    words = b"The cache holds key and value tensors for every token the model has seen. "
    huge = _message(b'"' + words * (7_900_000 // len(words)) + b'"')
    assert len(huge) < 8 << 20  # under the body limit: the prompt's own limit must refuse it
    bodies = {
        "invalid UTF-8 in a message": (_message(b'"caf\xc3 \xff\xfe"'), "messages"),
        "nested 10,000 deep under an unknown field": (
            b'{"model":"fake","x":' + deep + b',"messages":[{"role":"user","content":"hi"}]}', None),
        "nested 10,000 deep in a message": (_message(deep), None),
        "a 7.9 MB prompt": (huge, "messages"),
        "a 7.9 MB tool call": (b'{"model":"fake","messages":[{"role":"assistant","content":null,"tool_calls":'
                               b'[{"id":"1","type":"function","function":{"name":"f","arguments":"'
                               + words * (7_900_000 // len(words)) + b'"}}]},{"role":"user","content":"hi"}]}',
                               "messages"),
    }
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        rss0 = g.rss_mb()
        for what, (body, _) in bodies.items():
            s = connect(g.port)
            t = time.monotonic()
            s.sendall(raw_request(g.port, body))
            status, _, answer = _response(s)
            took = time.monotonic() - t
            s.close()
            err = _openai_error(status, answer)
            assert took < 2, (what, took)
            assert g.rss_mb() - rss0 < 200, (what, g.rss_mb(), rss0)
            if what.startswith("a 7.9 MB"):
                assert "characters" in err["message"] and err["param"] == "messages", err

        # A declared 100 MB body: 413 at once, and the connection closed (the rest not read).
        s = connect(g.port)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 104857600\r\n\r\n" + b"x" * 65536)
        t = time.monotonic()
        status, headers, answer = _response(s)
        assert status == 413 and headers.get("connection") == "close", headers
        _openai_error(status, answer)
        assert _closed(s, 2) and time.monotonic() - t < 2
        s.close()

        # A client that leaves mid-upload: a counted 499, not a traceback.
        before = g.metric("kvevents_gateway_requests_total", status="499")
        for close in (socket.socket.close, reset):
            s = connect(g.port)
            body = chat_body(False)
            s.sendall(raw_request(g.port, body)[:-len(body) // 2])
            time.sleep(0.2)
            close(s)
        assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="499") == before + 2, 5)
        # The gateway still answers, and nothing reached an engine.
        r = httpx.post(g.url + "/v1/chat/completions", content=chat_body(False, 4), timeout=10)
        assert r.status_code == 200, r.text
        assert fleet.stats.started == 0  # the one good request was not streamed
        log = g.log_text()
        assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def _trickle(socks: list[socket.socket], data: list[bytes], stop: threading.Event, every: float) -> None:
    """Send each socket's data one byte every ``every`` seconds until ``stop``."""
    pos = [0] * len(socks)
    while not stop.wait(every):
        for i, s in enumerate(socks):
            if pos[i] < len(data[i]):
                try:
                    s.send(data[i][pos[i]:pos[i] + 1])
                    pos[i] += 1
                except OSError:
                    pos[i] = len(data[i])  # closed by the server


def test_the_characters_limit_counts_text_not_json_bytes(fleet, tokenizer):
    """``--max-prompt-chars`` counts the characters of the messages' strings: a chat
    whose JSON is far longer (escapes, keys, a tool call's structure) but whose text is
    at the limit is served; one character more is a 400 naming ``messages``."""
    limit = 300
    at_limit = json.dumps({"model": "fake", "stream": False, "max_tokens": 4, "messages": [
        {"role": "system", "content": "\u00e9" * 100},  # 100 characters in 600 bytes
        {"role": "user", "content": "x" * (limit - 100 - len("system") - len("user"))}]},
        ensure_ascii=True).encode()
    assert len(at_limit) > 2 * limit
    over = at_limit.replace(b'"x', b'"xy', 1)
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}",
                        "--max-prompt-chars", str(limit)) as g:
        r = httpx.post(g.url + "/v1/chat/completions", content=at_limit, timeout=10)
        assert r.status_code == 200, r.text
        r = httpx.post(g.url + "/v1/chat/completions", content=over, timeout=10)
        err = _openai_error(r.status_code, r.content)
        assert err["param"] == "messages" and f"{limit + 1} characters" in err["message"], err


def test_slowloris_connections_are_closed_and_good_clients_still_served(fleet, tokenizer):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}", "--header-timeout", "1",
                        "--body-timeout", "1", "--max-connections", "60") as g:
        fds0 = g.fds()
        heads, bodies = [], []
        for _ in range(80):  # trickle a head
            heads.append(connect(g.port))
        for _ in range(20):  # a whole head, then a 1 MB body a byte at a time
            s = connect(g.port)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: 1048576\r\n\r\n{")
            bodies.append(s)
        stop = threading.Event()
        data = [raw_request(g.port, chat_body(False))] * len(heads) + [b'"x":' * 1000] * len(bodies)
        attacker = threading.Thread(target=_trickle, args=(heads + bodies, data, stop, 0.2), daemon=True)
        attacker.start()
        latencies, statuses = [], []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # well-behaved requests meanwhile, one connection each
            s = connect(g.port)
            t = time.monotonic()
            s.sendall(raw_request(g.port, chat_body(False, 2), headers="connection: close\r\n"))
            status, _, _ = _response(s)
            latencies.append(time.monotonic() - t)
            statuses.append(status)
            s.close()
            time.sleep(0.02)
        stop.set()  # the attacker goes silent, its sockets still open
        attacker.join(5)
        assert set(statuses) == {200}, statuses
        latencies.sort()
        assert latencies[int(0.99 * (len(latencies) - 1))] < 0.25, latencies[-5:]
        assert all(_closed(s, 3) for s in heads + bodies)  # each closed by the server
        assert wait_for(lambda: g.fds() <= fds0 + 2, 5), (fds0, g.fds())
        assert g.metric("kvevents_gateway_connections_closed_total", reason="header_timeout") + \
            g.metric("kvevents_gateway_connections_closed_total", reason="evicted") >= 80
        assert g.metric("kvevents_gateway_connections_closed_total", reason="body_timeout") == 20
        assert g.metric("kvevents_gateway_requests_total", status="499") == 20
        assert "Exception in ASGI application" not in g.log_text()
        for s in heads + bodies:
            s.close()


def test_the_limits_come_from_flags_the_environment_and_the_config_file(tmp_path):
    from kvevents.api import create_app
    from kvevents.cli.main import build_parser
    from kvevents.cli.serve import uvicorn_config
    from kvevents.service.settings import SettingsError, load_settings

    args = build_parser().parse_args(["serve", "--max-connections", "7", "--header-timeout", "2.5",
                                      "--body-timeout", "4", "--max-prompt-chars", "1000"])
    assert (args.max_connections, args.header_timeout_s, args.body_timeout_s, args.max_prompt_chars) == \
        (7, 2.5, 4.0, 1000)
    env = {"KVEVENTS_MAX_CONNECTIONS": "9", "KVEVENTS_HEADER_TIMEOUT_S": "3",
           "KVEVENTS_BODY_TIMEOUT_S": "5", "KVEVENTS_MAX_PROMPT_CHARS": "2000"}
    s = load_settings(None, env=env)
    assert (s.max_connections, s.header_timeout_s, s.body_timeout_s, s.max_prompt_chars) == (9, 3, 5, 2000)
    config = tmp_path / "kv.toml"
    config.write_text("max_connections = 11\nheader_timeout_s = 6\n")
    s = load_settings(str(config), env={}, body_timeout_s=8)
    assert (s.max_connections, s.header_timeout_s, s.body_timeout_s, s.max_prompt_chars) == \
        (11, 6, 8, 4_000_000)
    with pytest.raises(SettingsError, match="header.timeout"):
        load_settings(None, env={}, header_timeout_s=0)
    # The server's protocol takes them from the app's settings.
    http = uvicorn_config(create_app(s)).http
    assert (http.limits.max_connections, http.limits.header_timeout_s, http.limits.body_timeout_s) == (11, 6, 8)


def test_client_chosen_names_mint_no_series_and_no_memory(fleet, tokenizer):
    """10,000 requests naming random models, adapters, salts, sessions, headers, paths and
    engines, to every endpoint that takes a name: none gets a 5xx, and the series on
    ``/metrics`` and the process's RSS stay where one round of each left them (a label
    value from a request would add a series per request)."""
    import asyncio

    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}", "--auth-token", "s3cret") as g:
        async def send(n: int) -> collections.Counter:
            statuses: collections.Counter = collections.Counter()
            async with httpx.AsyncClient(base_url=g.url, timeout=30) as client:
                async def worker(w: int) -> None:
                    for k in range(w, n, 16):
                        for name, method, path, body, headers in named_requests(k):
                            resp = await client.request(method, path, json=body, headers=headers)
                            statuses[(name, resp.status_code)] += 1
                await asyncio.gather(*(worker(w) for w in range(16)))
            return statuses

        asyncio.run(send(32))  # every fixed series born (statuses, buckets, the engines')
        time.sleep(0.5)
        series0, rss0 = series_count(httpx.get(g.url + "/metrics").text), g.rss_mb()
        statuses = asyncio.run(send(10_000 // len(named_requests(0)) + 1))
        text = httpx.get(g.url + "/metrics").text
        series1, rss1 = series_count(text), g.rss_mb()
    assert sum(statuses.values()) >= 10_000
    assert not [k for k in statuses if k[1] >= 500], statuses
    assert not re.search(r'="(m-|fake:)?[0-9a-f]{32}"', text), "a client-chosen name became a label value"
    assert series1 - series0 <= 5, f"{series0} -> {series1} series after {sum(statuses.values())} requests"
    assert rss1 - rss0 < 40, f"RSS {rss0:.0f} -> {rss1:.0f} MB"
    print(f"{sum(statuses.values())} requests with random names: series {series0} -> {series1}, "
          f"RSS {rss0:.0f} -> {rss1:.0f} MB; statuses {dict(statuses)}")
