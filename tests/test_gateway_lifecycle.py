"""Every request's life ends in exactly one count and one release, however it ends
(:mod:`kvevents.gateway.lifecycle`): a real ``kvevents serve`` in front of two fake
engines (:mod:`hostile_engine`) and a third that stops listening once the gateway
follows it (its connections refused until a poll marks it unreachable), driven with
every kind of ending at once: whole and streamed answers, a client that leaves before
its answer or in the middle of it, an engine that breaks off, a refused connection
retried elsewhere, a body the gateway refuses, a model no engine serves, Responses,
embeddings. Afterwards nothing is held: the gateway's slots (a full ``max_inflight``
admits again), every engine's in-flight count and gauge, the engines' open streams; and
the requests counted are the requests sent."""

from __future__ import annotations

import json
import socket
import threading

import httpx

from hostile_support import GatewayProcess, chat_body, connect, engines, fleet, raw_request, wait_for  # noqa: F401

_SENT_EACH = 6  # requests of each kind


def _post(url: str, path: str, body: dict, timeout: float = 20) -> int:
    return httpx.post(url + path, json=body, timeout=timeout).status_code


def _stream(url: str, body: dict) -> int:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
        for _ in r.iter_raw():
            pass
        return r.status_code


def _leave_mid_stream(port: int) -> None:
    s = connect(port)
    s.sendall(raw_request(port, chat_body(True, 400)))
    got = b""
    while got.count(b"data: ") < 3:
        piece = s.recv(65536)
        if not piece:
            break
        got += piece
    s.close()


def _leave_before_answer(port: int) -> None:
    s = connect(port)
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 4, "stream": False, "fake_delay_ms": 1000}).encode()
    s.sendall(raw_request(port, body))
    s.settimeout(0.3)
    try:
        s.recv(1)
    except socket.timeout:
        pass
    s.close()


def test_every_ending_counts_once_and_releases_everything(fleet):  # noqa: F811
    third = engines(1)
    with GatewayProcess([*fleet.urls, *third.urls], "--max-inflight", "8") as g:
        third.close()  # (refused from now on: a request sent there is retried elsewhere)
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        kinds = {
            "whole": lambda: _post(g.url, "/v1/chat/completions", chat),
            "streamed": lambda: _stream(g.url, {**chat, "stream": True,
                                                "stream_options": {"include_usage": True}}),
            "left mid-stream": lambda: _leave_mid_stream(g.port),
            "left before its answer": lambda: _leave_before_answer(g.port),
            "engine broke off": lambda: _stream(g.url, {**chat, "stream": True, "max_tokens": 20,
                                                        "fake_break_after": 3}),
            "bad body": lambda: _post(g.url, "/v1/chat/completions", {"model": "fake", "messages": 7}),
            "unknown model": lambda: _post(g.url, "/v1/chat/completions", {**chat, "model": "nope"}),
            "responses": lambda: _post(g.url, "/v1/responses", {"model": "fake", "input": "hi",
                                                                "stream": True}),
            "embeddings": lambda: _post(g.url, "/v1/embeddings", {"model": "fake", "input": "hi"}),
        }
        errors: list[BaseException] = []

        def run(fn) -> None:
            try:
                for _ in range(_SENT_EACH):
                    fn()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(fn,)) for fn in kinds.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        sent = _SENT_EACH * len(kinds)
        assert wait_for(lambda: g.metric("kvevents_gateway_requests_total") == sent, 10), \
            (g.metric("kvevents_gateway_requests_total"), sent)
        assert g.metric("kvevents_gateway_requests_total", status="499") == 2 * _SENT_EACH
        assert g.metric("kvevents_gateway_requests_total", status="404") == _SENT_EACH
        assert g.metric("kvevents_gateway_requests_total", status="400") == _SENT_EACH
        assert g.metric("kvevents_gateway_requests_total", status="502") == _SENT_EACH  # (broke off)
        assert wait_for(lambda: g.metric("kvevents_gateway_inflight_requests") == 0, 5)
        listed = httpx.get(g.url + "/v1/engines", timeout=5).json()["engines"]
        assert all(e["gateway"]["inflight"] == 0 for e in listed), listed
        assert wait_for(lambda: fleet.stats.open == 0, 5), fleet.stats.as_dict()
        # Every slot was given back: max_inflight requests at once are all admitted.
        codes: list[int] = []
        burst = [threading.Thread(target=lambda: codes.append(_post(g.url, "/v1/chat/completions", chat)))
                 for _ in range(8)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(30)
        assert codes == [200] * 8, codes
