"""What the gateway reads from an engine's answer (kvevents/gateway/answers.py): the
cached tokens it reports, whole or streamed, and nothing on a malformed answer; and a
whole answer's accounting, run once it is written however the writing ended."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvevents.gateway.answers import WholeAnswer, cached_tokens, stream_cached_tokens


def _answer(details: object) -> bytes:
    return json.dumps({"id": "x", "choices": [{"index": 0, "text": "cached_tokens?"}],
                       "usage": {"prompt_tokens": 9, "prompt_tokens_details": details}}).encode()


@pytest.mark.parametrize("body, expected", [
    (_answer({"cached_tokens": 32}), 32),
    (_answer({"cached_tokens": 0}), 0),
    (_answer({"cached_tokens": -1}), None),
    (_answer({"cached_tokens": True}), None),
    (_answer({"cached_tokens": 3.0}), None),
    (_answer({"cached_tokens": "3"}), None),
    (_answer({"cached_tokens": None}), None),
    (_answer(None), None),
    (_answer("cached_tokens"), None),
    (b'{"usage": null, "note": "cached_tokens"}', None),
    (b'["cached_tokens"]', None),
    (b'not json: cached_tokens', None),
    (b'{"x": ' + b"[" * 100_000 + b'"cached_tokens"' + b"]" * 100_000 + b"}", None),
    (b'{"choices": []}', None),
])
def test_cached_tokens_of_a_whole_answer(body, expected):
    assert cached_tokens(body) == expected


def test_cached_tokens_of_a_stream_come_from_its_last_usage_chunk():
    chunk = b'data: {"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":%d}}}\n\n'
    tail = chunk % 5 + chunk % 7 + b"data: [DONE]\n\n"
    assert stream_cached_tokens(tail) == 7
    assert stream_cached_tokens(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
    assert stream_cached_tokens(b'{"usage":{"prompt_tokens_details":{"cached_tokens":5}}}\n') is None
    assert stream_cached_tokens(b'data: {"usage": "cached_tokens"}\n\n') is None


@pytest.mark.parametrize("fails", [False, True])
def test_a_whole_answers_accounting_runs_once_it_is_written(fails):
    ran, sent = [], []

    async def send(message: dict) -> None:
        sent.append(message["type"])
        if fails and message["type"] == "http.response.body":
            raise OSError("client gone")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    answer = WholeAnswer(b"{}", 200, {"x-kvevents-engine": "e"}, lambda: ran.append(list(sent)))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    if fails:
        with pytest.raises(OSError):
            asyncio.run(answer(scope, receive, send))
    else:
        asyncio.run(answer(scope, receive, send))
    assert ran == [["http.response.start", "http.response.body"]]  # after the body, once
