"""``max_prompt_chars`` on the aggregator's own endpoints that tokenize text.

``POST /v1/lookup`` and ``POST /v1/route`` given ``prompt`` text or chat ``messages``
longer than ``max_prompt_chars`` characters answer 400 naming the field and the limit
before any tokenizer sees the text: against a real ``kvevents serve`` process (real
sockets, the real tokenizer loaded), a text one character over the default limit
(4,000,000) is refused within a second and the process's RSS barely moves, where
tokenizing it would cost hundreds of MB. One exactly at a (smaller) limit is still
tokenized and answered; token-id bodies are untouched by the limit.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import msgspec

from hostile_support import fleet, tokenizer  # noqa: F401 (fixtures)
from hostile_support import GatewayProcess, connect, head_fields, raw_request, read_response
from kvevents.api.body import LookupBody
from kvevents.text.limits import check_chars, text_chars
from kvevents.text.prompt import InputError

DEFAULT_LIMIT = 4_000_000
WORDS = "The cache holds key and value tensors for every token the model has seen. "


def _text(n: int) -> str:
    return (WORDS * (n // len(WORDS) + 1))[:n]


def _bodies(chars: int) -> dict[str, tuple[dict, str]]:
    """Bodies whose prompt text has exactly ``chars`` characters (as counted: every
    string a chat template may render), by what they are, with the field they use."""
    half = chars // 2
    return {
        "prompt": ({"model": "fake", "prompt": _text(chars)}, "prompt"),
        # role "system" (6) + content, role "user" (4) + two text parts ("text" twice)
        "messages": ({"model": "fake", "messages": [
            {"role": "system", "content": _text(half - 6)},
            {"role": "user", "content": [{"type": "text", "text": _text(chars - half - 4 - 8 - 10)},
                                         {"type": "text", "text": _text(10)}]}]}, "messages"),
        # the bulk in a tool call's arguments, which the chat template renders too
        "tool call": ({"model": "fake", "messages": [
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
                "name": "f", "arguments": _text(chars - 9 - 1 - 8 - 1 - 4 - 2)}}]},
            {"role": "user", "content": "hi"}]}, "messages"),
    }


def _post(port: int, path: str, body: bytes) -> tuple[int, dict, float]:
    """One request on a fresh socket: (status, JSON answer, seconds from the first byte
    sent to the whole answer read)."""
    s = connect(port)
    try:
        t = time.monotonic()
        s.sendall(raw_request(port, body, path=path))
        head, answer, _ = read_response(s)
        return head_fields(head)[0], json.loads(answer), time.monotonic() - t
    finally:
        s.close()


def test_counting_is_per_string_over_dicts_lists_and_structs():
    for chars in (100, 2_001, 4_000_001):
        for what, (body, _) in _bodies(chars).items():
            assert text_chars(body.get("prompt", body.get("messages"))) == chars, what
    # The same messages decoded as the API decodes them (ChatMessage / TextPart Structs,
    # the parts' "type" a tag, not a field): the same count.
    for what in ("messages", "tool call"):
        body, _ = _bodies(2_001)[what]
        decoded = msgspec.json.decode(json.dumps(body), type=LookupBody)
        assert text_chars(decoded.messages) == 2_001, what
    assert text_chars(None) == 0 and text_chars([1, 2.5, None, {"k": 3}]) == 0

    class Text(str):
        pass

    class Items(list):
        pass
    assert text_chars((Text("abc"), Items([{"a": Text("de")}]), ("f",))) == 6  # subclasses too
    check_chars("x" * 10, 10, "prompt")  # at the limit: fine
    try:
        check_chars(["x" * 6, {"a": "y" * 5}], 10, "messages")
    except InputError as exc:
        assert (exc.status, exc.field) == (400, "messages")
        assert "11 characters" in exc.message and "10" in exc.message and "max_prompt_chars" in exc.message
    else:
        raise AssertionError("11 characters passed a limit of 10")


def test_text_over_the_default_limit_is_refused_before_tokenizing(fleet, tokenizer):
    over = {what: json.dumps(b).encode() for what, (b, _) in _bodies(DEFAULT_LIMIT + 1).items()}
    assert all(len(b) < 8 << 20 for b in over.values())  # under the body limit: the chars refuse it
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}") as g:
        # Warm the process (a lookup by text loads the tokenizer's lazy parts) before
        # measuring, so the figure is what the refusals cost.
        r = httpx.post(g.url + "/v1/lookup", json={"model": "fake", "prompt": _text(1000)}, timeout=10)
        assert r.status_code == 200, r.text
        rss0, cpu0 = g.rss_mb(), g.cpu_s()
        for path in ("/v1/lookup", "/v1/route"):
            for what, raw in over.items():
                status, answer, took = _post(g.port, path, raw)
                field = _bodies(100)[what][1]
                assert status == 400, (path, what, status, answer)
                assert answer["field"] == field, (path, what, answer)
                assert f"{field} has {DEFAULT_LIMIT + 1} characters" in answer["error"], answer
                assert f"{DEFAULT_LIMIT} (max_prompt_chars)" in answer["error"], answer
                assert took < 1.0, (path, what, took)
                # Tokenizing 4M characters costs ~600 MB here; decoding the body a few.
                assert g.rss_mb() - rss0 < 64, (path, what, g.rss_mb(), rss0)
        cpu = g.cpu_s() - cpu0
        assert cpu < 3.0, cpu  # six 4 MB bodies received and decoded, nothing tokenized
        print(f"\n6 refusals of {DEFAULT_LIMIT + 1}-char texts: process CPU {cpu:.2f} s, "
              f"RSS {rss0:.0f} -> {g.rss_mb():.0f} MB (pid {g.proc.pid}, {os.cpu_count()} CPUs)")
        assert "Traceback" not in g.log_text()


def test_text_at_the_limit_is_tokenized_and_ids_are_not_limited(fleet, tokenizer):
    limit = 3_000
    with GatewayProcess(fleet.urls, "--tokenizer", f"fake={tokenizer}",
                        "--max-prompt-chars", str(limit)) as g:
        for path in ("/v1/lookup", "/v1/route"):
            for what, (body, field) in _bodies(limit).items():
                r = httpx.post(g.url + path, json=body, timeout=10)
                assert r.status_code == 200, (path, what, r.text)
                assert r.json()["engine" if path == "/v1/route" else "prompt_tokens"], r.json()
            for what, (body, field) in _bodies(limit + 1).items():
                r = httpx.post(g.url + path, json=body, timeout=10)
                assert r.status_code == 400 and r.json()["field"] == field, (path, what, r.text)
                assert f"{field} has {limit + 1} characters; the limit is {limit}" in r.json()["error"]
            # Token ids (the common body, answered in the protocol) are not characters.
            r = httpx.post(g.url + path, json={"model": "fake", "token_ids": list(range(limit + 100))},
                           timeout=10)
            assert r.status_code == 200, (path, r.text)
        # The limit is checked before the model's tokenizer is looked for: an unknown
        # model's oversized text is the size's 400, a fitting one the model's 422.
        big = {"model": "nope", "prompt": _text(limit + 1)}
        r = httpx.post(g.url + "/v1/lookup", json=big, timeout=10)
        assert (r.status_code, r.json()["field"]) == (400, "prompt"), r.text
        r = httpx.post(g.url + "/v1/lookup", json={**big, "prompt": _text(limit)}, timeout=10)
        assert (r.status_code, r.json()["field"]) == (422, "model"), r.text
