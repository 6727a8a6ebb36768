"""Down engines: a publisher gone for ``down_after_s`` keeps its blocks visible but is not
offered for routing, and /v1/route never picks a down engine while another is on offer.
Real publishers, a real uvicorn server, a real disconnect."""

from __future__ import annotations

import time

import httpx

from support import ServerThread, free_port, wait_until
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

PROMPT = list(range(64))


def test_down_engine_is_visible_but_never_routed_to():
    ports = {"a": free_port(), "b": free_port()}
    pubs = {n: ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{p}", bind=True))
            for n, p in ports.items()}
    settings = AggregatorSettings(engines=tuple(
        EngineSpec(n, f"tcp://127.0.0.1:{p}") for n, p in ports.items()), down_after_s=0.5)
    try:
        with ServerThread(create_app(settings)) as srv:
            def engines():
                return {p["name"]: p for p in httpx.get(f"{srv.url}/v1/engines").json()["engines"]}

            def route(**kw):
                r = httpx.post(f"{srv.url}/v1/route", json={"token_ids": PROMPT, **kw}, timeout=5)
                assert r.status_code == 200, r.text
                return r.json()

            assert wait_until(lambda: all(p["connected"] for p in engines().values()), 5)
            # a caches 4 blocks of the prompt, b only 1: a wins while it is up.
            pubs["a"].publish(KVEventBatch(time.time(), [
                BlockStored([1, 2, 3, 4], None, PROMPT, 16, None, "GPU", None)]))
            pubs["b"].publish(KVEventBatch(time.time(), [
                BlockStored([9], None, PROMPT[:16], 16, None, "GPU", None)]))
            assert wait_until(lambda: len(httpx.post(f"{srv.url}/v1/lookup",
                                                     json={"token_ids": PROMPT}).json()["engines"]) == 2, 5)
            assert route()["engine"] == "a"
            assert engines()["a"]["routable"]

            pubs.pop("a").shutdown(0.5)  # the engine dies
            assert wait_until(lambda: engines()["a"]["status"] == "down", 5)
            assert route()["engine"] == "b"
            assert route(candidates=[{"engine": "a"}, {"engine": "b"}])["engine"] == "b"
            assert wait_until(lambda: not engines()["a"]["routable"], 3)
            # Still visible: lookups and the engine list show its blocks.
            lookup = httpx.post(f"{srv.url}/v1/lookup", json={"token_ids": PROMPT}).json()
            assert lookup["engines"][0]["engine"] == "a" and lookup["engines"][0]["matched_tokens"] == 64
            assert lookup["engines"][0]["down"] is True and "down" not in lookup["engines"][1]
            assert engines()["a"]["blocks"] and engines()["a"]["status"] == "down"
            # Past down_after its blocks are not offered: no cache score for a.
            only_a = route(candidates=[{"engine": "a"}])  # no live one on offer: a, cold
            assert only_a["engine"] == "a" and only_a["matched_tokens"] == 0
            scores = {s["engine"]: s for s in route(candidates=[{"engine": "a"}, {"engine": "b"}])["scores"]}
            assert scores["a"]["matched_tokens"] == 0 and not scores["a"]["eligible"]
    finally:
        for p in pubs.values():
            p.shutdown(0.5)
