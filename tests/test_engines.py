"""The followed engines: the registry's rules, and reconcile and routing on a real
aggregator fed by real publishers."""

from __future__ import annotations

import asyncio
import time

import pytest

from support import free_port, wait_until
from kvevents.engines import EngineBudgetError, EngineExistsError, EngineRegistry, EngineSpec
from kvevents.ingest.source import SourceStats
from kvevents.routing import EngineLoad, Router
from kvevents.service.aggregator import Aggregator
from kvevents.service.settings import AggregatorSettings
from kvevents.text.prompt import InputError
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch

TOKS = list(range(32))


def spec(name: str, port: int = 1, model: str | None = None) -> EngineSpec:
    return EngineSpec(name, f"tcp://127.0.0.1:{port}", model=model)


def test_registry_add_remove_and_budget():
    reg = EngineRegistry(2, down_after_s=5, stale_after_s=5)
    reg.add(spec("a"))
    with pytest.raises(EngineExistsError):
        reg.add(spec("a", 2))
    reg.add(spec("b"), origin="api")
    with pytest.raises(EngineBudgetError):
        reg.add(spec("c"))
    assert reg.names() == ["a", "b"] and [s.origin for s in reg.states()] == ["static", "api"]
    assert reg.model_of("a") == (True, None) and reg.model_of("zz") == (False, None)
    reg.remove("a")
    with pytest.raises(KeyError):
        reg.remove("a")
    reg.add(spec("c", model="m"))  # the freed slot is usable again
    assert reg.model_of("c") == (True, "m")


def test_plan_touches_only_its_own_origin():
    reg = EngineRegistry(10, down_after_s=5, stale_after_s=5)
    reg.add(spec("static-0"))
    reg.add(spec("dns-a", 1), origin="dns")
    reg.add(spec("dns-b", 2), origin="dns")
    # b vanished, a's endpoint changed, c is new; a name another origin holds is left alone.
    plan = reg.plan([spec("dns-a", 9), spec("dns-c", 3), spec("static-0", 7)], "dns")
    assert [s.name for s in plan.add] == ["dns-a", "dns-c"]
    assert plan.remove == ("dns-b", "dns-a")
    assert reg.plan([spec("dns-a", 1), spec("dns-b", 2)], "dns") == type(plan)()  # nothing to do
    assert reg.plan([], "k8s").remove == ()  # another origin owns none of these


def test_status_down_and_routable_follow_the_connection():
    reg = EngineRegistry(4, down_after_s=0.05, stale_after_s=1)
    reg.add(spec("a"))
    reg.add(spec("b"))
    up = SourceStats(connected=1, last_received=time.time())
    reg.track_down({"a": up})
    time.sleep(0.08)
    assert reg.unroutable() == {"b"}
    assert reg.status(up, time.time()) == "live" and reg.status(SourceStats(), time.time()) == "down"
    assert reg.status(SourceStats(connected=1), time.time()) == "stale"  # never heard from
    described = {d["name"]: d for d in (reg.describe(s, up, time.time()) for s in reg.states())}
    assert described["a"]["routable"] and not described["b"]["routable"]


def _stored(h: int, parent: int | None, toks: list[int]) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([h], parent, toks, 16, None, "GPU", None)])


def test_reconcile_follows_new_drops_vanished_and_keeps_static_engines():
    pubs = {}
    ports = {}
    for name in ("static-0", "disc-a", "disc-b"):
        live, replay = free_port(), free_port()
        ports[name] = (live, replay)
        pubs[name] = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}",
                                                       replay_endpoint=f"tcp://*:{replay}"))

    def engine(name: str) -> EngineSpec:
        live, replay = ports[name]
        return EngineSpec(name, f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}")

    agg = Aggregator(AggregatorSettings(engines=(engine("static-0"),)))
    agg.start()
    try:
        assert agg.reconcile([engine("disc-a"), engine("disc-b")], "disc") == (["disc-a", "disc-b"], [])
        assert wait_until(lambda: agg.readiness()["ready"], 10), agg.readiness()
        for name, pub in pubs.items():
            pub.publish(_stored(1, None, TOKS[:16]))
        assert wait_until(lambda: len(agg.lookup(TOKS).engines) == 3, 10)
        # disc-b vanished from the desired set: followed no more, its blocks gone at once.
        assert agg.reconcile([engine("disc-a")], "disc") == ([], ["disc-b"])
        assert sorted(m.engine for m in agg.lookup(TOKS).engines) == ["disc-a", "static-0"]
        assert [e["name"] for e in agg.engine_statuses()] == ["static-0", "disc-a"]
        # An empty set from the source drops its engines, never the configured one.
        agg.reconcile([], "disc")
        assert [m.engine for m in agg.lookup(TOKS).engines] == ["static-0"]
    finally:
        for pub in pubs.values():
            pub.shutdown(0.5)
        agg.stop()


def test_router_checks_candidates_and_prefers_the_cached_engine():
    live, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://*:{replay}"))
    agg = Aggregator(AggregatorSettings(engines=(
        EngineSpec("hot", f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}"),
        EngineSpec("cold", f"tcp://127.0.0.1:{free_port()}"),)))
    agg.start()
    router = Router(agg)
    try:
        assert wait_until(lambda: "hot" not in agg.down_engines(), 10)
        assert agg.down_engines() == {"cold"}  # nothing listens on its port
        pub.publish(_stored(1, None, TOKS[:16]))
        pub.publish(_stored(2, 1, TOKS[16:]))
        assert wait_until(lambda: agg.lookup(TOKS).engines and agg.lookup(TOKS).engines[0].tokens == 32, 10)
        for bad, field in (([("nope", EngineLoad())], "candidates[0].engine"),
                           ([("hot", EngineLoad()), ("hot", EngineLoad())], "candidates[1].engine"),
                           ([], "candidates")):
            with pytest.raises(InputError) as err:
                router.candidates(bad)
            assert err.value.status == 422 and err.value.field == field
        decision = asyncio.run(router.decide(TOKS))
        assert decision.engine == "hot" and decision.matched_tokens == 32
        # "cold" has no publisher (down): offered only by name, it is still never chosen
        # over an engine that is up, even a busier one.
        busy = asyncio.run(router.decide(TOKS, requested=[("cold", EngineLoad()), ("hot", EngineLoad(running=3))]))
        assert busy.engine == "hot" and "skipped down: cold" in busy.reason
    finally:
        pub.shutdown(0.5)
        agg.stop()
