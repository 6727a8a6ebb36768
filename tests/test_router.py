"""Routing policies on constructed cases, and ``POST /v1/route`` over HTTP."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from support import ServerThread, free_port, wait_until
from kvevents.api import create_app
from kvevents.index import LookupResult, EngineMatch
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.routing.policies import (
    Candidate,
    EngineLoad,
    KVAwarePolicy,
    KVRouterConfig,
    LeastLoadedPolicy,
    RoundRobinPolicy,
)
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

PROMPT = list(range(1000, 3048))  # 2,048 tokens


def result(**engines: tuple[int, dict[str, int]]) -> LookupResult:
    matches = [EngineMatch(p, t, tiers, 16) for p, (t, tiers) in engines.items()]
    matches.sort(key=lambda m: -m.tokens)
    return LookupResult(len(PROMPT), 16, matches)


def cands(*names: str, **loads: float) -> list[Candidate]:
    return [Candidate(n, EngineLoad(waiting=loads.get(n.replace("-", "_"), 0.0))) for n in names]


NO_AFFINITY = KVRouterConfig(affinity_weight=0.0)


def test_longest_cached_prefix_wins():
    policy = KVAwarePolicy(NO_AFFINITY)
    d = policy.choose(PROMPT, result(a=(512, {"GPU": 512}), b=(1536, {"GPU": 1536})), cands("a", "b", "c"))
    assert d.engine == "b" and d.matched_tokens == 1536 and d.tiers == {"GPU": 1536}
    assert "1536 of 2048" in d.reason
    assert [s.engine for s in d.scores][0] == "b"


def test_tier_weights_prefer_gpu_over_an_equal_cpu_run():
    policy = KVAwarePolicy(NO_AFFINITY)
    d = policy.choose(PROMPT, result(a=(1024, {"CPU": 1024}), b=(1024, {"GPU": 1024})), cands("a", "b"))
    assert d.engine == "b"
    # A longer CPU run beats a short GPU run when the weights say so...
    d = policy.choose(PROMPT, result(a=(2048, {"CPU": 2048}), b=(512, {"GPU": 512})), cands("a", "b"))
    assert d.engine == "a"
    # ...and not when the CPU tier is weighted out.
    gpu_only = KVAwarePolicy(KVRouterConfig(tier_weights={"GPU": 1.0, "CPU": 0.0}, affinity_weight=0.0))
    d = gpu_only.choose(PROMPT, result(a=(2048, {"CPU": 2048}), b=(512, {"GPU": 512})), cands("a", "b"))
    assert d.engine == "b"


def test_load_guard_falls_back_from_an_overloaded_engine():
    policy = KVAwarePolicy(KVRouterConfig(max_imbalance=4, affinity_weight=0.0))
    lookup = result(a=(2048, {"GPU": 2048}))
    assert policy.choose(PROMPT, lookup, cands("a", "b", a=3)).engine == "a"  # within the guard
    d = policy.choose(PROMPT, lookup, cands("a", "b", a=9, b=1))
    assert d.engine == "b" and d.reason.startswith("load guard: a caches more")
    assert {s.engine: s.eligible for s in d.scores} == {"a": False, "b": True}


def test_load_breaks_equal_caches_and_ties_spread_over_engines():
    policy = KVAwarePolicy(NO_AFFINITY)
    lookup = result(a=(512, {"GPU": 512}), b=(512, {"GPU": 512}))
    assert policy.choose(PROMPT, lookup, cands("a", "b", a=2)).engine == "b"
    # Exact ties: deterministic per prompt, spread across prompts.
    names = [f"e{i}" for i in range(4)]
    picks = Counter()
    for i in range(200):
        prompt = [i] + PROMPT[1:]
        first = policy.choose(prompt, result(), cands(*names)).engine
        assert policy.choose(prompt, result(), cands(*names)).engine == first
        picks[first] += 1
    assert set(picks) == set(names) and min(picks.values()) > 20
    d = policy.choose(PROMPT, result(), cands(*names))
    assert "no engine caches" in d.reason and "tie among 4" in d.reason


def test_affinity_sends_a_conversation_back_to_the_same_engine():
    policy = KVAwarePolicy()
    system = list(range(64))
    conversation = system + list(range(5000, 5100))
    names = ["a", "b", "c", "d"]
    # Every engine holds the system prompt; nothing else is cached anywhere.
    lookup = LookupResult(200, 16, [EngineMatch(n, 64, {"GPU": 64}, 16) for n in names])
    first = policy.choose(conversation, lookup, cands(*names)).engine
    later_turn = conversation + list(range(9000, 9100))
    assert policy.choose(later_turn, lookup, cands(*names)).engine == first
    others = {policy.choose(system + [i] * 100, lookup, cands(*names)).engine for i in range(40)}
    assert others == set(names)


def test_affinity_and_ties_hash_the_same_ids_the_same_way_in_any_container():
    """A list (token-id prompts), an ``array('q')`` (the gateway's tokenizer) and a numpy
    array of the same ids go to the same engine."""
    from array import array

    import numpy as np

    policy = KVAwarePolicy()
    names = ["a", "b", "c", "d"]
    lookup = LookupResult(100, 16, [])
    for start in range(0, 4000, 100):
        ids = list(range(start, start + 100))
        chosen = {policy.choose(kind(ids), lookup, cands(*names)).engine
                  for kind in (list, lambda x: array("q", x), lambda x: np.asarray(x, dtype=np.int64))}
        assert len(chosen) == 1, start
    huge = [2**70, 5, 6]  # past int64: still a choice
    assert policy.choose(huge, lookup, cands(*names)).engine in names


def test_balance_evens_out_the_requests_a_gateway_sends():
    """``recent_share`` (a gateway's fraction of its recent requests per engine) pulls
    toward the engine short of its share: it wins the prompts where it trails by little
    in cache, not those another engine caches whole; a weight of 0, or no share (``POST
    /v1/route``), leaves the cache to decide."""
    def shares(a: float, b: float | None = None) -> list[Candidate]:
        return [Candidate("a", recent_share=a), Candidate("b", recent_share=b if b is not None else 1 - a)]

    policy = KVAwarePolicy(KVRouterConfig(affinity_weight=0.0, balance_weight=3.0))
    half = result(a=(1024, {"GPU": 1024}))  # a caches half the prompt, b nothing
    assert policy.choose(PROMPT, half, shares(0.5)).engine == "a"
    d = policy.choose(PROMPT, half, shares(0.6))
    assert d.engine == "b"  # 3 x 0.2 > 0.5
    assert d.reason == ("a caches more (1024 tokens against 0) but scores lower (60% of the "
                        "recent requests against 40%); chose b")
    whole = result(a=(2048, {"GPU": 2048}))
    assert policy.choose(PROMPT, whole, shares(0.6)).engine == "a"  # 1.0 > 0.6
    assert policy.choose(PROMPT, whole, shares(0.7)).engine == "b"
    off = KVAwarePolicy(KVRouterConfig(affinity_weight=0.0, balance_weight=0.0))
    assert off.choose(PROMPT, half, shares(0.9)).engine == "a"
    assert policy.choose(PROMPT, half, cands("a", "b")).engine == "a"  # no shares tracked
    with pytest.raises(ValueError):
        KVRouterConfig(balance_weight=-1)


def test_baselines():
    rr = RoundRobinPolicy()
    assert [rr.choose(PROMPT, None, cands("a", "b", "c")).engine for _ in range(4)] == ["a", "b", "c", "a"]
    ll = LeastLoadedPolicy()
    assert ll.choose(PROMPT, None, cands("a", "b", "c", a=2, b=1, c=3)).engine == "b"


def test_bad_policy_inputs():
    with pytest.raises(ValueError):
        KVAwarePolicy().choose(PROMPT, result(), [])
    with pytest.raises(ValueError):
        KVRouterConfig(tier_weights={"GPU": -1})
    with pytest.raises(ValueError):
        EngineLoad(waiting=-1)


@pytest.fixture
def server():
    live = free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}"))
    settings = AggregatorSettings(engines=(EngineSpec("a", f"tcp://127.0.0.1:{live}"),
                                           EngineSpec("b", f"tcp://127.0.0.1:{free_port()}")))
    with ServerThread(create_app(settings)) as srv:
        time.sleep(0.4)
        pub.publish(KVEventBatch(time.time(), [BlockStored([1, 2], None, PROMPT[:32], 16, None, "GPU", None)]))
        assert wait_until(lambda: httpx.post(f"{srv.url}/v1/lookup", json={"token_ids": PROMPT}).json()["engines"], 5)
        yield srv
    pub.shutdown(0.5)


def test_route_over_http(server):
    url = server.url
    r = httpx.post(f"{url}/v1/route", json={"token_ids": PROMPT, "candidates": [
        {"engine": "a", "load": {"kv_usage": 0.2}}, {"engine": "b", "load": {"running": 2}}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["engine"] == "a" and body["matched_tokens"] == 32 and body["tiers"] == {"GPU": 32}
    assert {s["engine"] for s in body["scores"]} == {"a", "b"} and body["reason"]
    # Without candidates: every engine that is not down (b has no publisher).
    r = httpx.post(f"{url}/v1/route", json={"token_ids": PROMPT})
    assert r.status_code == 200 and r.json()["engine"] == "a"
    text = httpx.get(f"{url}/metrics").text
    assert 'kvevents_lookups_total{api="route",model_name=""} 2.0' in text


@pytest.mark.parametrize("body, status, field", [
    ({"token_ids": PROMPT, "candidates": [{"engine": "zz"}]}, 422, "candidates[0].engine"),
    ({"token_ids": PROMPT, "candidates": [{"engine": "a"}, {"engine": "a"}]}, 422, "candidates[1].engine"),
    ({"token_ids": PROMPT, "candidates": []}, 422, "candidates"),
    ({"token_ids": PROMPT, "candidates": [{"engine": "a", "load": {"waiting": -1}}]}, 422,
     "candidates[0].load.waiting"),
    ({"token_ids": PROMPT, "candidates": [{"engine": "a", "load": {"kv_usage": 2}}]}, 422,
     "candidates[0].load.kv_usage"),
    ({"token_ids": [1, "x"]}, 422, "token_ids[1]"),
    ({"candidates": [{"engine": "a"}]}, 422, "token_ids"),
])
def test_route_bad_input(server, body, status, field):
    r = httpx.post(f"{server.url}/v1/route", json=body)
    assert r.status_code == status, r.text
    assert r.json()["field"] == field, r.json()


def test_route_settings_set_the_policys_trade():
    """``route_max_imbalance`` / ``route_load_weight`` (``--route-*``) reach the policy
    that ``POST /v1/route`` and the gateway use: with the guard at 1 request, or a heavy
    load weight, the engine that caches the whole prompt but is 2 requests busier is
    passed over; by default it is chosen."""
    ports = [free_port(), free_port()]
    pubs = [ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{p}")) for p in ports]
    engines = tuple(EngineSpec(n, f"tcp://127.0.0.1:{p}") for n, p in zip("ab", ports))
    body = {"token_ids": PROMPT, "candidates": [{"engine": "a", "load": {"running": 2}}, {"engine": "b"}]}
    chosen = {}
    try:
        for name, extra in (("default", {}), ("guard", {"route_max_imbalance": 1}),
                            ("load", {"route_load_weight": 50})):
            app = create_app(AggregatorSettings(engines=engines, **extra))
            with ServerThread(app) as srv:
                assert wait_until(lambda: not app.state.aggregator.down_engines(), 5)
                app.state.aggregator.index.apply_batch("a", KVEventBatch(1.0, [BlockStored(
                    list(range(1, 129)), None, PROMPT, 16, None, "GPU", None)]))  # all of it
                r = httpx.post(f"{srv.url}/v1/route", json=body)
                assert r.status_code == 200, r.text
                chosen[name] = (r.json()["engine"], r.json()["reason"])
    finally:
        for pub in pubs:
            pub.shutdown(0.5)
    assert chosen["default"][0] == "a"
    assert chosen["guard"][0] == "b" and chosen["guard"][1].startswith("load guard")
    assert chosen["load"][0] == "b"
