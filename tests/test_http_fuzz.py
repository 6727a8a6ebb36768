"""No input gives a 5xx: a bounded schemathesis run over every documented route of a
real uvicorn server, plus the inputs that used to give 500s, one by one.

Bounds: a fixed number of examples per operation (derandomized, so the run is the same
every time), no hypothesis deadline, about 20 s in all on 2 cores. The SSE route
streams until its client leaves, so it is fuzzed by hand below with ``max_seconds``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from support import ServerThread, free_port, wait_until
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def server():
    live = free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{live}", bind=True))
    # With a token, the fuzzer (which sends none) cannot create engines: generated
    # endpoints could name real hosts, and tests contact 127.0.0.1 only.
    app = create_app(AggregatorSettings(
        engines=(EngineSpec("a", f"tcp://127.0.0.1:{live}"), EngineSpec("b", f"tcp://127.0.0.1:{free_port()}")),
        auth_token=TOKEN, max_prompt_tokens=4096))
    with ServerThread(app) as srv:
        time.sleep(0.3)
        pub.publish(KVEventBatch(time.time(), [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)]))
        # A publisher clock gone wrong: its lag is infinite, which JSON cannot say.
        pub.publish(KVEventBatch(float("-inf"), []))
        assert wait_until(lambda: httpx.get(f"{srv.url}/v1/engines").json()["engines"][0]["batches"] == 2, 5)
        yield srv
    pub.shutdown(0.5)


def test_no_route_answers_5xx(server):
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    tried: list[str] = []
    statuses: list[int] = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path == "/v1/events":
            continue
        tried.append(f"{op.method.upper()} {op.path}")

        # Valid and invalid inputs alike (positive and negative generation).
        @given(case=st.one_of(op.as_strategy(schemathesis.GenerationMode.POSITIVE),
                              op.as_strategy(schemathesis.GenerationMode.NEGATIVE)))
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_5xx(case):
            response = case.call(timeout=10)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.method, case.formatted_path,
                                                response.status_code, response.text[:300])

        no_5xx()
    assert len(tried) >= 8, tried
    # It really ran: many requests, both accepted and rejected ones.
    assert len(statuses) >= 20 * len(tried) and {200, 422} <= set(statuses), sorted(set(statuses))


KNOWN = [
    ("GET", "/v1/blocks/%C2%B2", None),
    ("GET", "/v1/blocks/" + "1" * 5000, None),
    ("GET", "/v1/blocks/-99999999999999999999", None),
    ("GET", "/v1/blocks/0x", None),
    ("POST", "/v1/route", {"token_ids": [1, 2], "candidates": [{"engine": "a", "load": {"waiting": 1e308}}]}),
    ("POST", "/v1/route", {"token_ids": [1, 2], "candidates": [{"engine": "a", "load": {"running": 1e308}},
                                                              {"engine": "b", "load": {"running": 1e308}}]}),
]


@pytest.mark.parametrize("method, path, body", KNOWN)
def test_inputs_that_gave_500_get_4xx(server, method, path, body):
    r = httpx.request(method, server.url + path, json=body, timeout=5)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "error" in r.json()


@pytest.mark.parametrize("last_id", [b"\xb2", b"\xc2\xb2", b"9" * 40, b"-1", b"12"])
def test_last_event_id_never_fails_and_feed_is_strict_json(server, last_id):
    with httpx.stream("GET", f"{server.url}/v1/events?max_seconds=0.6",
                      headers=[(b"Last-Event-ID", last_id)], timeout=5) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert datas
    for d in datas:
        json.loads(d, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


@pytest.mark.parametrize("body, field", [
    ({"name": "x", "endpoint": "tcp://*:5557"}, "endpoint"),
    ({"name": "x", "endpoint": "tcp://127.0.0.1:0"}, "endpoint"),
    ({"name": "x", "endpoint": "tcp://127.0.0.1:70000"}, "endpoint"),
    ({"name": "x", "endpoint": "udp://127.0.0.1:5"}, "endpoint"),
    ({"name": "x", "endpoint": "tcp://127.0.0.1"}, "endpoint"),
    ({"name": "x", "endpoint": "tcp://127.0.0.1:5", "replay_endpoint": "tcp://0.0.0.0:6"}, "replay_endpoint"),
    ({"name": "x", "endpoint": "tcp://127.0.0.1:5", "replay_endpoint": "tcp://127.0.0.1:0"}, "replay_endpoint"),
])
def test_engine_endpoints_are_validated(server, body, field):
    r = httpx.post(f"{server.url}/v1/engines", json=body, timeout=5,
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert "x" not in {p["name"] for p in httpx.get(f"{server.url}/v1/engines").json()["engines"]}


def test_feed_json_replaces_non_finite_numbers():
    from kvevents.service.feed import to_json

    assert json.loads(to_json({"a": float("inf"), "b": [float("nan"), 1.5]})) == {"a": None, "b": [None, 1.5]}
