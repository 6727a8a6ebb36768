"""Prometheus metrics of one simulated engine process, named and labelled as vLLM's.

What vLLM has is exported under vLLM's own name, type and labels (``model_name``,
``engine``; vLLM's ``vllm/v1/metrics/loggers.py``), so one dashboard serves this demo
and a real vLLM fleet. What only this engine has (its CPU tier's pool and transfers,
its event publisher) is ``kvevents_sim_*`` with the same two labels. Bound to a
registry passed in; gauges and state-mirroring counters are read from the live engine
at scrape time, request outcomes are counted as results arrive.

=============================================  =============================================
vllm:num_requests_running / _waiting           gauges: requests running / queued
vllm:kv_cache_usage_perc                       gauge: fraction of GPU blocks in use (0..1)
vllm:prefix_cache_queries_total / _hits_total  GPU prefix cache, in prompt tokens
vllm:external_prefix_cache_queries_total /     the KV connector (CPU tier), in prompt tokens
  vllm:external_prefix_cache_hits_total
vllm:prompt_tokens_total                       prompt tokens of finished requests
vllm:prompt_tokens_by_source_total             {source=local_compute|local_cache_hit|
                                                 external_kv_transfer}
vllm:prompt_tokens_cached_total                local + external cache hits
vllm:generation_tokens_total                   generated tokens
vllm:request_success_total                     finished requests {finished_reason}
vllm:time_to_first_token_seconds               histogram (vLLM's buckets)
vllm:e2e_request_latency_seconds               histogram (vLLM's buckets)
kvevents_sim_offload_bytes_total /             bytes and seconds moved between tiers
  kvevents_sim_offload_seconds_total             {direction=store|load}
kvevents_sim_cpu_pool_used_blocks / _capacity_blocks    CPU tier slots
kvevents_sim_gpu_blocks_used, kvevents_sim_gpu_capacity_blocks  GPU blocks
kvevents_sim_evictions_total                   blocks removed from a tier {tier}
kvevents_sim_published_batches_total /         KV event batches published / dropped
  kvevents_sim_publish_dropped_total
=============================================  =============================================

Times are the simulation's; tokens are real counts of the requests served.

Serve them with :func:`serve_metrics`, not ``prometheus_client.start_http_server``:
asked for OpenMetrics (as Prometheus asks), prometheus_client 0.2x rewrites the ``:``
of ``vllm:*`` sample names to ``_``, and the dashboard's vLLM queries would find
nothing. :func:`serve_metrics` always answers the classic text format, which keeps
the names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvevents.wire.publisher import EventPublisher, PublisherStats
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch, medium_of

if TYPE_CHECKING:
    from kvevents.sim.engine import PagedEngine
    from kvevents.sim.request import RequestResult

LABELS = ["model_name", "engine"]  # vLLM's order
# vLLM's buckets, so quantiles compare across the demo and a real fleet.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class CountingPublisher(EventPublisher):
    """Counts the blocks stored and removed per tier, then publishes through ``inner``.

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
                tier = medium_of(ev)  # the wire field names the tier
                self.stored[tier] = self.stored.get(tier, 0) + len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                tier = medium_of(ev)
                self.removed[tier] = self.removed.get(tier, 0) + len(ev.block_hashes)
        return self.inner.publish(batch)

    def shutdown(self, timeout: float = 2.0) -> None:
        self.inner.shutdown(timeout)

    def stats(self) -> PublisherStats:
        return self.inner.stats()


class EngineMetrics:
    """The engine's metrics on ``registry``; call :meth:`observe` for each result.

    ``name`` is the ``engine`` label, ``model_name`` the served model's name ("" when
    the engine is not given one).
    """

    def __init__(self, name: str, engine: PagedEngine, publisher: CountingPublisher,
                 registry: CollectorRegistry, model_name: str = "") -> None:
        self.name = name
        lv = (model_name, name)

        def counter(metric: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(metric, doc, [*LABELS, *extra], registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests"
                                     ).labels(*lv)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Tokens generated").labels(*lv)
        by_source = counter("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from",
                            ("source",))
        self.computed = by_source.labels(*lv, "local_compute")
        self.local_hit = by_source.labels(*lv, "local_cache_hit")
        self.external_hit = by_source.labels(*lv, "external_kv_transfer")
        self.cached = counter("vllm:prompt_tokens_cached",
                              "Prompt tokens served from the GPU cache or the CPU tier").labels(*lv)
        self.pc_queries = counter("vllm:prefix_cache_queries",
                                  "Prompt tokens looked up in the GPU prefix cache"
                                  ).labels(*lv)
        self.pc_hits = counter("vllm:prefix_cache_hits",
                               "Prompt tokens found in the GPU prefix cache").labels(*lv)
        self.ext_queries = counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the CPU tier (the KV connector)").labels(*lv)
        self.ext_hits = counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens loaded from the CPU tier (the KV connector)").labels(*lv)
        # The simulated engine finishes a request when it reaches its output length.
        self.success = counter("vllm:request_success", "Requests finished",
                               ("finished_reason",)).labels(*lv, "length")
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Simulated time from arrival to the first token", LABELS,
                              buckets=_TTFT_BUCKETS, registry=registry).labels(*lv)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Simulated time from arrival to the last token", LABELS,
                             buckets=_E2E_BUCKETS, registry=registry).labels(*lv)
        registry.register(_EngineState(lv, engine, publisher))

    def observe(self, result: RequestResult) -> None:
        prompt = result.num_prompt_tokens
        gpu, cpu = result.num_gpu_cached_tokens, result.num_cpu_loaded_tokens
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(result.num_output_tokens)
        self.computed.inc(result.num_computed_prompt_tokens)
        self.local_hit.inc(gpu)
        self.external_hit.inc(cpu)
        self.cached.inc(gpu + cpu)
        self.pc_queries.inc(prompt)
        self.pc_hits.inc(gpu)
        self.ext_queries.inc(prompt)
        self.ext_hits.inc(cpu)
        self.success.inc()
        self.ttft.observe(result.ttft)
        self.e2e.observe(result.finish_time - result.arrival_time)


class _EngineState(Collector):
    def __init__(self, labels: tuple[str, str], engine: PagedEngine,
                 publisher: CountingPublisher) -> None:
        self._lv, self._engine, self._pub = list(labels), engine, publisher

    def describe(self) -> list[Metric]:
        return []

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self._lv, value)
        return g

    def collect(self) -> Iterator[Metric]:
        e, lv = self._engine, self._lv
        load = e.load()
        yield self._gauge("vllm:num_requests_running",
                          "Requests being executed", load["running"])
        yield self._gauge("vllm:num_requests_waiting",
                          "Requests queued or loading KV from the CPU tier", load["waiting"])
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "Fraction of GPU KV blocks in use (1 = full)", load["kv_usage"])

        off = e.offload_stats()
        nbytes = CounterMetricFamily("kvevents_sim_offload_bytes", "Bytes moved between tiers",
                                     labels=[*LABELS, "direction"])
        secs = CounterMetricFamily("kvevents_sim_offload_seconds", "Seconds spent moving them",
                                   labels=[*LABELS, "direction"])
        for direction, key in (("store", "stored"), ("load", "loaded")):
            nbytes.add_metric([*lv, direction], off.get(f"{key}_bytes", 0))
            secs.add_metric([*lv, direction], off.get(f"{key}_seconds", 0.0))
        yield nbytes
        yield secs
        if e.connector is not None:
            mgr = e.connector.planner.manager
            yield self._gauge("kvevents_sim_cpu_pool_used_blocks",
                              "CPU pool slots in use (offloaded chunks)", mgr.num_used)
            yield self._gauge("kvevents_sim_cpu_pool_capacity_blocks",
                              "CPU pool slots (offloaded chunks)", mgr.num_slots)
        yield self._gauge("kvevents_sim_gpu_blocks_used", "GPU blocks in use", e.pool.num_used())
        yield self._gauge("kvevents_sim_gpu_capacity_blocks", "GPU blocks", e.pool.num_blocks)
        ev = CounterMetricFamily("kvevents_sim_evictions", "Blocks removed from a tier",
                                 labels=[*LABELS, "tier"])
        for tier in ("GPU", "CPU"):
            ev.add_metric([*lv, tier], self._pub.removed.get(tier, 0))
        yield ev
        ps = self._pub.stats()
        pub = CounterMetricFamily("kvevents_sim_published_batches", "KV event batches published",
                                  labels=LABELS)
        pub.add_metric(lv, ps.published)
        drop = CounterMetricFamily("kvevents_sim_publish_dropped",
                                   "Batches dropped because the publish queue was full",
                                   labels=LABELS)
        drop.add_metric(lv, ps.dropped)
        yield pub
        yield drop


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per scrape would drown the engine's log


def serve_metrics(port: int, addr: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` in the classic text format
    (whatever the client accepts) from a daemon thread; ``shutdown()`` stops it.
    Raises ``OSError`` when the port is taken."""
    app = make_wsgi_app(registry)

    def text_format(environ: dict, start_response: Any) -> Any:
        environ = {k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}
        return app(environ, start_response)

    httpd = make_server(addr, port, text_format, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="engine-metrics", daemon=True).start()
    return httpd
