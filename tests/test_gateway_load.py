"""How fresh the gateway's view of each engine's load is (issue 20: replicas that balance
without talking to each other see each other's requests only through the engines'
``/metrics``). A real HTTP server plays the engine's ``/metrics`` (its queue set by the
test, every read time-stamped); the gateway's own poller (:class:`EngineLoads`) reads it
over a real socket with a real ``httpx`` client."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from support import ServerThread
from kvevents.gateway.load import SETTLE_S, SHARE_WINDOW, EngineLoads
from kvevents.service.settings import load_settings


class FakeMetrics:
    """An engine's ``/metrics``: ``waiting`` requests queued (other clients' and other
    replicas'), an optional delay per answer; the monotonic time of every read."""

    def __init__(self) -> None:
        self.waiting = 0
        self.delay = 0.0
        self.reads: list[float] = []
        self.lock = threading.Lock()

        async def metrics(request):
            with self.lock:
                self.reads.append(time.monotonic())
            if self.delay:
                await asyncio.sleep(self.delay)
            return PlainTextResponse(
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}.0\n'
                'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')

        self.app = Starlette(routes=[Route("/metrics", metrics)])

    def reads_between(self, t0: float, t1: float) -> int:
        with self.lock:
            return sum(t0 <= t < t1 for t in self.reads)


async def _with_poller(engine: FakeMetrics, url: str, body, interval: float = 1.0,
                       busy_interval: float | None = 0.05) -> None:
    loads = EngineLoads()
    async with httpx.AsyncClient() as client:
        task = asyncio.create_task(loads.poll_forever(
            client, lambda: {"e0": url + "/metrics"}, interval, busy_interval))
        try:
            await body(loads)
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


def test_polls_fast_while_routing_and_slowly_when_idle():
    engine = FakeMetrics()

    async def body(loads: EngineLoads) -> None:
        await asyncio.sleep(1.5)  # idle: one read a second
        t0 = time.monotonic()
        await asyncio.sleep(2.0)
        idle = engine.reads_between(t0, time.monotonic())
        assert 1 <= idle <= 3, idle
        # The first request after an idle spell wakes the poller at once ...
        loads.started("e0", 0)
        sent = time.monotonic()
        await asyncio.sleep(0.25)
        assert engine.reads_between(sent, sent + 0.25) >= 1
        # ... and while it is in flight the engine is read every busy interval.
        t0 = time.monotonic()
        await asyncio.sleep(1.0)
        busy = engine.reads_between(t0, time.monotonic())
        assert busy >= 5, busy  # ~20 at 0.05 s; the idle cadence (1 s) gives at most 2
        # Once it has ended and a full idle interval has passed: slow again.
        loads.finished("e0", 0)
        await asyncio.sleep(1.3)
        t0 = time.monotonic()
        await asyncio.sleep(2.0)
        assert engine.reads_between(t0, time.monotonic()) <= 3

    with ServerThread(engine.app) as srv:
        asyncio.run(_with_poller(engine, srv.url, body))


def test_another_replicas_requests_show_within_the_busy_interval():
    """While this gateway routes, a change in the engine's queue (another replica's
    requests) reaches its load figure within a fraction of the idle interval."""
    engine = FakeMetrics()

    async def body(loads: EngineLoads) -> None:
        loads.started("e0", 0)
        engine.waiting = 1  # the engine counts this gateway's request too
        await asyncio.sleep(0.3)
        for others in (3, 0, 5):
            engine.waiting = 1 + others
            changed = time.monotonic()
            while loads.load("e0").waiting != others:
                assert time.monotonic() - changed < 0.4, (others, loads.load("e0"))
                await asyncio.sleep(0.01)
        assert loads.load("e0").running == 1 and loads.load("e0").kv_usage == 0.25

    with ServerThread(engine.app) as srv:
        asyncio.run(_with_poller(engine, srv.url, body))


def test_a_slow_metrics_page_is_not_unreachable_at_the_fast_cadence():
    """The timeout of a poll is the idle interval's, not the busy one's: an engine that
    takes 0.3 s to answer its /metrics under load stays routable."""
    engine = FakeMetrics()
    engine.delay = 0.3

    async def body(loads: EngineLoads) -> None:
        loads.started("e0", 0)
        await asyncio.sleep(2.0)
        t = loads.of("e0")
        assert t.reachable and t.poll_failures == 0 and t.polled_at is not None

    with ServerThread(engine.app) as srv:
        asyncio.run(_with_poller(engine, srv.url, body, interval=1.0, busy_interval=0.05))


def test_without_a_busy_interval_one_cadence():
    engine = FakeMetrics()

    async def body(loads: EngineLoads) -> None:
        loads.started("e0", 0)
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await asyncio.sleep(1.5)
        assert engine.reads_between(t0, time.monotonic()) <= 4

    with ServerThread(engine.app) as srv:
        asyncio.run(_with_poller(engine, srv.url, body, interval=0.5, busy_interval=None))


def test_a_request_just_sent_is_not_taken_from_the_engines_count():
    """The engine's gauges show a request only once its front and scheduler took it in;
    until then a poll must not subtract it from the engine's total, else the others'
    requests would look fewer by as many as this gateway just sent."""
    engine = FakeMetrics()

    async def body() -> None:
        loads = EngineLoads()
        async with httpx.AsyncClient() as client:
            url = srv.url + "/metrics"
            engine.waiting = 3  # others' requests; ours not in the gauges yet
            loads.started("e0", 0)
            loads.started("e0", 0)
            assert await loads.poll(client, "e0", url, 1.0)
            assert loads.load("e0").waiting == 3 and loads.load("e0").running == 2
            await asyncio.sleep(SETTLE_S + 0.05)
            engine.waiting = 5  # now the engine counts ours too
            assert await loads.poll(client, "e0", url, 1.0)
            assert loads.load("e0").waiting == 3
            loads.finished("e0", 0)
            engine.waiting = 4
            assert await loads.poll(client, "e0", url, 1.0)
            assert loads.load("e0").waiting == 3 and loads.load("e0").running == 1

    with ServerThread(engine.app) as srv:
        asyncio.run(body())


def test_the_gauges_are_read_from_the_filtered_page_where_the_engine_has_one():
    """Like vLLM: ``/metrics`` renders every series (its instrumentator's route), while
    the Prometheus client's own app mounted under ``/metrics/`` honours ``name[]``. The
    poll asks for the three gauges there (a page a hundred times smaller); an engine
    without such a page is read whole, from the first poll on."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, make_asgi_app

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "w", ["engine"], registry=registry).labels("0").set(4)
    Gauge("vllm:num_requests_running", "r", ["engine"], registry=registry).labels("0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "k", ["engine"], registry=registry).labels("0").set(0.5)
    filler = Counter("vllm:other_total", "x", ["i"], registry=registry)
    for i in range(500):
        filler.labels(str(i)).inc()
    hits = {"whole": 0, "filtered": 0}

    async def whole(request):
        hits["whole"] += 1
        return PlainTextResponse(generate_latest(registry).decode())

    prometheus = make_asgi_app(registry)

    async def filtered(scope, receive, send):
        hits["filtered"] += 1
        await prometheus(scope, receive, send)

    vllm_like = Starlette(routes=[Route("/metrics", whole), Mount("/metrics", filtered)])
    plain = FakeMetrics()
    plain.waiting = 4

    async def body(url_vllm: str, url_plain: str) -> None:
        loads = EngineLoads()
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                assert await loads.poll(client, "vllm", url_vllm + "/metrics", 1.0)
                assert await loads.poll(client, "plain", url_plain + "/metrics", 1.0)
        assert loads.load("vllm").waiting == 6 and loads.load("vllm").kv_usage == 0.5
        assert loads.load("plain").waiting == 4 and loads.load("plain").kv_usage == 0.25
        assert hits == {"whole": 0, "filtered": 3}
        assert loads.of("vllm").filtered is True and loads.of("plain").filtered is False
        assert len(plain.reads) == 3  # the filtered page tried once, then the whole one

    with ServerThread(vllm_like) as a, ServerThread(plain.app) as b:
        asyncio.run(body(a.url, b.url))


def test_the_busy_interval_setting():
    assert load_settings(env={}).engine_poll_busy_interval_s == 1.0
    assert load_settings(env={}, engine_poll_busy_interval_s=0.25).engine_poll_busy_interval_s == 0.25
    assert load_settings(env={"KVEVENTS_ENGINE_POLL_BUSY_INTERVAL_S": "0.05"}
                         ).engine_poll_busy_interval_s == 0.05


def test_shares_follow_the_latest_requests_from_an_even_start():
    """A gateway's per-engine shares: even before any request (a prior of a full
    window, so its first requests do not swing them), each request weighing
    ``1 / SHARE_WINDOW``, older ones fading; an engine that joins starts at the others'
    mean."""
    loads = EngineLoads()
    assert loads.shares(["a", "b"]) == {"a": 0.5, "b": 0.5}
    loads.started("a", 0)
    first = loads.shares(["a", "b"])
    assert 0.5 < first["a"] < 0.52 and abs(sum(first.values()) - 1) < 1e-9
    for _ in range(SHARE_WINDOW * 8):  # long after: only the latest requests count
        loads.started("b", 0)
    assert loads.shares(["a", "b"])["b"] > 0.99
    for i in range(SHARE_WINDOW * 8):  # three in four to a
        loads.started("b" if i % 4 == 0 else "a", 0)
    assert 0.7 < loads.shares(["a", "b"])["a"] < 0.8
    joined = loads.shares(["a", "b", "c"])  # c is new: the mean of a and b
    assert abs(joined["c"] - 1 / 3) < 1e-9 and abs(sum(joined.values()) - 1) < 1e-9
    loads.finished("a", 0)  # finishing changes nothing: shares count requests sent
    assert loads.shares(["a", "b", "c"]) == joined
