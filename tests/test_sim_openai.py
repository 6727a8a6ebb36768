"""The simulated engine process's OpenAI-compatible HTTP front (``--http-port``), end to
end: real engine processes (``python -m kvevents.sim.process``), real HTTP clients
(``httpx`` and, when installed, the official ``openai`` client), a tokenizer directory
built locally (``tests/text_tokenizer.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import free_port, wait_until
from text_tokenizer import build_bytelevel, require_transformers
from kvevents.demo.fleet import EngineClient

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "system", "content": "You route prompts to the engine that holds them."},
        {"role": "user", "content": "The cache holds key and value tensors."}]


class SimEngine:
    """``python -m kvevents.sim.process`` with the front on, stopped on exit."""

    def __init__(self, *extra: str, gpu_blocks: int = 256) -> None:
        self.rpc, self.http = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvevents.sim.process", "--name", "e0", "--bind", "127.0.0.1",
             "--events-port", str(free_port()), "--replay-port", str(free_port()),
             "--rpc-port", str(self.rpc), "--metrics-port", "0", "--gpu-blocks", str(gpu_blocks),
             "--cpu-blocks", "256", "--offloaded-block-size", "32",
             "--http-port", str(self.http), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not wait_until(lambda: "READY e0" in self.lines or self.proc.poll() is not None, 60):
            self.close()
            raise RuntimeError("engine did not start")
        assert self.proc.poll() is None, "\n".join(self.lines)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def post(self, path: str, body, **kw) -> httpx.Response:
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, timeout=kw.pop("timeout", 20), **kw)
        return httpx.post(self.url + path, json=body, timeout=kw.pop("timeout", 20), **kw)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    require_transformers()
    return build_bytelevel(tmp_path_factory.mktemp("tok") / "chat")


@pytest.fixture(scope="module")
def engine(tokdir):
    """An engine with the front and the tokenizer; ends with the ``stop`` op."""
    eng = SimEngine("--tokenizer", str(tokdir), "--model", "m")
    yield eng
    client = EngineClient(zmq.Context.instance(), "e0", None, f"tcp://127.0.0.1:{eng.rpc}")
    try:
        client.call({"op": "stop"}, "stopped", 10)
        assert eng.proc.wait(10) == 0
    finally:
        client.close()
        eng.close()


def sse(resp: httpx.Response) -> list:
    """The ``data:`` payloads of an event stream, ``[DONE]`` kept as a string."""
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def stable(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in ("id", "created", "usage")}


def test_completions_plain_stream_usage_and_prefix_cache(engine):
    prompt = list(range(100, 164))  # 4 full blocks
    body = {"model": "m", "prompt": prompt, "max_tokens": 7, "temperature": 0.5, "user": "u"}
    first = engine.post("/v1/completions", body).json()
    assert first["object"] == "text_completion" and first["model"] == "m"
    assert first["usage"]["prompt_tokens"] == 64 and first["usage"]["completion_tokens"] == 7
    assert first["usage"]["total_tokens"] == 71
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "length" and choice["text"].strip()
    second = engine.post("/v1/completions", {**body, "prompt": [prompt]}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same prefix again
    assert stable(second) == stable(first) and second["id"] != first["id"]

    chunks = sse(engine.post("/v1/completions", {**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}))
    assert chunks[-1] == "[DONE]"
    *tokens, usage = chunks[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(tokens) == 7 and all(c["object"] == "text_completion" for c in tokens)
    assert "".join(c["choices"][0]["text"] for c in tokens) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 6 + ["length"]
    plain = sse(engine.post("/v1/completions", {**body, "stream": True}))
    assert plain[-1] == "[DONE]" and all("usage" not in c for c in plain[:-1])
    assert len(plain) == 8


def test_concurrent_requests_get_their_own_answers(engine):
    prompts = [[7, i, i + 1, 300 + i] * 5 for i in range(8)]
    alone = [engine.post("/v1/completions", {"prompt": p, "max_tokens": 5}).json()["choices"]
             for p in prompts]
    assert len({c[0]["text"] for c in alone}) > 1  # the text depends on the prompt

    async def together():
        async with httpx.AsyncClient(base_url=engine.url, timeout=20) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 5}) for p in prompts))
            return [r.json()["choices"] for r in rs]

    assert asyncio.run(together()) == alone


def test_chat_with_the_tokenizer(engine, tokdir):
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(tokdir).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    tok = engine.post("/tokenize", {"model": "m", "messages": CHAT}).json()
    assert tok == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}

    body = {"model": "m", "messages": CHAT, "max_completion_tokens": 6}
    answer = engine.post("/v1/chat/completions", body).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["prompt_tokens"] == len(ids)
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["message"]["content"].split()) == 6  # one vocabulary word per token
    chunks = sse(engine.post("/v1/chat/completions", {**body, "stream": True}))
    assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == \
        choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"

    text = engine.post("/tokenize", {"prompt": "The cache holds key"}).json()
    assert text["tokens"][0] == 0 and text["count"] == len(text["tokens"])  # BOS added
    by_text = engine.post("/v1/completions", {"prompt": "The cache holds key", "max_tokens": 3})
    by_ids = engine.post("/v1/completions", {"prompt": text["tokens"], "max_tokens": 3})
    assert by_text.json()["choices"] == by_ids.json()["choices"]


def test_openai_client(engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["m"]
    prompt = list(range(400, 440))
    done = client.completions.create(model="m", prompt=prompt, max_tokens=5)
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    parts, usage = [], None
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}):
        parts += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == done.choices[0].text
    assert usage.prompt_tokens_details.cached_tokens > 0
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=4, stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=[1], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt=[1] * 5000, max_tokens=1)
    assert err.value.code == "context_length_exceeded"


def test_models_health_tokenize_metrics(engine):
    models = httpx.get(engine.url + "/v1/models").json()
    assert models["object"] == "list"
    (m,) = models["data"]
    assert (m["id"], m["object"], m["owned_by"], m["max_model_len"]) == \
        ("m", "model", "kvevents-sim", 4096)
    health = httpx.get(engine.url + "/health")
    assert health.status_code == 200 and health.content == b""
    resp = httpx.get(engine.url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total"):
        assert f'\n{name}{{engine="e0",model_name="m"}}' in resp.text
    assert engine.metric("vllm:request_success_total") >= 1


def test_a_client_that_leaves_is_counted_and_nothing_leaks(engine):
    before = engine.metric("kvevents_sim_http_disconnects_total")
    with pytest.raises(httpx.TimeoutException):
        # Long enough that no warm cache answers it before the client gives up.
        engine.post("/v1/completions", {"prompt": [5] * 16, "max_tokens": 4000}, timeout=0.05)
    assert wait_until(lambda: engine.metric("kvevents_sim_http_disconnects_total") == before + 1, 30)
    assert engine.metric("kvevents_sim_http_inflight") == 0
    assert engine.post("/v1/completions", {"prompt": [5] * 16, "max_tokens": 2}).status_code == 200


BAD = [
    ("/v1/completions", b"{", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", b"[" * 100_000, 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], [2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [600]}, 400, "prompt"),  # outside the tokenizer's vocabulary
    ("/v1/completions", {"prompt": [True]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 4096}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 4096}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": [1], "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": [1], "stream": True, "stream_options": 1}, 400, "stream_options"),
    ("/v1/completions", {"prompt": [1], "model": 3}, 400, "model"),
    ("/v1/completions", {"prompt": [1], "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_bodies_are_openai_errors_naming_the_param(engine, path, body, status, param):
    resp = engine.post(path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


def test_unknown_routes_and_methods_are_openai_errors(engine):
    for resp in (httpx.get(engine.url + "/v2/nothing"), httpx.delete(engine.url + "/health")):
        assert resp.status_code in (404, 405) and set(resp.json()["error"]) >= {"message", "code"}


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 40) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(["prompt", "messages", "max_tokens", "stream", "stream_options", "model",
                         "n", "role", "content", "include_usage"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
       body=st.dictionaries(_keys, _json, max_size=4))
def test_no_body_gets_a_5xx(engine, path, body):
    resp = engine.post(path, body)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_without_tokenizer_ids_only_rpc_unchanged_and_sigterm_exits():
    eng = SimEngine()
    try:
        for path, body, param in (("/v1/completions", {"prompt": "hello"}, "prompt"),
                                  ("/v1/completions", {"prompt": ["hello"]}, "prompt"),
                                  ("/v1/chat/completions", {"messages": CHAT}, "messages"),
                                  ("/tokenize", {"prompt": "hello"}, "prompt"),
                                  ("/v1/completions", {"prompt": [2**31]}, "prompt")):
            resp = eng.post(path, body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        ok = eng.post("/v1/completions", {"model": "sim", "prompt": [40000, 1, 2], "max_tokens": 3})
        assert ok.json()["choices"][0]["text"].startswith(" tok")
        # The msgpack RPC works as before, beside the front.
        client = EngineClient(zmq.Context.instance(), "e0", None, f"tcp://127.0.0.1:{eng.rpc}")
        try:
            done = client.call({"op": "submit", "id": "r1", "token_ids": list(range(40)),
                                "max_new_tokens": 2}, "done", 10)
            assert done["id"] == "r1" and done["prompt_tokens"] == 40
        finally:
            client.close()
        # SIGTERM with the front busy: a request in flight, a keep-alive connection open.
        with httpx.Client(base_url=eng.url, timeout=20) as keep:
            assert keep.get("/health").status_code == 200
            results: list = []

            def long_request():
                try:
                    results.append(eng.post("/v1/completions", {"prompt": [3] * 16,
                                                                 "max_tokens": 4000}).status_code)
                except httpx.HTTPError as exc:
                    results.append(type(exc).__name__)

            t = threading.Thread(target=long_request)
            t.start()
            assert wait_until(lambda: eng.metric("vllm:num_requests_running") == 1, 10)
            eng.proc.send_signal(signal.SIGTERM)
            assert eng.proc.wait(15) == 0
            t.join(10)
            assert results and results[0] in (503, "RemoteProtocolError", "ReadError"), results
    finally:
        eng.close()


def test_a_taken_http_port_fails_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "kvevents.sim.process", "--name", "x", "--metrics-port", "0",
             "--rpc-port", str(free_port()), "--events-port", str(free_port()),
             "--replay-port", str(free_port()), "--http-port", str(port)],
            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        f"kvevents.sim.process: error: --http-port {port} on 127.0.0.1: Address already in use"


def test_http_is_off_by_default():
    from kvevents.sim.process import parse_args

    args = parse_args(["--name", "e"])
    assert (args.http_port, args.http_addr, args.model, args.tokenizer) == (0, "127.0.0.1", None, None)


def test_token_interval_paces_streams_only():
    """``--http-token-interval``: a streamed answer's chunks come that far apart (a stream
    held open for a known time); a plain answer is not delayed."""
    from kvevents.sim.process import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--name", "e", "--http-port", "1", "--http-token-interval", "-1"])
    eng = SimEngine("--http-token-interval", "0.1")
    try:
        body = {"model": "sim", "prompt": [7] * 16, "max_tokens": 6}
        t0 = time.monotonic()
        assert eng.post("/v1/completions", body).status_code == 200
        plain = time.monotonic() - t0
        arrivals = []
        with httpx.Client(timeout=20) as c, c.stream("POST", eng.url + "/v1/completions",
                                                      json={**body, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
        assert len(arrivals) == 6
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert min(gaps) >= 0.08 and plain < 0.4, (gaps, plain)
    finally:
        eng.close()
