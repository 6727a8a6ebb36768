"""The OpenAI requests handed to the gateway from ``kvevents serve``'s HTTP protocol
(``kvevents.api.server_protocol``), with real sockets against a real ``kvevents serve``
in front of fake engines (:mod:`hostile_engine`):

* the answers are byte for byte those of the app's own route (``openai_in_protocol``
  false), streamed and not, on one kept-alive connection mixed with other endpoints;
* pipelined requests are answered in order; ``Connection: close`` closes after the
  answer; what the protocol does not take (HTTP/1.0, a chunked body, a body over the
  limit) is still answered by the app;
* a client that leaves mid-upload is a counted 499, and no engine saw its request.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from hostile_support import fleet, tokenizer  # noqa: F401 (fixtures)
from hostile_support import GatewayProcess, chat_body, connect, raw_request, read_response, wait_for


def normalise(head: bytes) -> bytes:
    """The head without its date and the engine's name (the headers that change between
    answers and between two gateways' routing)."""
    return re.sub(rb"\r\n(date|x-kvevents-engine): [^\r]*", b"", head)


def exchange(port: int, requests: list[bytes]) -> list[tuple[bytes, bytes]]:
    s = connect(port)
    out, rest = [], b""
    for req in requests:
        s.sendall(req)
        head, body, rest = read_response(s, rest)
        out.append((normalise(head), body))
    s.close()
    return out


def script(port: int) -> list[bytes]:
    lookup = json.dumps({"token_ids": list(range(64))}).encode()
    return [raw_request(port, chat_body(True, 20)),
            raw_request(port, chat_body(False, 5)),
            raw_request(port, lookup, "/v1/lookup"),
            raw_request(port, json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 3,
                                          "stream": True}).encode(), "/v1/completions"),
            raw_request(port, b"{not json"),
            raw_request(port, json.dumps({"model": "nope", "messages": [
                {"role": "user", "content": "x"}]}).encode()),
            raw_request(port, chat_body(True, 7))]


def test_answers_equal_the_apps_on_one_kept_alive_connection(fleet, tokenizer):
    got = {}
    for flag in ("true", "false"):
        env = {"KVEVENTS_OPENAI_IN_PROTOCOL": flag}
        with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}", env=env) as g:
            got[flag] = exchange(g.port, script(g.port))
            assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="200") == 4, 5)
            assert g.metric("kvevents_gateway_requests_total", status="400") == 1
            assert g.metric("kvevents_gateway_requests_total", status="404") == 1
    assert got["true"] == got["false"]
    heads = [h for h, _ in got["true"]]
    assert heads[0].startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in heads[0]
    assert b"content-length" in heads[1] and b"server: uvicorn" in heads[1]
    assert got["true"][0][1].rstrip().endswith(b"data: [DONE]")
    assert heads[4].startswith(b"HTTP/1.1 400") and heads[5].startswith(b"HTTP/1.1 404")


def test_pipelined_requests_are_answered_in_order_and_close_is_honoured(fleet, tokenizer):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        s = connect(g.port)
        bodies = [chat_body(True, n) for n in (30, 3, 12)]
        s.sendall(b"".join(raw_request(g.port, b) for b in bodies))  # all at once
        rest = b""
        for n in (30, 3, 12):
            head, body, rest = read_response(s, rest)
            assert head.startswith(b"HTTP/1.1 200")
            assert body.count(b'"delta"') == n and body.rstrip().endswith(b"data: [DONE]")
        s.sendall(raw_request(g.port, chat_body(False, 2), headers="connection: close\r\n"))
        head, _, rest = read_response(s, rest)
        assert b"connection: close" in head.lower()
        s.settimeout(5)
        assert rest == b"" and s.recv(10) == b""  # closed by the gateway
        s.close()


@pytest.mark.parametrize("how", ["http/1.0", "chunked body", "over the limit"])
def test_what_the_protocol_does_not_take_the_app_answers(fleet, tokenizer, how):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}",
                        env={"KVEVENTS_MAX_BODY_BYTES": "4096"}) as g:
        body = chat_body(False, 3)
        s = connect(g.port)
        if how == "http/1.0":
            s.sendall(f"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: {len(body)}\r\n"
                      f"content-type: application/json\r\n\r\n".encode() + body)
        elif how == "chunked body":
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                      f"content-type: application/json\r\n\r\n{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        else:
            big = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
            s.sendall(raw_request(g.port, big))
        head, answer, _ = read_response(s)
        s.close()
        if how == "over the limit":
            assert head.startswith(b"HTTP/1.1 413"), head
            assert json.loads(answer)["error"]["type"] == "invalid_request_error"
        else:
            assert head.split(b" ")[1] == b"200", head
            assert json.loads(answer)["choices"][0]["message"]["content"]


def test_a_client_that_leaves_mid_upload_is_a_499_and_reaches_no_engine(fleet, tokenizer):
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        body = chat_body(True, 5)
        s = connect(g.port)
        s.sendall(raw_request(g.port, body)[:-10])  # all but the body's last bytes
        time.sleep(0.3)
        s.close()
        assert wait_for(lambda: g.metric("kvevents_gateway_requests_total", status="499") == 1, 5)
        assert fleet.stats.started == 0
        assert "Traceback" not in g.log_text()
        # The slot came back: a full request still goes through.
        r = httpx.post(g.url + "/v1/chat/completions", content=chat_body(False, 2),
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 200
