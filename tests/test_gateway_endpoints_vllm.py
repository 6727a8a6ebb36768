"""``/v1/responses``, ``/tokenize`` and ``/detokenize`` through ``kvevents serve`` in front
of a real vLLM 0.32 OpenAI server (CPU, the tiny model, responses stored:
``VLLM_ENABLE_RESPONSES_API_STORE=1``) and a fake engine of the same model that answers
as vLLM's does (:mod:`hostile_engine`; one real engine at a time on this machine), with
the official ``openai`` client.

Checks: a response's prompt is the one vLLM renders (the gateway predicts exactly the
cached tokens vLLM reports for it, so its ids were the engine's), its text equals the
engine's own answer, streamed and not, and a stream's end and usage are found; every
``previous_response_id`` follow-up is answered by the engine that stored the response
(the real one answers from its store; the fake one would 404 a response it does not
hold); a response the engine does not have is vLLM's 404, whose message the gateway's
own 404 repeats; ``/tokenize`` and ``/detokenize`` answers relayed unchanged. Embeddings
need a pooling model (a second real engine): they are checked against the fake engine in
:mod:`test_gateway_endpoints`.

Where vLLM is not installed these tests skip; under ``CI=true`` a missing vLLM fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import free_port, require_vllm, stop_process, wait_gateway_engines, wait_until

ROOT = Path(__file__).resolve().parent.parent
require_vllm()

import httpx  # noqa: E402

from hostile_engine import EngineThread  # noqa: E402
from kvevents.demo.vllm_server import VllmServer, server_env  # noqa: E402
from kvevents.gateway.endpoints import RESPONSE_END  # noqa: E402

openai = pytest.importorskip("openai")

MODEL = "tiny"
pytestmark = pytest.mark.timeout(600)
LONG = "The quick brown fox jumps over the lazy dog, and then it naps. " * 12
GREEDY = {"temperature": 0, "max_output_tokens": 6}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvevents.demo.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("endpoints-vllm")
    model = make_tiny_model(tmp / "tiny-llama", tokenizer=True)
    live, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    fake = EngineThread([free_port()])
    fake.stats.tokenize_prompts = True
    engine = VllmServer(model, endpoint=live, replay_endpoint=replay, served_model_name=MODEL,
                        num_gpu_blocks=160, max_model_len=4096, log=tmp / "vllm.log",
                        env={**os.environ, "VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    port, http = free_port(), f"http://127.0.0.1:{engine.port}"
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--tokenizer", f"{MODEL}={model}", "--engine-poll-interval", "0.5",
           "--endpoint", f"e0={live},replay={replay},model={MODEL},http={http},bind=1",
           "--endpoint", f"e1=tcp://127.0.0.1:{free_port()},model={MODEL},http={fake.urls[0]}"]
    serve_log = tmp / "serve.log"
    with open(serve_log, "w") as log:
        serve = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    engine.start()
    gw = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        engine.wait_ready(420)
        print(f"\nengine ready in {time.monotonic() - t0:.0f} s")

        wait_gateway_engines(gw, 2, serve, serve_log, connected=False)  # (the fake has no events)
        yield {"gw": gw, "engine": engine, "fake": fake, "log": serve_log,
               "client": openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)}
    finally:
        engine.stop()
        fake.close()
        stop_process(serve, timeout=20)


def _metric(gw: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(gw + "/metrics", timeout=5).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _text(doc: dict) -> str:
    return "".join(c["text"] for item in doc["output"] if item["type"] == "message" for c in item["content"])


def test_responses_are_routed_by_their_cached_prefix_and_equal_the_engines(stack):
    gw, engine, client = stack["gw"], stack["engine"], stack["client"]
    body = {"model": MODEL, "input": LONG, "instructions": "Answer briefly.", **GREEDY}
    direct = httpx.post(engine.url + "/v1/responses", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    # The engine now holds the prompt, and once its KV events told the gateway, the
    # request is sent there (the chat vLLM renders from the body, asked of the index).
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "Answer briefly."},
                                         {"role": "user", "content": LONG}],
            "add_special_tokens": True}  # (as vLLM tokenizes a response's text)

    def held() -> bool:
        got = httpx.post(gw + "/v1/lookup", json=chat, timeout=5).json()
        return any(e["engine"] == "e0" and e["matched_tokens"] >= 256 for e in got["engines"])
    if not wait_until(held, timeout=30, interval=0.2):
        print(httpx.post(gw + "/v1/lookup", json=chat).text, httpx.get(gw + "/v1/engines").text,
              httpx.get(gw + "/metrics").text[-6000:], stack["log"].read_text()[-2000:])
        raise AssertionError("the engine's KV events never told the gateway it holds the prompt")
    before = (_metric(gw, "kvevents_gateway_predicted_cached_tokens_total", engine="e0"),
              _metric(gw, "kvevents_gateway_reported_cached_tokens_total", engine="e0"))
    raw = client.responses.with_raw_response.create(**body)
    assert raw.headers["x-kvevents-engine"] == "e0"
    got = raw.parse()
    assert got.output_text == _text(direct.json())
    cached = got.usage.input_tokens_details.cached_tokens
    assert cached > 0
    # The prediction is exactly what vLLM reported: the gateway's ids were the engine's.
    assert wait_until(lambda: _metric(gw, "kvevents_gateway_reported_cached_tokens_total", engine="e0")
                      - before[1] >= cached, timeout=5)
    predicted = _metric(gw, "kvevents_gateway_predicted_cached_tokens_total", engine="e0") - before[0]
    reported = _metric(gw, "kvevents_gateway_reported_cached_tokens_total", engine="e0") - before[1]
    assert predicted == reported, (predicted, reported)

    # Streamed: the same text, its end and usage found (counted with the cached tokens).
    reports = _metric(gw, "kvevents_gateway_usage_reports_total", engine="e0")
    with client.responses.stream(**body) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == got.status and text == got.output_text
    if final.usage.input_tokens_details.cached_tokens:  # (routed to e0: it holds the prompt)
        assert wait_until(lambda: _metric(gw, "kvevents_gateway_usage_reports_total", engine="e0")
                          == reports + 1, timeout=5)
    sse = httpx.post(engine.url + "/v1/responses", json={**body, "stream": True}, timeout=120).text
    assert sse.rstrip().encode().endswith(RESPONSE_END), sse[-300:]


def test_previous_response_id_is_answered_where_it_is_stored(stack):
    gw, client = stack["gw"], stack["client"]
    homes = []
    for i in range(6):
        raw = client.responses.with_raw_response.create(model=MODEL, input=f"Question {i}: " + LONG[:80],
                                                         **GREEDY)
        home, first = raw.headers["x-kvevents-engine"], raw.parse()
        homes.append(home)
        follow = client.responses.with_raw_response.create(model=MODEL, input="And then?",
                                                           previous_response_id=first.id, **GREEDY)
        assert follow.http_response.status_code == 200 and follow.headers["x-kvevents-engine"] == home
        with client.responses.stream(model=MODEL, input="More.", previous_response_id=follow.parse().id,
                                     **GREEDY) as stream:
            last = stream.get_final_response()
        assert last.status in ("completed", "incomplete")  # (incomplete: max_output_tokens)
        again = client.responses.with_raw_response.create(model=MODEL, input="!", previous_response_id=last.id,
                                                          **GREEDY)
        assert again.headers["x-kvevents-engine"] == home
        # Retrieved through the gateway from the engine that stored it, as vLLM stored it.
        got = client.responses.with_raw_response.retrieve(last.id)
        assert got.headers["x-kvevents-engine"] == home and got.parse().id == last.id
        if home == "e0":
            theirs = httpx.get(f"{stack['engine'].url}/v1/responses/{last.id}", timeout=30).json()
            assert got.parse().output_text == "".join(
                c["text"] for o in theirs["output"] if o["type"] == "message" for c in o["content"])
    assert "e0" in homes  # (the real engine answered some from its own store)


def test_unknown_response_is_vllms_404(stack):
    gw, engine = stack["gw"], stack["engine"]
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_nothere", **GREEDY}
    theirs = httpx.post(engine.url + "/v1/responses", json=body, timeout=60)
    assert theirs.status_code == 404
    assert theirs.json()["error"]["message"] == "Response with id 'resp_nothere' not found."
    # Through the gateway (an id it never saw: routed as any request, the engine answers)
    for _ in range(4):  # (either engine: both answer as vLLM does)
        ours = httpx.post(gw + "/v1/responses", json=body, timeout=60)
        assert ours.status_code == 404 and ours.json() == theirs.json()


def test_tokenize_and_detokenize_relayed(stack):
    gw, engine = stack["gw"], stack["engine"]
    tok = {"model": MODEL, "prompt": "Hello there, world"}
    theirs = httpx.post(engine.url + "/tokenize", json=tok, timeout=30)
    assert theirs.status_code == 200
    ids = theirs.json()["tokens"]
    seen = set()
    for _ in range(6):  # (by load: both engines answer some)
        ours = httpx.post(gw + "/tokenize", json=tok, timeout=30)
        assert ours.status_code == 200
        seen.add(ours.headers["x-kvevents-engine"])
        if ours.headers["x-kvevents-engine"] == "e0":
            assert ours.content == theirs.content
            de = httpx.post(gw + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30)
            assert de.status_code == 200
            if de.headers["x-kvevents-engine"] == "e0":
                assert de.json()["prompt"] == httpx.post(engine.url + "/detokenize", json={
                    "model": MODEL, "tokens": ids}, timeout=30).json()["prompt"]
    assert "e0" in seen
