"""The aggregator over HTTP: a real uvicorn server following real publishers."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from support import LossyForwarder, ServerThread, free_port, wait_until
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

BS = 4
P = list(range(100, 124))  # a 24-token prompt: 6 blocks of 4
Q = list(range(500, 516))


def blocks(tokens, i, j):
    return tokens[i * BS:j * BS]


def h(engine_bytes: bool, n: int):
    """Engine hash n as the engine spells it (uint64 or raw digest)."""
    return n.to_bytes(32, "big") if engine_bytes else n


class Pub:
    def __init__(self, legacy: bool) -> None:
        self.live, self.replay = free_port(), free_port()
        self.pub = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://*:{self.live}", replay_endpoint=f"tcp://*:{self.replay}",
            legacy_encoding=legacy))

    def send(self, *events) -> None:
        self.pub.publish(KVEventBatch(time.time(), list(events)))


@pytest.fixture
def fleet():
    """Engine a: current map encoding, int hashes, a lossy live hop (seq 2 dropped).
    Engine b: legacy array encoding, bytes hashes."""
    a, b = Pub(legacy=False), Pub(legacy=True)
    fwd = LossyForwarder(f"tcp://127.0.0.1:{a.live}", drop={2})
    settings = AggregatorSettings(engines=(
        EngineSpec("a", fwd.endpoint, replay_endpoint=f"tcp://127.0.0.1:{a.replay}", model="m"),
        EngineSpec("b", f"tcp://127.0.0.1:{b.live}", replay_endpoint=f"tcp://127.0.0.1:{b.replay}", model="m"),
    ), auth_token="s3cret", max_body_bytes=64 * 1024, max_prompt_tokens=5000)
    with ServerThread(create_app(settings)) as srv:
        yield srv, a, b
    fwd.close()
    a.pub.shutdown(0.5)
    b.pub.shutdown(0.5)


def lookup(srv, tokens, **kw):
    r = httpx.post(f"{srv.url}/v1/lookup", json={"token_ids": tokens, **kw}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def feed_events(a: Pub, b: Pub) -> None:
    # a: P's blocks 0..3 on GPU in two events (seq 0, 1); then (seq 2, dropped live and
    # recovered by replay) block 3 leaves the GPU and blocks 2..3 land on CPU.
    a.send(BlockStored([1, 2], None, blocks(P, 0, 2), BS, None, "GPU", None))
    a.send(BlockStored([3, 4], 2, blocks(P, 2, 4), BS, None, "GPU", None))
    a.send(BlockRemoved([4], "GPU"),
           BlockStored([3, 4], 2, blocks(P, 2, 4), BS, None, "CPU", None))
    # seq 3: a duplicate CPU announcement of block 3 (overlapping chunk) and its removal
    # once: still resident on CPU.
    a.send(BlockStored([3], 2, blocks(P, 2, 3), BS, None, "CPU", None),
           BlockRemoved([3], "CPU"))
    # b: P's first block, and all of Q; an unknown removal (counted, harmless).
    b.send(BlockStored([h(True, 1)], None, blocks(P, 0, 1), BS, None, None, None),
           BlockStored([h(True, 10), h(True, 11), h(True, 12), h(True, 13)], None, Q, BS, None, "GPU", None),
           BlockRemoved([h(True, 999)], None))


def test_lookup_is_exact_after_replay_with_both_encodings(fleet):
    srv, a, b = fleet
    time.sleep(0.5)  # subscriptions in place (missed batches would be replayed anyway)
    feed_events(a, b)
    assert wait_until(lambda: {p["name"]: p["last_seq"] for p in
                               httpx.get(f"{srv.url}/v1/engines").json()["engines"]} == {"a": 3, "b": 0}, 10)
    got = lookup(srv, P + [1, 2, 3])
    assert got["prompt_tokens"] == 27 and got["block_size"] == BS
    assert got["engines"] == [
        {"engine": "a", "matched_tokens": 16, "tiers": {"GPU": 12}},
        {"engine": "b", "matched_tokens": 4, "tiers": {"GPU": 4}},
    ]
    assert lookup(srv, Q)["engines"] == [{"engine": "b", "matched_tokens": 16, "tiers": {"GPU": 16}}]
    assert lookup(srv, [7] * 8)["engines"] == []
    assert lookup(srv, P, model="other")["engines"] == []
    engines = {p["name"]: p for p in httpx.get(f"{srv.url}/v1/engines").json()["engines"]}
    assert engines["a"]["gaps"] == 1 and engines["a"]["replayed_batches"] >= 1
    assert engines["a"]["lost_batches"] == 0 and engines["a"]["status"] == "live"
    assert engines["a"]["blocks"] == {"GPU": 3, "CPU": 2}
    assert engines["b"]["blocks"] == {"GPU": 5}
    # A common body is answered in the server's protocol (kvevents/api/server_protocol.py),
    # any other by the route: the same request both ways gives the same bytes.
    for tokens, model in ((P + [1, 2, 3], None), (Q, "m"), ([7] * 8, None)):
        common = {"token_ids": tokens, **({"model": model} if model else {})}
        fast = httpx.post(f"{srv.url}/v1/lookup", json=common)
        routed = httpx.post(f"{srv.url}/v1/lookup", json={**common, "prompt": None})
        assert fast.status_code == routed.status_code == 200
        assert fast.content == routed.content and fast.headers["content-type"] == "application/json"

    # Block queries by decimal and hex hash.
    r = httpx.get(f"{srv.url}/v1/blocks/3").json()
    assert r["holders"] == [{"engine": "a", "tiers": {"GPU": 1, "CPU": 1}}]
    assert r["tokens"] == blocks(P, 2, 3)
    r = httpx.get(f"{srv.url}/v1/blocks/{h(True, 10).hex()}").json()
    assert r["holders"] == [{"engine": "b", "tiers": {"GPU": 1}}] and r["tokens"] == Q[:4]
    assert httpx.get(f"{srv.url}/v1/blocks/424242").status_code == 404

    top = httpx.get(f"{srv.url}/v1/prefixes", params={"limit": 5}).json()["prefixes"]
    assert top[0]["engines"] == ["a", "b"] and top[0]["leading_tokens"][:4] == P[:4]

    # Metrics reflect it.
    text = httpx.get(f"{srv.url}/metrics").text
    assert 'kvevents_resident_blocks{engine="a",model_name="m",tier="CPU"} 2.0' in text
    assert 'kvevents_replayed_batches_total{engine="a",model_name="m"}' in text
    assert 'kvevents_unknown_removals_total{engine="b",model_name="m"} 1.0' in text
    assert 'kvevents_lookups_total{api="lookup",model_name=""} 7.0' in text
    # A model no engine serves is counted under one fixed value, never under its name.
    assert 'kvevents_lookups_total{api="lookup",model_name="unknown"} 1.0' in text
    assert 'model_name="other"' not in text
    # One name for the followed engine in metric names too (the budget gauge was *_max_pods).
    budget = [line for line in text.splitlines() if line.startswith("kvevents_ingest_max_")]
    assert len(budget) == 1 and budget[0].startswith("kvevents_ingest_max_engines "), budget

    # A cleared cache and a publisher restart drop state.
    b.send(AllBlocksCleared())
    assert wait_until(lambda: lookup(srv, Q)["engines"] == [], 5)


def test_bad_input_gets_4xx_naming_the_field_and_changes_nothing(fleet):
    srv, _, _ = fleet
    url = srv.url
    auth = {"Authorization": "Bearer s3cret"}
    before = httpx.get(f"{url}/v1/engines").json()

    def err(r, status, field):
        assert r.status_code == status, r.text
        body = r.json()
        assert body["field"] == field and body["error"], body

    err(httpx.post(f"{url}/v1/lookup", json={"token_ids": [1, "x"]}), 422, "token_ids[1]")
    err(httpx.post(f"{url}/v1/lookup", json={"token_ids": [1, -5]}), 422, "token_ids[1]")
    err(httpx.post(f"{url}/v1/lookup", json={"token_ids": "abc"}), 422, "token_ids")
    err(httpx.post(f"{url}/v1/lookup", json={}), 422, "token_ids")
    err(httpx.post(f"{url}/v1/lookup", json={"tokens": [1]}), 422, "tokens")
    err(httpx.post(f"{url}/v1/lookup", json={"token_ids": [1], "modle": "x"}), 422, "modle")
    err(httpx.post(f"{url}/v1/lookup", content=b"{not json", headers={"content-type": "application/json"}), 422, None)
    err(httpx.post(f"{url}/v1/lookup", json={"token_ids": [1] * 6000}), 400, "token_ids")
    err(httpx.post(f"{url}/v1/lookup", content=b"[" + b"1," * 40000 + b"1]",
                   headers={"content-type": "application/json"}), 413, None)
    err(httpx.get(f"{url}/v1/prefixes", params={"limit": 0}), 422, "limit")
    err(httpx.get(f"{url}/v1/blocks/zz-not-hex"), 422, "hash")
    # Mutations: token required; then field-level errors.
    new = {"name": "c", "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    err(httpx.post(f"{url}/v1/engines", json=new), 401, "Authorization")
    err(httpx.post(f"{url}/v1/engines", json=new, headers={"Authorization": "Bearer nope"}), 401, "Authorization")
    err(httpx.delete(f"{url}/v1/engines/a"), 401, "Authorization")
    err(httpx.post(f"{url}/v1/engines", json={**new, "endpoint": "udp://x"}, headers=auth), 422, "endpoint")
    err(httpx.post(f"{url}/v1/engines", json={**new, "replay_endpoint": "tcp://nohost"}, headers=auth), 422, "replay_endpoint")
    err(httpx.post(f"{url}/v1/engines", json={**new, "name": "bad name!"}, headers=auth), 422, "name")
    err(httpx.post(f"{url}/v1/engines", json={**new, "name": "a"}, headers=auth), 409, "name")
    err(httpx.delete(f"{url}/v1/engines/nope", headers=auth), 404, "name")
    after = httpx.get(f"{url}/v1/engines").json()
    assert [p["name"] for p in after["engines"]] == [p["name"] for p in before["engines"]] == ["a", "b"]


def test_engines_are_added_and_removed_at_run_time(fleet):
    srv, _, _ = fleet
    auth = {"Authorization": "Bearer s3cret"}
    c = Pub(legacy=False)
    try:
        r = httpx.post(f"{srv.url}/v1/engines", headers=auth, json={
            "name": "c", "endpoint": f"tcp://127.0.0.1:{c.live}",
            "replay_endpoint": f"tcp://127.0.0.1:{c.replay}", "model": "m"})
        assert r.status_code == 201, r.text
        c.send(BlockStored([77], None, Q[:4], BS, None, "GPU", None))
        assert wait_until(lambda: any(p["engine"] == "c" for p in lookup(srv, Q)["engines"]), 10)
        engines = {p["name"]: p for p in httpx.get(f"{srv.url}/v1/engines").json()["engines"]}
        assert engines["c"]["status"] == "live" and engines["c"]["connected"]
        assert httpx.delete(f"{srv.url}/v1/engines/c", headers=auth).status_code == 204
        assert all(p["engine"] != "c" for p in lookup(srv, Q)["engines"])
        assert "c" not in [p["name"] for p in httpx.get(f"{srv.url}/v1/engines").json()["engines"]]
    finally:
        c.pub.shutdown(0.5)


def test_event_stream_reports_applied_batches(fleet):
    srv, a, _ = fleet
    time.sleep(0.3)
    with httpx.stream("GET", f"{srv.url}/v1/events", params={"max_seconds": 3}, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        a.send(BlockStored([1], None, P[:4], BS, None, "GPU", None))
        kinds, batch = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
            elif line.startswith("data: ") and kinds[-1] == "batch":
                batch = json.loads(line[6:])
            if batch is not None and "summary" in kinds:
                break
    assert "summary" in kinds and batch["engine"] == "a" and batch["stored"] == 1


def test_openapi_documents_the_api(fleet):
    srv, _, _ = fleet
    spec = httpx.get(f"{srv.url}/openapi.json").json()
    for path in ("/v1/engines", "/v1/lookup", "/v1/blocks/{hash}", "/v1/prefixes", "/v1/events",
                 "/healthz", "/metrics"):
        assert path in spec["paths"], path
    ref = spec["paths"]["/v1/lookup"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    # Exactly one of token_ids, prompt, messages: none is required on its own.
    assert {"token_ids", "prompt", "messages"} <= set(body["properties"])


def test_old_pod_paths_and_fields_still_answer(fleet):
    """Engines were called pods: /v1/pods... and a route candidate's ``pod`` field still
    work (same handlers; answers carry 0.1.0's keys beside the new ones until 0.3.0, as
    do /v1/lookup's and /v1/route's), and OpenAPI marks them deprecated."""
    srv, _, _ = fleet
    url, auth = srv.url, {"Authorization": "Bearer s3cret"}
    names = lambda path: [p["name"] for p in httpx.get(f"{url}{path}").json()["engines"]]  # noqa: E731
    assert names("/v1/pods") == names("/v1/engines") == ["a", "b"]
    old = httpx.get(f"{url}/v1/pods").json()
    assert old["pods"] == old["engines"] and "pods" not in httpx.get(f"{url}/v1/engines").json()
    c = Pub(legacy=False)
    try:
        # With its replay endpoint: a first batch sent before the new SUB joined is
        # replayed, not lost (this test is about the old paths, not about that race).
        new = {"name": "c", "endpoint": f"tcp://127.0.0.1:{c.live}", "model": "m",
               "replay_endpoint": f"tcp://127.0.0.1:{c.replay}"}
        assert httpx.post(f"{url}/v1/pods", json=new).status_code == 401  # still guarded
        r = httpx.post(f"{url}/v1/pods", headers=auth, json=new)
        assert r.status_code == 201 and r.json()["name"] == "c", r.text
        assert names("/v1/engines") == ["a", "b", "c"]
        c.send(BlockStored([77], None, Q[:4], BS, None, "GPU", None))
        assert wait_until(lambda: httpx.get(f"{url}/v1/pods/c/blocks").json()
                          == {"engine": "c", "pod": "c", "tiers": {"GPU": [77]}}, 10)
        assert httpx.get(f"{url}/v1/engines/c/blocks").json() == {"engine": "c", "tiers": {"GPU": [77]}}
        found = httpx.post(f"{url}/v1/lookup", json={"token_ids": Q[:BS], "model": "m"}).json()
        assert [e["engine"] for e in found["engines"]] == ["c"]
        assert found["pods"] == [{"pod": e["engine"], **{k: v for k, v in e.items() if k != "engine"}}
                                 for e in found["engines"]]
        assert httpx.delete(f"{url}/v1/pods/c", headers=auth).status_code == 204
        assert names("/v1/engines") == ["a", "b"]
        assert httpx.get(f"{url}/v1/pods/c/blocks").status_code == 404
    finally:
        c.pub.shutdown(0.5)

    def route(candidates):
        return httpx.post(f"{url}/v1/route", json={"token_ids": P, "candidates": candidates})

    r = route([{"pod": "b"}, {"engine": "a", "load": {"running": 1}}])
    assert r.status_code == 200 and {s["engine"] for s in r.json()["scores"]} == {"a", "b"}, r.text
    assert r.json()["pod"] == r.json()["engine"]
    for bad, field in (([{"pod": "a", "engine": "a"}], "candidates[0].engine"),
                       ([{"load": {"running": 1}}], "candidates[0].engine"),
                       ([{"pod": "zz"}], "candidates[0].engine")):
        r = route(bad)
        assert r.status_code == 422 and r.json()["field"] == field, r.text

    spec = httpx.get(f"{url}/openapi.json").json()
    paths = spec["paths"]
    for path, methods in (("/v1/pods", ("get", "post")), ("/v1/pods/{name}", ("delete",)),
                          ("/v1/pods/{name}/blocks", ("get",))):
        new_path = path.replace("/v1/pods", "/v1/engines")
        for m in methods:
            assert paths[path][m].get("deprecated") is True, (path, m)
            assert not paths[new_path][m].get("deprecated"), (new_path, m)
    candidate = spec["components"]["schemas"]["CandidateBody"]["properties"]
    assert candidate["pod"].get("deprecated") is True and "deprecated" not in candidate["engine"]
    schemas = spec["components"]["schemas"]
    for model, old_key, new_key in (("LookupResponse", "pods", "engines"), ("RouteResponse", "pod", "engine"),
                                    ("PodsResponse", "pods", "engines"), ("PodBlocksResponse", "pod", "engine")):
        props = schemas[model]["properties"]
        assert props[old_key].get("deprecated") is True and "deprecated" not in props[new_key], model


def test_handlers_never_block_the_event_loop_on_the_index_lock():
    """While the ingest side holds the index lock, a lookup waits in a worker thread
    and the event loop keeps answering (an async route here: the OpenAPI schema)."""
    import threading

    agg_settings = AggregatorSettings(engines=())
    app = create_app(agg_settings)
    with ServerThread(app) as srv:
        url = f"http://127.0.0.1:{srv.port}"
        with httpx.Client(timeout=10) as c:
            assert c.post(f"{url}/v1/lookup", json={"token_ids": P}).status_code == 200
            index = app.state.aggregator.index
            released = threading.Event()
            index.lock.acquire()
            try:
                results: list[float] = []

                def slow_lookup():
                    t0 = time.monotonic()
                    with httpx.Client(timeout=10) as c2:
                        assert c2.post(f"{url}/v1/lookup", json={"token_ids": P}).status_code == 200
                    results.append(time.monotonic() - t0)

                t = threading.Thread(target=slow_lookup)
                t.start()
                time.sleep(0.3)  # the lookup is now waiting for the lock
                t0 = time.monotonic()
                assert c.get(f"{url}/openapi.json").status_code == 200
                assert time.monotonic() - t0 < 1.0
                assert not results  # still waiting: the lock is held
            finally:
                index.lock.release()
                released.set()
            t.join(10)
            assert results and results[0] >= 0.3


def test_hot_handlers_stay_on_the_event_loop():
    """/v1/lookup and /v1/route are coroutines with no dependency to resolve: FastAPI
    runs a plain ``def`` handler or dependency on its thread pool, a thread hop per
    request that cost ~0.5 ms here (several under ingest), and resolving dependencies
    was a third of the event loop's time per lookup."""
    import inspect

    from fastapi.routing import APIRoute

    from kvevents.api import api_routes

    app = create_app(AggregatorSettings())
    hot = {r.path: r for r in api_routes(app.router.routes) if r.path in ("/v1/lookup", "/v1/route")}
    assert set(hot) == {"/v1/lookup", "/v1/route"}
    for path, r in hot.items():
        assert inspect.iscoroutinefunction(r.endpoint), path
        assert not r.dependant.dependencies, (path, [d.call for d in r.dependant.dependencies])


def test_hot_handlers_skip_fastapi_dependency_solving_but_not_guards():
    """serve_lean puts the hot paths (/v1/lookup, /v1/route and the OpenAI
    completions) first and serves them through
    Starlette's request_response; a route with a dependency (a guard) keeps FastAPI's
    handling. Errors still come in the API's shape."""
    from fastapi import Depends, FastAPI
    from fastapi.routing import APIRoute
    from fastapi.testclient import TestClient
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse

    from kvevents.api import HOT_PATHS, serve_lean
    from kvevents.api.auth import require_token

    app = create_app(AggregatorSettings())
    n = len(HOT_PATHS)
    first = [r.path for r in app.router.routes[:n]]
    assert sorted(first) == sorted(HOT_PATHS)
    for r in app.router.routes[:n]:
        assert r.app.__module__ == "starlette.routing"  # not FastAPI's request handler
    with TestClient(app) as c:
        bad = c.post("/v1/lookup", json={"token_ids": [1, -1]})
        assert bad.status_code == 422 and bad.json()["field"] == "token_ids[1]"
        assert c.post("/v1/route", json={}).status_code == 422
        assert "/v1/lookup" in c.get("/openapi.json").json()["paths"]

    guarded = FastAPI()

    @guarded.post("/v1/lookup", dependencies=[Depends(require_token)])
    async def lookup(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    handler = guarded.router.routes[-1].app
    serve_lean(guarded, HOT_PATHS)
    route = next(r for r in guarded.router.routes if isinstance(r, APIRoute))
    assert route.app is handler and handler.__module__ == "fastapi.routing"  # guard runs


def test_lookup_route_and_inspection_under_an_identity(fleet):
    """Adapter and tenant (cache_salt) blocks as vLLM publishes them (LoRA name on every
    block's extra key, the salt on the first block's): matched only under the same
    identity over HTTP; a salted prefix is never shown by /v1/prefixes or /v1/blocks;
    the salt is in no error and no metric."""
    srv, a, b = fleet
    url = srv.url
    time.sleep(0.5)
    salt = "tenant-secret-7"
    a.send(BlockStored([61, 62], None, blocks(P, 0, 2), BS, 1, "GPU", "sql", [["sql"], ["sql"]]))
    a.send(BlockStored([71, 72, 73], None, blocks(P, 0, 3), BS, None, "GPU", None, [[salt], None, None]))
    b.send(BlockStored([h(True, 81)], None, blocks(P, 0, 1), BS, None, "GPU", None))
    assert wait_until(lambda: lookup(srv, P, cache_salt=salt)["engines"] != [], 10)
    assert lookup(srv, P, cache_salt=salt)["engines"] == [
        {"engine": "a", "matched_tokens": 12, "tiers": {"GPU": 12}}]
    assert lookup(srv, P, lora_name="sql")["engines"] == [
        {"engine": "a", "matched_tokens": 8, "tiers": {"GPU": 8}}]
    assert lookup(srv, P, lora_name="sql", model="m", cache_salt=salt)["engines"] == []
    assert lookup(srv, P, cache_salt="another")["engines"] == []
    assert [e["engine"] for e in lookup(srv, P)["engines"]] == ["b"]
    r = httpx.post(f"{url}/v1/route", json={"token_ids": P, "cache_salt": salt})
    assert r.status_code == 200 and r.json()["engine"] == "a" and r.json()["matched_tokens"] == 12
    r = httpx.post(f"{url}/v1/route", json={"token_ids": P, "lora_name": "sql"})
    assert r.json()["engine"] == "a" and r.json()["matched_tokens"] == 8
    # Never shown without the salt (nor with it: inspection is the operator's, not a tenant's).
    for hh in (71, 72, 73):
        assert httpx.get(f"{url}/v1/blocks/{hh}").status_code == 404
    assert httpx.get(f"{url}/v1/blocks/61").json()["lora_name"] == "sql"
    top = httpx.get(f"{url}/v1/prefixes", params={"limit": 50}).json()["prefixes"]
    assert top and all(p["lora_name"] == "sql" or p["engines"] == ["b"] for p in top), top
    bad = httpx.post(f"{url}/v1/lookup", json={"token_ids": P, "cache_salt": 7})
    assert bad.status_code == 422 and bad.json()["field"] == "cache_salt"
    assert salt not in httpx.get(f"{url}/metrics").text
