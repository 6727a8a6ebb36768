"""Prometheus metrics of one engine process (prefix ``kvevents_engine_``).

Bound to a registry passed in; gauges and state-mirroring counters are read from the
live engine at scrape time, request outcomes are counted as results arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvevents.publisher import EventPublisher, PublisherStats
from kvevents.schema import BlockRemoved, BlockStored, KVEventBatch, medium_of

if TYPE_CHECKING:
    from kvevents.sim.engine import PagedEngine
    from kvevents.sim.request import RequestResult

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class CountingPublisher(EventPublisher):
    """Counts the blocks stored and removed per medium, then publishes through ``inner``.

    Removals are the tiers' evictions. Counting happens on the engine thread before the
    non-blocking hand-off, so it costs a loop over the batch's events, not its blocks.
    """

    def __init__(self, inner: EventPublisher) -> None:
        self.inner = inner
        self.stored: dict[str, int] = {}
        self.removed: dict[str, int] = {}

    def publish(self, batch: KVEventBatch) -> bool:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                m = medium_of(ev)
                self.stored[m] = self.stored.get(m, 0) + len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                m = medium_of(ev)
                self.removed[m] = self.removed.get(m, 0) + len(ev.block_hashes)
        return self.inner.publish(batch)

    def shutdown(self, timeout: float = 2.0) -> None:
        self.inner.shutdown(timeout)

    def stats(self) -> PublisherStats:
        return self.inner.stats()


class EngineMetrics:
    """The engine's metrics on ``registry``; call :meth:`observe` for each result."""

    def __init__(self, name: str, engine: PagedEngine, publisher: CountingPublisher,
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.requests = Counter("kvevents_engine_requests", "Requests finished", ["engine"],
                                registry=registry).labels(name)
        self.prompt_tokens = Counter("kvevents_engine_prompt_tokens", "Prompt tokens of finished requests",
                                     ["engine"], registry=registry).labels(name)
        hit = Counter("kvevents_engine_hit_tokens", "Prompt tokens served from a cache tier",
                      ["engine", "tier"], registry=registry)
        self.hit_gpu, self.hit_cpu = hit.labels(name, "GPU"), hit.labels(name, "CPU")
        self.computed = Counter("kvevents_engine_computed_prefill_tokens", "Prompt tokens computed",
                                ["engine"], registry=registry).labels(name)
        self.ttft = Histogram("kvevents_engine_ttft_seconds", "Simulated time to first token",
                              ["engine"], buckets=_TTFT_BUCKETS, registry=registry).labels(name)
        registry.register(_EngineState(name, engine, publisher))

    def observe(self, result: RequestResult) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(result.num_prompt_tokens)
        self.hit_gpu.inc(result.num_gpu_cached_tokens)
        self.hit_cpu.inc(result.num_cpu_loaded_tokens)
        self.computed.inc(result.num_computed_prompt_tokens)
        self.ttft.observe(result.ttft)


class _EngineState(Collector):
    def __init__(self, name: str, engine: PagedEngine, publisher: CountingPublisher) -> None:
        self._name, self._engine, self._pub = name, engine, publisher

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        e, n = self._engine, [self._name]
        off = e.offload_stats()
        nbytes = CounterMetricFamily("kvevents_engine_offload_bytes", "Bytes moved between tiers",
                                     labels=["engine", "direction"])
        secs = CounterMetricFamily("kvevents_engine_offload_seconds", "Seconds spent moving them",
                                   labels=["engine", "direction"])
        for direction, key in (("store", "stored"), ("load", "loaded")):
            nbytes.add_metric([self._name, direction], off.get(f"{key}_bytes", 0))
            secs.add_metric([self._name, direction], off.get(f"{key}_seconds", 0.0))
        yield nbytes
        yield secs
        if e.connector is not None:
            mgr = e.connector.scheduler.manager
            used = GaugeMetricFamily("kvevents_engine_cpu_pool_used_blocks",
                                     "CPU pool slots in use (offloaded chunks)", labels=["engine"])
            used.add_metric(n, mgr.num_used)
            cap = GaugeMetricFamily("kvevents_engine_cpu_pool_capacity_blocks",
                                    "CPU pool slots (offloaded chunks)", labels=["engine"])
            cap.add_metric(n, mgr.num_slots)
            yield used
            yield cap
        gpu_used = GaugeMetricFamily("kvevents_engine_gpu_blocks_used", "GPU blocks in use",
                                     labels=["engine"])
        gpu_used.add_metric(n, e.pool.num_used())
        gpu_total = GaugeMetricFamily("kvevents_engine_gpu_blocks_total", "GPU blocks",
                                      labels=["engine"])
        gpu_total.add_metric(n, e.pool.num_blocks)
        yield gpu_used
        yield gpu_total
        ev = CounterMetricFamily("kvevents_engine_evictions", "Blocks removed from a tier",
                                 labels=["engine", "tier"])
        for tier in ("GPU", "CPU"):
            ev.add_metric([self._name, tier], self._pub.removed.get(tier, 0))
        yield ev
        ps = self._pub.stats()
        pub = CounterMetricFamily("kvevents_engine_published_batches", "KV event batches published",
                                  labels=["engine"])
        pub.add_metric(n, ps.published)
        drop = CounterMetricFamily("kvevents_engine_publish_dropped",
                                   "Batches dropped because the publish queue was full",
                                   labels=["engine"])
        drop.add_metric(n, ps.dropped)
        yield pub
        yield drop
        load = e.load()
        for metric, key, doc in (("waiting_requests", "waiting", "Requests waiting"),
                                 ("running_requests", "running", "Requests running"),
                                 ("kv_usage_ratio", "kv_usage", "Fraction of GPU blocks in use")):
            g = GaugeMetricFamily(f"kvevents_engine_{metric}", doc, labels=["engine"])
            g.add_metric(n, load[key])
            yield g
