"""The OpenAI gateway of ``kvevents serve`` end to end, in front of simulated engines:
real engine processes (``kvevents.sim.process`` with its OpenAI front), a real
``kvevents serve`` process, real HTTP clients. The same behaviours against real vLLM
servers are in ``tests/test_gateway_vllm.py``."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time

import httpx
import pytest

from support import free_port, wait_until
from kvevents.demo.fleet import Fleet

MODEL = "sim"
BS = 16  # the simulated engine's block size


def _prompt(seed: int, n: int = 96) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def fleet():
    with tempfile.TemporaryDirectory() as tmp:
        f = Fleet(2, free_port(), False, gpu_blocks=256, cpu_blocks=0, offloaded_block_size=BS,
                  log_dir=tmp, openai_model=MODEL)
        try:
            f.wait_engines_ready(60)
            assert wait_until(lambda: _ready(f.url), 30), "the gateway never became ready"
            yield f
        finally:
            f.close()


def _ready(url: str) -> bool:
    try:
        engines = httpx.get(url + "/v1/engines", timeout=2).json()["engines"]
        return len(engines) == 2 and all(e["status"] == "live" or e["connected"] for e in engines) \
            and all(e["gateway"]["reachable"] for e in engines)
    except (httpx.HTTPError, KeyError, TypeError):
        return False


def _complete(url: str, prompt, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_answers_equal_the_engines_own_and_streams_pass_through(fleet):
    p = _prompt(1)
    via = _complete(fleet.url, p)
    assert via.status_code == 200, via.text
    engine = via.headers["x-kvevents-engine"]
    port = next(e.ports.http for e in fleet.engines if e.name == engine)
    direct = _complete(f"http://127.0.0.1:{port}", p)
    strip = lambda d: {k: v for k, v in d.items() if k not in ("id", "created", "usage")}  # noqa: E731
    assert strip(via.json()) == strip(direct.json())
    # Streamed: the engine's chunks unchanged; the usage chunk only when asked for.
    for include in (False, True):
        with httpx.stream("POST", fleet.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": p, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": include}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == via.json()["choices"][0]["text"]
        assert any("usage" in c and c["usage"] for c in chunks) is include


def test_a_prompt_goes_back_to_the_engine_that_caches_it(fleet):
    before = httpx.get(fleet.url + "/metrics").text
    first = _complete(fleet.url, _prompt(2, 160))
    engine = first.headers["x-kvevents-engine"]
    # The index learns the engine's blocks from its events, then routes by them.
    assert wait_until(lambda: httpx.post(fleet.url + "/v1/lookup", json={
        "token_ids": _prompt(2, 160), "model": MODEL}).json()["engines"], 10)
    for extra in (0, 32, 64):
        again = _complete(fleet.url, _prompt(2, 160) + list(range(1, extra + 1)))
        assert again.status_code == 200
        assert again.headers["x-kvevents-engine"] == engine
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 144
    after = httpx.get(fleet.url + "/metrics").text
    predicted = _metric(after, "kvevents_gateway_predicted_cached_tokens_total", engine=engine) - \
        _metric(before, "kvevents_gateway_predicted_cached_tokens_total", engine=engine)
    reported = _metric(after, "kvevents_gateway_reported_cached_tokens_total", engine=engine) - \
        _metric(before, "kvevents_gateway_reported_cached_tokens_total", engine=engine)
    assert reported >= 3 * 144 and 0.8 * reported <= predicted <= 1.2 * reported, (predicted, reported)


def test_new_prompts_spread_over_the_engines(fleet):
    """Distinct prompts sent at once do not pile onto one engine."""
    results: list[str] = []

    def send(i: int) -> None:
        r = _complete(fleet.url, _prompt(1000 + i, 64), max_tokens=16)
        assert r.status_code == 200, r.text
        results.append(r.headers["x-kvevents-engine"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = {name: results.count(name) for name in set(results)}
    assert len(results) == 16 and len(counts) == 2 and min(counts.values()) >= 4, counts


def test_a_hot_shared_prefix_does_not_hold_one_engine(fleet):
    """New conversations behind one long system prompt, one at a time: the cache alone
    would send every one to the engine that cached the system prompt first. The gateway
    evens out its share of requests (``route_balance_weight``): the other engine gets
    some, caches the system prompt too, and from then on the conversations split while
    each still hits the cached system prompt."""
    system = _prompt(7000, 128)
    chosen, cached = [], []
    for i in range(40):
        prompt = system + _prompt(8000 + i, 32)
        r = _complete(fleet.url, prompt, max_tokens=2)
        assert r.status_code == 200, r.text
        chosen.append(r.headers["x-kvevents-engine"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # The next decision sees this one's blocks (conversations one after another).
        assert wait_until(lambda: any(m["engine"] == chosen[-1] and m["matched_tokens"] >= 160
                                      for m in httpx.post(fleet.url + "/v1/lookup", json={
                                          "token_ids": prompt, "model": MODEL}).json()["engines"]), 10)
    counts = {name: chosen.count(name) for name in set(chosen)}
    assert len(counts) == 2 and min(counts.values()) >= 12, counts
    # Both engines hold the system prompt by the end: the last requests all hit it.
    assert set(chosen[-10:]) == set(counts) and min(cached[-10:]) >= 128, list(zip(chosen, cached))


def test_a_session_stays_on_its_engine(fleet):
    engines = set()
    for i in range(6):  # different prompts, one conversation
        r = _complete(fleet.url, _prompt(5000 + i, 48), max_tokens=2)
        engines.add(r.headers["x-kvevents-engine"])
    assert len(engines) == 2  # without a session they spread ...
    pinned = set()
    for i in range(6):
        r = httpx.post(fleet.url + "/v1/completions", timeout=30, headers={"x-session-id": "chat-42"},
                       json={"model": MODEL, "prompt": _prompt(6000 + i, 48), "max_tokens": 2})
        pinned.add(r.headers["x-kvevents-engine"])
    assert len(pinned) == 1  # ... with one, they stay


def test_models_and_openai_shaped_errors(fleet):
    models = httpx.get(fleet.url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    for path, body, param, status in (
            ("/v1/completions", b"{not json", None, 400),
            ("/v1/completions", json.dumps({"model": MODEL}).encode(), "prompt", 400),
            ("/v1/completions", json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(), "prompt", 400),
            ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1], "stream": "yes"}).encode(),
             "stream", 400),
            ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), "messages", 400),
            ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": ["hi"]}).encode(),
             "messages", 400),
            ("/v1/completions", json.dumps({"model": "nope", "prompt": [1]}).encode(), "model", 404),
            ("/v1/completions", b"[1, 2]", None, 400)):
        r = httpx.post(fleet.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    # An error the engine gives (its own validation) comes back as the engine said it.
    r = _complete(fleet.url, _prompt(3), n=2)
    assert r.status_code == 400 and "error" in r.json()
    big = httpx.post(fleet.url + "/v1/completions", content=b"x" * (9 << 20))
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_is_counted_and_frees_its_slot(fleet):
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", fleet.url + "/v1/completions", json={
                "model": MODEL, "prompt": _prompt(7), "max_tokens": 2000, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    def settled() -> bool:
        m = httpx.get(fleet.url + "/metrics").text
        return _metric(m, "kvevents_gateway_requests_total", status="499") >= 1 and \
            _metric(m, "kvevents_gateway_inflight_requests") == 0
    assert wait_until(settled, 30)


def test_api_key_guards_the_openai_endpoints(tmp_path):
    port = free_port()
    dead = free_port()  # an engine that answers nothing: a closed port on 127.0.0.1
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port),
                             "--api-key", "k3y", "--endpoint",
                             f"e0=tcp://127.0.0.1:{free_port()},model=m,http=http://127.0.0.1:{dead}"],
                            stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _up(url), 20)
        body = {"model": "m", "prompt": [1, 2]}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        # With the key: the only engine is unreachable, so 503 with Retry-After.
        auth = {"Authorization": "Bearer k3y"}
        r = httpx.post(url + "/v1/completions", json=body, headers=auth)
        assert r.status_code in (502, 503) and r.headers.get("retry-after"), r.text
        assert wait_until(lambda: httpx.post(url + "/v1/completions", json=body, headers=auth)
                          .status_code == 503, 10)
    finally:
        proc.terminate()
        proc.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def test_an_engine_that_dies_costs_no_request(fleet):
    """Last in the module: it kills an engine. Requests keep succeeding on the other;
    with none left, 503 and Retry-After."""
    victim = fleet.engines[0].name
    os.killpg(fleet.procs[victim].pid, signal.SIGKILL)
    fleet.procs[victim].wait(10)
    codes = [_complete(fleet.url, _prompt(9000 + i)).status_code for i in range(10)]
    assert codes == [200] * 10
    assert wait_until(lambda: not next(e for e in httpx.get(fleet.url + "/v1/engines").json()["engines"]
                                       if e["name"] == victim)["gateway"]["reachable"], 10)
    other = fleet.engines[1].name
    os.killpg(fleet.procs[other].pid, signal.SIGKILL)
    fleet.procs[other].wait(10)
    r = _complete(fleet.url, _prompt(9100))
    assert r.status_code in (502, 503) and r.headers.get("retry-after"), r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    time.sleep(0.1)
