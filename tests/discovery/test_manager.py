"""The discovery manager on a real aggregator fed by real publishers: engines followed as
a source lists them, unroutable at once when it stops, dropped after the grace period,
back with their state within it, rebuilt (never merged) when they return as something
else; readiness waits for the first round and gives up on dead engines in bounded time.

The source here is a real :class:`~kvevents.discovery.source.Source` whose listing the
test sets (the DNS and Kubernetes sources are tested against a real DNS server and a
list/watch server in their own modules, and end to end in test_discovery_dns_e2e.py).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import free_port, wait_until  # noqa: E402

from kvevents.discovery import Discovery, Source  # noqa: E402
from kvevents.engines import EngineSpec  # noqa: E402
from kvevents.routing import Router  # noqa: E402
from kvevents.service.aggregator import Aggregator  # noqa: E402
from kvevents.service.settings import AggregatorSettings  # noqa: E402
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher  # noqa: E402
from kvevents.wire.schema import BlockStored, KVEventBatch  # noqa: E402

TOKS = list(range(32))


class Listing(Source):
    """Lists what the test sets, every 50 ms (a DNS source's rhythm, faster)."""

    def __init__(self, origin: str = "test:fleet") -> None:
        super().__init__()
        self.origin = origin
        self.specs: list[EngineSpec] | None = None  # None: the source is failing
        self.lock = threading.Lock()

    def set(self, specs: list[EngineSpec] | None) -> None:
        with self.lock:
            self.specs = specs

    def run(self, emit, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.lock:
                specs = self.specs
            if specs is None:
                self.status.failed("no answer")
            else:
                emit(list(specs))
                self.status.succeeded(len(specs))
            stop.wait(0.05)


class Engine:
    """A real publisher bound on 127.0.0.1 (live + replay) and its spec."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.live, self.replay = free_port(), free_port()
        self.pub = self._start()

    def _start(self) -> ZmqEventPublisher:
        return ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://127.0.0.1:{self.live}", replay_endpoint=f"tcp://127.0.0.1:{self.replay}",
            bind=True))

    def restart(self) -> None:
        """A new process behind the same address: seq starts over."""
        self.pub.shutdown(0.5)
        deadline = time.monotonic() + 5
        while True:
            try:
                self.pub = self._start()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(self.name, f"tcp://127.0.0.1:{self.live}",
                          replay_endpoint=f"tcp://127.0.0.1:{self.replay}")

    def store(self, h: int, parent: int | None, toks: list[int]) -> None:
        self.pub.publish(KVEventBatch(time.time(), [BlockStored([h], parent, toks, 16, None, "GPU", None)]))


@pytest.fixture
def fleet():
    engines = {n: Engine(n) for n in ("e0", "e1", "e2")}
    yield engines
    for e in engines.values():
        e.pub.shutdown(0.5)


def _holders(agg: Aggregator) -> set[str]:
    return {m.engine for m in agg.lookup(TOKS).engines}


@pytest.mark.timeout(60)
def test_engines_follow_the_listing_with_a_grace_period(fleet):
    agg = Aggregator(AggregatorSettings(recovery_timeout_s=30))
    src = Listing()
    disc = Discovery(agg, [src], grace_s=1.5)
    agg.start()
    disc.start()
    router = Router(agg)
    try:
        assert not disc.readiness()["ready"] or src.status.first_round_done
        # Appears in the source: followed (subscribed, first replay done) within 2 s.
        t0 = time.monotonic()
        src.set([fleet["e0"].spec, fleet["e1"].spec])
        assert wait_until(lambda: agg.readiness()["ready"] and len(agg.engines) == 2, 5)
        assert time.monotonic() - t0 < 2.0
        assert disc.readiness() == {"ready": True, "waiting_sources": []}
        for e in ("e0", "e1"):
            fleet[e].store(1, None, TOKS[:16])
        assert wait_until(lambda: _holders(agg) == {"e0", "e1"}, 5)

        # e1 vanishes from the source: not routable within 1 s, its state kept.
        t0 = time.monotonic()
        src.set([fleet["e0"].spec])
        assert wait_until(lambda: "e1" in agg.unroutable_engines(), 1.0)
        assert time.monotonic() - t0 < 1.0
        assert agg.leaving_engines() == {"e1"}
        assert _holders(agg) == {"e0", "e1"}  # still in the index during the grace period
        decision = asyncio.run(router.decide(TOKS))
        assert decision.engine == "e0"
        statuses = {e["name"]: e for e in agg.engine_statuses()}
        assert statuses["e1"]["leaving_since"] is not None and not statuses["e1"]["routable"]
        assert statuses["e1"]["origin"] == "test:fleet"

        # Back within the grace period: routable again, nothing lost, never re-added.
        added = disc.added
        src.set([fleet["e0"].spec, fleet["e1"].spec])
        assert wait_until(lambda: not agg.unroutable_engines(), 1.0)
        assert _holders(agg) == {"e0", "e1"} and disc.added == added

        # Gone for good: state and metric series dropped after the grace period.
        src.set([fleet["e0"].spec])
        assert wait_until(lambda: "e1" in agg.leaving_engines(), 1.0)
        t_gone = time.monotonic()
        assert wait_until(lambda: "e1" not in agg.engines.names(), 4.0)
        assert time.monotonic() - t_gone >= 1.4  # not before the grace period
        assert _holders(agg) == {"e0"}
        from prometheus_client import generate_latest
        assert b'engine="e1"' not in generate_latest(agg.registry)
        status = disc.status()[0]
        assert status["engines"] == ["e0"] and status["leaving"] == [] and status["running"]
    finally:
        disc.stop()
        agg.stop()


@pytest.mark.timeout(60)
def test_returning_as_something_else_is_rebuilt_never_merged(fleet):
    agg = Aggregator(AggregatorSettings())
    src = Listing()
    disc = Discovery(agg, [src], grace_s=30)
    agg.start()
    disc.start()
    try:
        e0 = fleet["e0"]
        src.set([e0.spec])
        assert wait_until(lambda: agg.readiness()["ready"] and len(agg.engines) == 1, 5)
        e0.store(1, None, TOKS[:16])
        assert wait_until(lambda: _holders(agg) == {"e0"}, 5)

        # The same name at a new address (a pod rescheduled): its old blocks are dropped.
        moved = Engine("e0")
        try:
            src.set([moved.spec])
            assert wait_until(lambda: agg.engines.get("e0").spec == moved.spec, 2)
            assert wait_until(lambda: not _holders(agg), 2)
            moved.store(7, None, TOKS[:16])
            assert wait_until(lambda: _holders(agg) == {"e0"}, 5)
        finally:
            moved.pub.shutdown(0.5)

        # A new process at the same address (seq starts over): caught by continuity and
        # rebuilt from the new process's stream, not merged with the old blocks.
        e1 = fleet["e1"]
        src.set([e1.spec])
        assert wait_until(lambda: "e1" in agg.engines.names() and agg.readiness()["ready"], 5)
        for i in range(5):
            e1.store(100 + i, None, [1000 + i] * 16)
        assert wait_until(lambda: agg.index.engine_block_counts("e1").get("GPU", 0) == 5, 5)
        e1.restart()
        e1.store(500, None, TOKS[:16])
        assert wait_until(lambda: agg.index.engine_block_counts("e1").get("GPU", 0) == 1, 10), \
            agg.index.engine_block_counts("e1")
        assert agg.source_stats()["e1"].restarts >= 1
    finally:
        disc.stop()
        agg.stop()


@pytest.mark.timeout(60)
def test_readiness_waits_for_discovery_and_gives_up_on_dead_engines_in_bounded_time(fleet):
    agg = Aggregator(AggregatorSettings(recovery_timeout_s=1.0))
    src = Listing()
    disc = Discovery(agg, [src], grace_s=30, first_round_timeout_s=1.0)
    agg.start()
    disc.start()
    try:
        # The source does not answer: not ready, until its first round is given up on.
        src.set(None)
        time.sleep(0.3)
        assert disc.readiness() == {"ready": False, "waiting_sources": ["test:fleet"]}
        assert wait_until(lambda: disc.readiness()["ready"], 2.0)
        assert disc.sources_given_up == 1 and disc.status()[0]["errors"] > 0

        # A listed engine whose publisher is dead (a closed port): readiness waits for
        # it at most recovery_timeout_s, then lists it as given up and counts it.
        dead = EngineSpec("dead", f"tcp://127.0.0.1:{free_port()}",
                          replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
        src.set([fleet["e0"].spec, dead])
        assert wait_until(lambda: len(agg.engines) == 2, 2)
        assert wait_until(lambda: agg.readiness()["waiting"] == ["dead"], 1.0)
        assert not agg.readiness()["ready"]
        t0 = time.monotonic()
        assert wait_until(lambda: agg.readiness()["ready"], 3.0)
        assert time.monotonic() - t0 < 2.0
        assert agg.readiness()["given_up"] == ["dead"]
        assert agg.recovery_given_up == 1
        assert {e["name"]: e["recovery_given_up"] for e in agg.engine_statuses()}["dead"]
        from prometheus_client import generate_latest
        assert b"kvevents_recovery_given_up_total 1.0" in generate_latest(agg.registry)
    finally:
        disc.stop()
        agg.stop()


@pytest.mark.timeout(60)
def test_discovered_engines_survive_a_snapshot_under_their_origin(fleet, tmp_path):
    e0, e1 = fleet["e0"], fleet["e1"]
    settings = AggregatorSettings(data_dir=str(tmp_path))
    agg = Aggregator(settings)
    src = Listing()
    disc = Discovery(agg, [src], grace_s=0.5)
    agg.start()
    disc.start()
    try:
        src.set([e0.spec, e1.spec])
        assert wait_until(lambda: agg.readiness()["ready"] and len(agg.engines) == 2, 5)
        e0.store(1, None, TOKS[:16])
        e1.store(1, None, TOKS[:16])
        assert wait_until(lambda: _holders(agg) == {"e0", "e1"}, 5)
    finally:
        disc.stop()
        agg.stop()  # writes the final snapshot

    # Restarted: the engines come back under the source's origin, so the source's next
    # listing (without e1) lets e1 go after the grace period instead of keeping it forever.
    agg = Aggregator(settings)
    assert {s.spec.name: s.origin for s in agg.engines.states()} == {"e0": "test:fleet",
                                                                     "e1": "test:fleet"}
    src = Listing()
    disc = Discovery(agg, [src], grace_s=0.5)
    agg.start()
    disc.start()
    try:
        assert wait_until(lambda: _holders(agg) == {"e0", "e1"}, 5)
        src.set([e0.spec])
        assert wait_until(lambda: agg.leaving_engines() == {"e1"}, 1)
        assert wait_until(lambda: agg.engines.names() == ["e0"], 3)
        assert _holders(agg) == {"e0"}
    finally:
        disc.stop()
        agg.stop()


def test_two_sources_must_differ():
    agg = Aggregator(AggregatorSettings())
    with pytest.raises(ValueError, match="differ"):
        Discovery(agg, [Listing("x"), Listing("x")])
