"""The live page in a real headless Chromium, on a real aggregator following real publishers
(and, for its gateway section, simulated engine processes with their OpenAI front).

Chromium is driven over the DevTools protocol (see tests/browser.py). The test waits on the page's own DOM, reads it back, and saves a screenshot
under ``artifacts/`` for a human to look at.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from browser import READ_PAGE, Browser
from support import LossyForwarder, ServerThread, free_port, require_binary, wait_until
from test_dashboard import SimOpenAIEngine
from kvevents.api import create_app
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
BS = 16
SHARED = list(range(1, 65))  # a 4-block system prompt every engine caches
class Engine:
    """A real publisher acting as an engine: a shared system prompt on the GPU, its own
    conversation blocks moving GPU -> CPU, old ones evicted."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.live, self.replay = free_port(), free_port()
        self.pub = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://*:{self.live}", replay_endpoint=f"tcp://*:{self.replay}"))
        self.step = 0

    def publish_step(self) -> None:
        i, k = self.index, self.step
        events: list = []
        if k == 0:
            events.append(BlockStored([1, 2, 3, 4], None, SHARED, BS, None, "GPU", None))
        base = 1000 * (i + 1) + 10 * k
        own = [10_000 * (i + 1) + 100 * k + t for t in range(2 * BS)]
        events.append(BlockStored([base, base + 1], 4, own, BS, None, "GPU", None))
        if k == 1:  # the offloading connector keeps a CPU copy of the system prompt
            events.append(BlockStored([1, 2, 3, 4], None, SHARED, BS, None, "CPU", None))
        if k >= 1:  # last step's blocks are offloaded to CPU and leave the GPU
            prev = 1000 * (i + 1) + 10 * (k - 1)
            prev_own = [10_000 * (i + 1) + 100 * (k - 1) + t for t in range(2 * BS)]
            events.append(BlockStored([prev, prev + 1], 4, prev_own, BS, None, "CPU", None))
            events.append(BlockRemoved([prev, prev + 1], "GPU"))
        if k >= 8 + i:  # the CPU pool is full: evict the oldest
            old = 1000 * (i + 1) + 10 * (k - 8 - i)
            events.append(BlockRemoved([old, old + 1], "CPU"))
        self.pub.publish(KVEventBatch(time.time(), events))
        self.step += 1

    def close(self) -> None:
        self.pub.shutdown(0.5)


@pytest.fixture
def fleet():
    """Three engines; engine-1's live feed loses seq 2 on the way (recovered by replay)."""
    engines = [Engine(i) for i in range(3)]
    fwd = LossyForwarder(f"tcp://127.0.0.1:{engines[1].live}", drop={2})
    specs = tuple(
        EngineSpec(f"engine-{e.index}",
                   fwd.endpoint if e.index == 1 else f"tcp://127.0.0.1:{e.live}",
                   replay_endpoint=f"tcp://127.0.0.1:{e.replay}", model="demo")
        for e in engines)
    with ServerThread(create_app(AggregatorSettings(engines=specs))) as srv:
        yield srv, engines
    fwd.close()
    for e in engines:
        e.close()




@pytest.mark.timeout(60)
def test_live_page_shows_the_fleet_in_a_real_browser(fleet, tmp_path):
    binary = require_binary("chromium")
    srv, engines = fleet
    browser = Browser(binary, f"{srv.url}/", tmp_path / "profile")
    stop = threading.Event()
    feeder = None
    try:
        tools = browser.tools
        # The page is subscribed once its first summary has arrived: then start the
        # engines, so the page sees their gap and replay live.
        summaries = "Number(document.body?.dataset.summaries)"
        assert wait_until(lambda: (tools.evaluate(summaries) or 0) >= 1, 15, 0.1)

        def feed() -> None:
            while not stop.is_set():
                for e in engines:
                    e.publish_step()
                stop.wait(0.1)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        # Routers' lookups: the shared prompt (GPU and CPU everywhere) plus engine-0's
        # step-1 conversation, whose blocks now sit in its CPU tier only.
        assert wait_until(lambda: engines[0].step >= 3, 10)
        prompt = SHARED + [10_000 + 100 + t for t in range(2 * BS)]
        for _ in range(3):
            r = httpx.post(f"{srv.url}/v1/lookup", json={"token_ids": prompt}, timeout=5)
            assert r.status_code == 200 and r.json()["engines"], r.text

        def settled() -> bool:
            page = tools.evaluate(READ_PAGE)
            return (page["summaries"] >= 4 and len(page["rows"]) == 3
                    and all(r["tiers"].get("GPU", 0) > 0 and r["tiers"].get("CPU", 0) > 0
                            for r in page["rows"])
                    and page["blocks_per_s"] > 0 and page["batches_per_s"] > 0
                    and page["lookups"] >= 3 and len(page["prefixes"]) > 0
                    and any(kind == "replay" for kind, _ in page["log"]))

        assert wait_until(settled, 20, 0.25), tools.evaluate(READ_PAGE)
        ARTIFACTS.mkdir(exist_ok=True)
        browser.screenshot(ARTIFACTS / "live_page.png")
        page = tools.evaluate(READ_PAGE)
    finally:
        stop.set()
        if feeder is not None:
            feeder.join(5)
        browser.close()
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)

    assert page["conn"] == "open"
    by_engine = {r["engine"]: r for r in page["rows"]}
    assert sorted(by_engine) == ["engine-0", "engine-1", "engine-2"]
    api = {p["name"]: p for p in httpx.get(f"{srv.url}/v1/engines").json()["engines"]}
    for name, row in by_engine.items():
        assert row["status"] == "live" and row["connected"] == "1", row
        assert int(row["last_seq"]) > 0 and row["lag"] != "", row
        assert row["tiers"]["GPU"] > 0 and row["tiers"]["CPU"] > 0, row
        assert name in row["text"]
        # The page's figures are the aggregator's (the feed keeps going, so within a few).
        assert abs(int(row["last_seq"]) - api[name]["last_seq"]) <= 30
        assert row["lost"] == 0 and row["restarts"] == 0
    # engine-1 lost seq 2 on the wire: the page shows the gap and the replay.
    assert by_engine["engine-1"]["gaps"] >= 1 and by_engine["engine-1"]["replayed"] >= 1
    assert by_engine["engine-0"]["gaps"] == 0
    kinds = {kind for kind, _ in page["log"]}
    assert {"gap", "replay"} <= kinds, page["log"]
    assert any("engine-1" in text for kind, text in page["log"] if kind == "gap")

    assert page["blocks_per_s"] > 0 and page["batches_per_s"] > 0
    assert page["entries"] > 0 and page["distinct"] > 0
    # Every lookup matched the shared prompt on the GPU and, on the CPU, the prompt and
    # (unless evicted by then) engine-0's conversation.
    assert page["hit"]["GPU"] == pytest.approx(len(SHARED) / len(prompt), abs=1e-3)
    assert page["hit"]["GPU"] <= page["hit"]["CPU"] <= page["hit"]["any"] <= 1
    # The shared system prompt lives on every engine: the top prefix says so.
    assert page["prefixes"][0]["engines"] == ["engine-0", "engine-1", "engine-2"]
    assert page["prefixes"][0]["tokens"] == len(SHARED)
    assert (ARTIFACTS / "live_page.png").stat().st_size > 10_000


READ_GATEWAY = """(() => {
  const section = document.querySelector('#gateway-section');
  return {
    shown: !section.hidden, routes_seen: Number(section.dataset.routes),
    engines: [...document.querySelectorAll('#gateway tbody tr[data-engine]')].map((tr) => {
      const f = (n) => tr.querySelector(`[data-field="${n}"]`).dataset.value;
      return {engine: tr.dataset.engine, reachable: tr.dataset.reachable === '1', role: tr.dataset.role,
              inflight: Number(f('inflight')), kv_usage: Number(f('kv_usage')),
              last_error: f('last_error'), accuracy: f('accuracy'), text: tr.innerText};
    }),
    routes: [...document.querySelectorAll('#routes tbody tr[data-route]')].map((tr) => ({
      engine: tr.dataset.engine, matched: Number(tr.dataset.matched),
      prompt: tr.dataset.prompt === '' ? null : Number(tr.dataset.prompt),
      reason: tr.querySelector('.reason').title, text: tr.innerText})),
  };
})()"""


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


@pytest.mark.timeout(150)
def test_live_page_shows_the_gateway(tmp_path):
    """Two simulated engine processes with their OpenAI front behind a real aggregator,
    and a third engine whose server is down; real requests through the gateway. The
    page shows each engine's gateway state and the routing decisions from the feed."""
    binary = require_binary("chromium")
    # Streams paced at 10 ms a chunk: the answer held open below lasts 30 s on any machine
    # (the simulated engine computes a whole answer before its first chunk, so a long one
    # unpaced took a slow machine past the client's timeout).
    sims = [SimOpenAIEngine("sim", tmp_path / f"engine-{i}.log", token_interval=0.01) for i in range(2)]
    # (a decode engine, for the page's role; without prefill engines it is any engine)
    dead = EngineSpec("engine-2", f"tcp://127.0.0.1:{free_port()}", model="sim",
                      http=f"http://127.0.0.1:{free_port()}", role="decode")
    settings = AggregatorSettings(engines=(sims[0].spec("engine-0"), sims[1].spec("engine-1"), dead))
    try:
        with ServerThread(create_app(settings)) as srv:
            for s in sims:
                s.wait_ready()

            def gateway() -> dict[str, dict]:
                return {e["name"]: e["gateway"] for e in httpx.get(f"{srv.url}/v1/engines").json()["engines"]}

            assert wait_until(lambda: [g["reachable"] for _, g in sorted(gateway().items())]
                              == [True, True, False], 20, 0.1), gateway()
            # (closed before the server: its feed stream would hold the server's shutdown)
            browser = Browser(binary, f"{srv.url}/", tmp_path / "profile")
            try:
                page, busy, sent = _drive_gateway(srv.url, browser)
            finally:
                browser.close()
                shutil.rmtree(tmp_path / "profile", ignore_errors=True)
            api = gateway()
    finally:
        for s in sims:
            s.close()

    assert page["shown"] and page["routes_seen"] == 7
    rows = {e["engine"]: e for e in page["engines"]}
    assert sorted(rows) == ["engine-0", "engine-1", "engine-2"]
    assert rows["engine-0"]["reachable"] and rows["engine-1"]["reachable"]
    assert not rows["engine-2"]["reachable"] and "unreachable" in rows["engine-2"]["text"]
    assert rows["engine-2"]["role"] == "decode" and "decode" in rows["engine-2"]["text"]
    assert rows["engine-0"]["role"] == "both" and "both" not in rows["engine-0"]["text"]
    assert rows["engine-2"]["last_error"] == api["engine-2"]["last_error"] != ""
    assert all(rows[n]["inflight"] == (1 if n == busy else 0) for n in ("engine-0", "engine-1"))
    # Routing accuracy per engine: what the engines reported over what the index predicted.
    for n in ("engine-0", "engine-1"):
        g = api[n]
        want = f"{g['reported_cached_tokens'] / g['predicted_cached_tokens']:.4f}" if g["predicted_cached_tokens"] else ""
        assert rows[n]["accuracy"] == want, (n, g, rows[n])
    assert sum(api[n]["predicted_cached_tokens"] for n in ("engine-0", "engine-1")) >= 3 * 64
    # Newest first: the held stream, then the second round, then the first (from the feed).
    routes = page["routes"][::-1]
    assert [r["engine"] for r in routes] == sent + [busy]
    assert [r["prompt"] for r in routes] == [80, 80, 80, 96, 96, 96, 64]
    assert [r["matched"] for r in routes[:3]] == [0, 0, 0]
    assert all(r["matched"] >= 64 for r in routes[3:6]), routes  # 80 of 96 cached: whole blocks
    assert all(r["reason"] and r["reason"] in r["text"] for r in routes)
    assert "session" in routes[5]["text"] and "chat-7" in routes[5]["text"]
    assert "96" in routes[3]["text"] and str(routes[3]["matched"]) in routes[3]["text"]


def _drive_gateway(url: str, browser: Browser) -> tuple[dict, str, list[str]]:
    """Requests through the gateway while the page watches; returns what the page shows
    with a long streamed answer still in flight, that answer's engine, and the engines
    that answered the requests before it."""
    tools = browser.tools
    assert wait_until(lambda: (tools.evaluate("Number(document.body?.dataset.summaries)") or 0) >= 1, 15, 0.1)
    # New prompts, then the same prompts again (back to their engine, with the cached
    # prefix predicted), one in a session.
    sent = []
    for round_ in range(2):
        for i in range(3):
            r = httpx.post(f"{url}/v1/completions", timeout=30,
                           headers={"x-session-id": "chat-7"} if i == 2 else {},
                           json={"model": "sim", "prompt": _prompt(i, 80 + 16 * round_), "max_tokens": 4})
            assert r.status_code == 200, r.text
            sent.append(r.headers["x-kvevents-engine"])
        if round_ == 0:  # the index learns the engines' blocks from their events
            assert wait_until(lambda: httpx.post(f"{url}/v1/lookup", json={
                "token_ids": _prompt(0, 80), "model": "sim"}).json()["engines"], 10)
    assert set(sent) <= {"engine-0", "engine-1"} and sent[3:] == sent[:3]

    # A long streamed answer held open (3,000 chunks 10 ms apart): the page shows it in flight.
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{url}/v1/completions", json={
            "model": "sim", "prompt": _prompt(9, 64), "max_tokens": 3000, "stream": True}) as held:
        assert held.status_code == 200
        raw = held.iter_raw()  # kept: a dropped iterator closes the stream (the client leaves)
        next(raw)
        busy = held.headers["x-kvevents-engine"]

        def in_flight() -> bool:
            page = tools.evaluate(READ_GATEWAY)
            return page["routes_seen"] >= 7 and any(
                e["engine"] == busy and e["inflight"] == 1 for e in page["engines"])

        assert wait_until(in_flight, 10, 0.1), tools.evaluate(READ_GATEWAY)
        ARTIFACTS.mkdir(exist_ok=True)
        browser.screenshot(ARTIFACTS / "live_page_gateway.png")
        return tools.evaluate(READ_GATEWAY), busy, sent
