"""Prefill/decode disaggregation through ``kvevents serve`` in front of two real vLLM
OpenAI servers (CPU): a prefill engine (``kv_producer``) and a decode engine
(``kv_consumer``) with vLLM's stock ``ExampleConnector`` over a temporary folder, the
decode engine running it beside our offloading connector (vLLM's ``MultiConnector``),
both engines' KV events followed (:mod:`kvevents.demo.pd_engines`).

Checks, in order (the kill last): greedy answers through the two hops equal the prefill
engine's own whole answers (an aggregated engine with the same weights), and the decode
engine reports the transferred tokens as cached; its CPU tier is indexed; the prefill
hop is skipped when the decode engine holds the prompt or lacks only a few tokens of it,
and taken otherwise; a client that leaves during the prefill hop ends it, and no decode
hop is sent; a prefill engine killed mid-run costs no request.

Where vLLM is not installed these tests skip; under ``CI=true`` a missing vLLM fails.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import free_port, require_vllm, stop_process, wait_gateway_engines, wait_until

ROOT = Path(__file__).resolve().parent.parent
require_vllm()

import httpx  # noqa: E402

from kvevents.demo.pd_engines import transfer_args  # noqa: E402
from kvevents.demo.vllm_server import BLOCK_SIZE, VllmServer, server_env  # noqa: E402
from test_gateway_vllm import _metric  # noqa: E402

MODEL = "tiny"
STARTUP = 420.0
SKIP_TOKENS = 64  # --pd-skip-uncached-tokens
pytestmark = pytest.mark.timeout(900)
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from kvevents.demo.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("gateway-pd")
    model = make_tiny_model(tmp / "tiny-llama", tokenizer=True)
    folder = tmp / "kv"
    folder.mkdir()
    port = free_port()
    events = {n: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for n in ("p0", "d0")}
    servers = {
        "p0": VllmServer(model, endpoint=events["p0"][0], replay_endpoint=events["p0"][1], core=0,
                         log=tmp / "prefill.log", num_gpu_blocks=160, max_model_len=2048,
                         extra_args=transfer_args("prefill", folder)),
        "d0": VllmServer(model, endpoint=events["d0"][0], replay_endpoint=events["d0"][1], core=1,
                         log=tmp / "decode.log", num_gpu_blocks=160, max_model_len=2048,
                         extra_args=transfer_args("decode", folder, offload_bytes=256 << 20)),
    }
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--tokenizer", f"{MODEL}={model}", "--engine-poll-interval", "0.5",
           "--pd-skip-uncached-tokens", str(SKIP_TOKENS), "--pd-skip-cached-share", "0.9"]
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        live, replay = events[name]
        cmd += ["--endpoint", f"{name}={live},replay={replay},model={MODEL},http={servers[name].url},"
                              f"bind=1,role={role}"]
    serve_log = tmp / "serve.log"
    with open(serve_log, "w") as log:
        serve = subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT)
    gw = f"http://127.0.0.1:{port}"
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(STARTUP)

        wait_gateway_engines(gw, 2, serve, serve_log)
        yield {"gw": gw, "servers": servers, "folder": folder, "log": serve_log}
    finally:
        for s in servers.values():
            s.stop()
        stop_process(serve, timeout=20)


def _chat(topic: str, words: int = 300) -> list[dict]:
    """A chat of about ``words`` tokens nothing else in this module starts with."""
    return [{"role": "system", "content": f"You answer questions about {topic}."},
            {"role": "user", "content": " ".join(f"{topic}{i % 17} detail" for i in range(words // 2))}]


def _post(url: str, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _decisions(pd) -> dict[str, float]:
    text = httpx.get(pd["gw"] + "/metrics", timeout=5).text
    return {r: _metric(text, "kvevents_gateway_pd_decisions_total", reason=r)
            for r in ("disaggregated", "decode_cached", "short_uncached", "no_prefill", "prefill_failed")}


def _engine(pd, name: str, metric: str) -> float:
    return _metric(httpx.get(pd["servers"][name].url + "/metrics", timeout=5).text, metric)


def _stream_text(resp: httpx.Response) -> tuple[str, dict]:
    import json

    out, usage = [], {}
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            doc = json.loads(line[6:])
            usage = doc.get("usage") or usage
            out += [c["delta"].get("content") or "" for c in doc.get("choices") or []]
    return "".join(out), usage


def test_greedy_answers_through_two_hops_equal_an_aggregated_engines(pd):
    gw, p0 = pd["gw"], pd["servers"]["p0"]
    # (a first request: the index learns the engines' block size from their events)
    assert _post(gw, {"model": MODEL, "messages": _chat("lakes"), **GREEDY}).status_code == 200
    before = _decisions(pd)
    hits = _engine(pd, "d0", "vllm:external_prefix_cache_hits_total")
    was = {e["name"]: e["gateway"] for e in httpx.get(gw + "/v1/engines").json()["engines"]}
    for stream, topic in ((False, "rivers"), (True, "mountains")):
        body = {"model": MODEL, "messages": _chat(topic), **GREEDY, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        resp = _post(gw, body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvevents-engine"] == "d0"
        if stream:
            text, usage = _stream_text(resp)
        else:
            text, usage = resp.json()["choices"][0]["message"]["content"], resp.json()["usage"]
        n = usage["prompt_tokens"]
        assert n > 2 * SKIP_TOKENS
        # The decode engine computed only the prompt's last block: the rest came over.
        assert usage["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        # The same request, whole, on one engine with the same weights.
        whole = _post(p0.url, {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        assert whole.status_code == 200, whole.text
        assert text == whole.json()["choices"][0]["message"]["content"]
    after = _decisions(pd)
    assert after["disaggregated"] - before["disaggregated"] == 2
    assert _engine(pd, "d0", "vllm:external_prefix_cache_hits_total") - hits > 0
    assert any(pd["folder"].iterdir())  # what the producer wrote for the consumer

    # Each hop's predicted cached tokens against what its engine reported.
    now = {e["name"]: e["gateway"] for e in httpx.get(gw + "/v1/engines").json()["engines"]}
    d0 = {k: now["d0"][k] - was["d0"][k] for k in ("usage_reports", "predicted_cached_tokens",
                                                   "reported_cached_tokens")}
    assert d0["usage_reports"] == 2
    assert d0["predicted_cached_tokens"] == d0["reported_cached_tokens"] > 0, d0
    assert now["p0"]["usage_reports"] - was["p0"]["usage_reports"] == 2


def test_the_decode_engines_cpu_tier_is_indexed(pd):
    """Our offloading connector beside the transfer connector publishes the decode
    engine's CPU tier, and the aggregator indexes it."""
    def tiers() -> dict:
        return httpx.get(pd["gw"] + "/v1/engines/d0/blocks", timeout=5).json()["tiers"]
    assert wait_until(lambda: len(tiers().get("CPU", ())) > 0, timeout=20, interval=0.3), tiers().keys()


def test_the_prefill_hop_is_skipped_only_when_the_decode_engine_would_not_gain(pd):
    gw = pd["gw"]
    chat = _chat("forests")
    body = {"model": MODEL, "messages": chat, **GREEDY}
    assert _post(gw, body).status_code == 200  # two hops: now the decode engine holds it

    def held() -> int:
        got = httpx.post(gw + "/v1/lookup", json={"model": MODEL, "messages": chat}, timeout=10).json()
        return max((e["matched_tokens"] for e in got["engines"] if e["engine"] == "d0"), default=0)
    assert wait_until(lambda: held() > 0, timeout=20, interval=0.2)

    before = _decisions(pd)
    prefills = _engine(pd, "p0", "vllm:request_success_total")
    resp = _post(gw, body)  # the decode engine holds >= 90%: no prefill hop
    assert resp.status_code == 200 and resp.headers["x-kvevents-engine"] == "d0"
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    short = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], **GREEDY}
    assert _post(gw, short).status_code == 200  # fewer uncached tokens than the threshold
    after = _decisions(pd)
    assert after["decode_cached"] - before["decode_cached"] == 1
    assert after["short_uncached"] - before["short_uncached"] == 1
    assert _engine(pd, "p0", "vllm:request_success_total") == prefills

    # A prompt the decode engine lacks: the two hops again.
    assert _post(gw, {"model": MODEL, "messages": _chat("deserts"), **GREEDY}).status_code == 200
    assert _decisions(pd)["disaggregated"] - after["disaggregated"] == 1
    assert _engine(pd, "p0", "vllm:request_success_total") == prefills + 1


def test_a_client_that_leaves_during_the_prefill_hop_ends_both_hops(pd):
    gw, p0 = pd["gw"], pd["servers"]["p0"]
    decodes = _engine(pd, "d0", "vllm:request_success_total")
    text = httpx.get(gw + "/metrics").text
    gone = _metric(text, "kvevents_gateway_requests_total", status="499")
    p0.freeze()  # the prefill hop cannot end before the client leaves
    try:
        with pytest.raises(httpx.ReadTimeout):
            _post(gw, {"model": MODEL, "messages": _chat("glaciers"), **GREEDY, "stream": True}, timeout=3)

        def released() -> bool:
            t = httpx.get(gw + "/metrics").text
            return (_metric(t, "kvevents_gateway_requests_total", status="499") == gone + 1
                    and _metric(t, "kvevents_gateway_inflight_requests", engine="p0") == 0)
        assert wait_until(released, timeout=15, interval=0.2)
    finally:
        p0.thaw()
    time.sleep(2)  # (a decode hop, had one been sent, would have ended by now)
    assert _engine(pd, "d0", "vllm:request_success_total") == decodes
    assert wait_until(lambda: _engine(pd, "p0", "vllm:num_requests_running") == 0, timeout=20, interval=0.3)


def test_a_prefill_engine_killed_mid_run_costs_no_request(pd):
    gw, p0 = pd["gw"], pd["servers"]["p0"]
    statuses: list[int] = []

    def client() -> None:
        for i in range(8):
            resp = _post(gw, {"model": MODEL, "messages": _chat(f"islands{i}"), **GREEDY})
            statuses.append(resp.status_code)

    before = _decisions(pd)
    t = threading.Thread(target=client)
    t.start()
    assert wait_until(lambda: len(statuses) >= 2, timeout=120, interval=0.05)
    p0.kill()
    t.join(300)
    assert statuses == [200] * 8
    after = _decisions(pd)
    fell_back = sum(after[r] - before[r] for r in ("no_prefill", "prefill_failed"))
    assert fell_back >= 5 and after["disaggregated"] - before["disaggregated"] >= 2
    # ... and the decode engine answers alone from now on.
    resp = _post(gw, {"model": MODEL, "messages": _chat("lagoons"), **GREEDY})
    assert resp.status_code == 200 and resp.headers["x-kvevents-engine"] == "d0"
    assert _decisions(pd)["no_prefill"] - after["no_prefill"] == 1
