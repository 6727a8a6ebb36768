"""Prefill/decode disaggregation through ``kvevents serve``, against fake engines that
answer as vLLM's do (:mod:`hostile_engine`; a prefill hop's answer carries
``kv_transfer_params`` shaped as vLLM's NIXL connector returns them): what each hop is
sent, the conditional skip, the fallbacks when prefill engines fail or are gone, and the
503 when no decode engine is left. The same through real vLLM engines, with the
transfer itself: ``tests/test_gateway_pd.py``."""

from __future__ import annotations

import httpx
import pytest

from hostile_engine import EngineThread
from hostile_support import GatewayProcess
from support import free_port, wait_until

pytestmark = pytest.mark.timeout(180)


def _spec(name: str, url: str, role: str) -> str:
    return f"{name}=tcp://127.0.0.1:{free_port()},model=fake,http={url},role={role}"


def _pd(g: GatewayProcess, reason: str) -> float:
    return g.metric("kvevents_gateway_pd_decisions_total", reason=reason)


def test_two_hops_follow_vllms_protocol_and_fall_back_when_prefill_engines_fail():
    pre, dec = EngineThread([free_port()]), EngineThread([free_port()])
    try:
        g = GatewayProcess([], "--endpoint", _spec("p0", pre.urls[0], "prefill"),
                           "--endpoint", _spec("d0", dec.urls[0], "decode"),
                           "--pd-skip-uncached-tokens", "16")
        g.n_engines = 2
        with g:
            roles = {e["name"]: e["role"] for e in httpx.get(g.url + "/v1/engines").json()["engines"]}
            assert roles == {"p0": "prefill", "d0": "decode"}

            # A long prompt: two hops. The prefill engine gets one token, no stream, and
            # do_remote_decode; the decode engine the client's body with what it returned.
            body = {"model": "fake", "prompt": list(range(100, 200)), "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}, "min_tokens": 2}
            resp = httpx.post(g.url + "/v1/completions", json=body, timeout=20)
            assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]"), resp.text
            assert resp.headers["x-kvevents-engine"] == "d0"
            first, second = pre.stats.bodies[-1], dec.stats.bodies[-1]
            assert first["max_tokens"] == 1 and first["stream"] is False
            assert "stream_options" not in first and "min_tokens" not in first
            assert first["kv_transfer_params"]["do_remote_decode"] is True
            assert first["prompt"] == body["prompt"]
            assert second["kv_transfer_params"]["remote_block_ids"] == [7, 8]
            assert {k: v for k, v in second.items() if k != "kv_transfer_params"} == body
            assert _pd(g, "disaggregated") == 1

            # A prompt shorter than --pd-skip-uncached-tokens: the decode engine alone.
            resp = httpx.post(g.url + "/v1/completions", json={"model": "fake", "prompt": [1, 2, 3],
                                                               "max_tokens": 2}, timeout=20)
            assert resp.status_code == 200 and len(pre.stats.bodies) == 1
            assert "kv_transfer_params" not in dec.stats.bodies[-1]
            assert _pd(g, "short_uncached") == 1

            # The prefill engine gone: every request still answered, by the decode engine.
            pre.close()
            for i in range(4):
                resp = httpx.post(g.url + "/v1/completions", json={
                    "model": "fake", "prompt": list(range(300 + i, 400 + i)), "max_tokens": 2}, timeout=20)
                assert resp.status_code == 200, resp.text
                assert "kv_transfer_params" not in dec.stats.bodies[-1]
            assert _pd(g, "prefill_failed") == 1  # (then known unreachable: not tried again)
            assert _pd(g, "no_prefill") == 3
            assert g.metric("kvevents_gateway_requests_total", engine="d0", status="200") == 6

            # No decode engine left: the OpenAI 503, never a prefill engine's answer.
            dec.close()
            assert wait_until(lambda: not any(e["gateway"]["reachable"] for e in httpx.get(
                g.url + "/v1/engines").json()["engines"]), timeout=15, interval=0.2)
            resp = httpx.post(g.url + "/v1/completions", json={"model": "fake", "prompt": [1] * 50}, timeout=20)
            assert resp.status_code == 503 and resp.headers["retry-after"]
            assert resp.json()["error"]["type"] == "service_unavailable"
    finally:
        pre.close()
        dec.close()


def test_a_fleet_of_prefill_engines_alone_answers_503():
    pre = EngineThread([free_port()])
    try:
        g = GatewayProcess([], "--endpoint", _spec("p0", pre.urls[0], "prefill"))
        g.n_engines = 1
        with g:
            resp = httpx.post(g.url + "/v1/completions", json={"model": "fake", "prompt": [1] * 50}, timeout=20)
            assert resp.status_code == 503 and resp.headers["retry-after"]
            assert "no decode engine" in resp.json()["error"]["message"]
            assert pre.stats.bodies == []
    finally:
        pre.close()


@pytest.mark.parametrize("bad", ["role=prefil", "role="])
def test_a_bad_role_is_refused_at_start(bad):
    from kvevents.engines import EngineSpec

    with pytest.raises(ValueError, match="role"):
        EngineSpec.parse(f"p0=tcp://127.0.0.1:5557,{bad}")
