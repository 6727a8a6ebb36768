"""Every /metrics is promtool-clean, Kubernetes-safe, and follows the live fleet.

* The aggregator's and a simulated engine's exposition pass ``promtool check metrics``
  (Debian ``prometheus`` package; skipped locally when absent, a failure under CI).
  One lint is waived, and only for ``vllm:*`` names: promtool reserves ``:`` for
  recording rules, and vLLM's own metric names have it (a real vLLM's /metrics draws the
  same lint); dashboards must use those names to serve a vLLM fleet.
* No series carries a ``pod`` label (Kubernetes service discovery adds its own and
  would rename ours ``exported_pod``); per-engine series carry ``engine`` and
  ``model_name``.
* Removing an engine removes its series at the next scrape.
* The simulated engine exports vLLM's names, types and labels (transcribed below from
  vLLM's ``vllm/v1/metrics/loggers.py``), with values that add up.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from support import ServerThread, free_port, require_binary, wait_until
from kvevents.api import create_app
from kvevents.wire.publisher import NullEventPublisher, PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

# vLLM's metrics the simulated engine has too: name -> (type, extra labels beyond
# model_name and engine).
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:external_prefix_cache_queries": ("counter", ()),
    "vllm:external_prefix_cache_hits": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
}


_COLON_LINT = re.compile(r"^vllm:[a-zA-Z0-9_]+ metric names should not contain ':'$")


# Labels Kubernetes service discovery and the Prometheus operator put on every target.
TARGET_LABELS = {"pod", "namespace", "service", "container", "endpoint", "instance", "job", "node"}


def promtool_check(text: str, waive_vllm_colons: bool = False) -> None:
    binary = require_binary("promtool")
    r = subprocess.run([binary, "check", "metrics"], input=text, capture_output=True, text=True,
                       timeout=30)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    if waive_vllm_colons:
        problems = [p for p in problems if not _COLON_LINT.match(p)]
    else:
        assert r.returncode == 0, problems
    assert not problems, problems


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def label_sets(text: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples]


def test_aggregator_metrics_are_clean_safe_and_pruned():
    live, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://*:{live}",
                                            replay_endpoint=f"tcp://*:{replay}"))
    settings = AggregatorSettings(engines=(
        EngineSpec("engine-0", f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                   model="llama"),
        EngineSpec("engine-1", f"tcp://127.0.0.1:{free_port()}", model="llama")))
    with ServerThread(create_app(settings)) as srv:
        url = srv.url
        assert wait_until(lambda: httpx.get(f"{url}/v1/engines").json()["engines"][0]["connected"], 10)
        toks = list(range(64))
        pub.publish(KVEventBatch(time.time(), [BlockStored([1, 2, 3, 4], None, toks, 16, None, "GPU", None)]))
        assert wait_until(lambda: httpx.get(f"{url}/v1/engines").json()["engines"][0]["blocks"], 10)
        for model in ("llama", "typo-model", None):
            assert httpx.post(f"{url}/v1/lookup", json={"token_ids": toks, "model": model}).status_code == 200
        text = httpx.get(f"{url}/metrics").text
        promtool_check(text)
        labels = label_sets(text)
        assert not any(set(ls) & TARGET_LABELS or any(k.startswith("exported_") for k in ls)
                       for ls in labels)
        per_engine = [ls for ls in labels if "engine" in ls]
        assert {ls["engine"] for ls in per_engine} == {"engine-0", "engine-1"}
        assert all(ls["model_name"] == "llama" for ls in per_engine)
        fams = families(text)
        up = {s.labels["engine"]: s.value for s in fams["kvevents_engine_up"].samples}
        assert up == {"engine-0": 1.0, "engine-1": 0.0}
        lag = [s for s in fams["kvevents_event_lag_seconds"].samples if s.name.endswith("_count")]
        assert [(s.labels["engine"], s.value) for s in lag] == [("engine-0", 1.0)]
        # Lookup models: only a followed engine's model becomes a label value; any other
        # name is "unknown", no name "".
        looked = {s.labels["model_name"]: s.value for s in fams["kvevents_lookups"].samples}
        assert looked == {"llama": 1.0, "unknown": 1.0, "": 1.0}

        assert httpx.delete(f"{url}/v1/engines/engine-0").status_code == 204
        after = httpx.get(f"{url}/metrics").text
        promtool_check(after)
        assert not [ls for ls in label_sets(after) if ls.get("engine") == "engine-0"]
        assert [ls for ls in label_sets(after) if ls.get("engine") == "engine-1"]
    pub.shutdown(0.5)


@contextmanager
def simulated_engine() -> Iterator[CollectorRegistry]:
    """A real simulated engine with a CPU tier, after serving 7 requests that hit both
    tiers; yields its metrics registry (live until the context exits)."""
    from connector import OffloadConfig
    from kvevents.sim import EngineConfig, PagedEngine
    from kvevents.sim.metrics import CountingPublisher, EngineMetrics

    rng = random.Random(1)
    pub = CountingPublisher(NullEventPublisher())
    eng = PagedEngine(EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=256),
                      offload=OffloadConfig(cpu_capacity_blocks=64, offloaded_block_size=64),
                      publisher=pub)
    registry = CollectorRegistry()
    metrics = EngineMetrics("engine-0", eng, pub, registry, model_name="llama")
    try:
        shared = [rng.randrange(32000) for _ in range(200)]
        eng.add_request("a", shared + [rng.randrange(32000) for _ in range(100)], 4)
        eng.add_request("a2", shared + [rng.randrange(32000) for _ in range(50)], 2)
        for r in eng.run_until_idle():
            metrics.observe(r)
        for i in range(4):  # push the shared prefix out of the GPU pool into the CPU tier
            eng.add_request(f"f{i}", [rng.randrange(32000) for _ in range(600)], 2)
        for r in eng.run_until_idle():
            metrics.observe(r)
        eng.add_request("b", shared + [rng.randrange(32000) for _ in range(90)], 3)
        for r in eng.run_until_idle():
            metrics.observe(r)
        yield registry
    finally:
        eng.shutdown()


def engine_exposition() -> str:
    with simulated_engine() as registry:
        return generate_latest(registry).decode()


def test_simulated_engine_exports_vllm_names_and_clean_metrics():
    text = engine_exposition()
    promtool_check(text, waive_vllm_colons=True)
    fams = families(text)
    for name, (kind, extra) in VLLM_METRICS.items():
        assert name in fams, f"missing {name}"
        fam = fams[name]
        assert fam.type == kind, (name, fam.type)
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            assert set(s.labels) == {"model_name", "engine", *extra}, (s.name, s.labels)
            assert s.labels["model_name"] == "llama" and s.labels["engine"] == "engine-0"
    assert not any(set(ls) & TARGET_LABELS for ls in label_sets(text))
    own = [n for n in fams if not n.startswith("vllm:")]
    assert own and all(n.startswith("kvevents_sim_") for n in own), own

    def value(name, **labels):
        return sum(s.value for s in fams[name].samples
                   if s.name == name + "_total" and labels.items() <= s.labels.items())

    prompt = value("vllm:prompt_tokens")
    by_source = {src: value("vllm:prompt_tokens_by_source", source=src)
                 for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(by_source.values()) == prompt > 0
    assert by_source["local_cache_hit"] > 0 and by_source["external_kv_transfer"] > 0
    assert value("vllm:prefix_cache_hits") == by_source["local_cache_hit"]
    assert value("vllm:external_prefix_cache_hits") == by_source["external_kv_transfer"]
    assert value("vllm:prompt_tokens_cached") == by_source["local_cache_hit"] + by_source["external_kv_transfer"]
    assert value("vllm:prefix_cache_queries") == prompt
    assert value("vllm:request_success", finished_reason="length") == 7
    ttft_count = [s.value for s in fams["vllm:time_to_first_token_seconds"].samples
                  if s.name.endswith("_count")]
    assert ttft_count == [7.0]


def test_engine_metrics_keep_vllm_names_when_prometheus_asks_for_openmetrics():
    from kvevents.sim.metrics import serve_metrics

    with simulated_engine() as registry:
        port = free_port()
        httpd = serve_metrics(port, "127.0.0.1", registry)
        try:
            # The Accept header Prometheus sends.
            accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                      "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept}, timeout=5)
        finally:
            httpd.shutdown()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'vllm:prompt_tokens_total{engine="engine-0",model_name="llama"}' in r.text
    assert "vllm_prompt_tokens" not in r.text


def test_lookup_metrics_add_up_per_series_and_bucket():
    """The lookup families (kept as plain numbers, built at scrape): each lookup in one
    latency bucket, the histogram cumulative, tokens summed per (api, model) and tier; a
    model no engine serves is labelled "unknown"."""
    from kvevents.index import EngineMatch, LookupResult
    from kvevents.service.aggregator import Aggregator

    agg = Aggregator(AggregatorSettings(engines=(
        EngineSpec("e", f"tcp://127.0.0.1:{free_port()}", model="m"),)))
    try:
        hit = LookupResult(100, 16, [EngineMatch("e", 64, {"GPU": 48, "CPU": 64}, 16)])
        miss = LookupResult(40, 16, [])
        for seconds, result, model in ((0.00002, hit, "m"), (0.0003, hit, "m"), (0.2, miss, "m"),
                                       (0.00002, miss, "typo")):
            agg.metrics.observe_lookup("route", seconds, result, model)
        fams = {f.name: f for f in text_string_to_metric_families(generate_latest(agg.registry).decode())}
        value = {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for f in fams.values() if f.name.startswith("kvevents_lookup") for s in f.samples}
        m = (("api", "route"), ("model_name", "m"))
        assert value[("kvevents_lookups_total", m)] == 3
        assert value[("kvevents_lookup_prompt_tokens_total", m)] == 240
        assert value[("kvevents_lookup_matched_tokens_total", m)] == 128
        assert value[("kvevents_lookup_tier_tokens_total", (*m, ("tier", "CPU")))] == 128
        assert value[("kvevents_lookup_tier_tokens_total", (*m, ("tier", "GPU")))] == 96
        assert value[("kvevents_lookups_total", (("api", "route"), ("model_name", "unknown")))] == 1
        assert not any(("model_name", "typo") in labels for _, labels in value)
        buckets = {s.labels["le"]: s.value for s in fams["kvevents_lookup_latency_seconds"].samples
                   if s.name.endswith("_bucket") and s.labels["model_name"] == "m"}
        assert buckets["1e-05"] == 0 and buckets["2.5e-05"] == 1 and buckets["0.0005"] == 2
        assert buckets["0.1"] == 2 and buckets["+Inf"] == 3
        assert value[("kvevents_lookup_latency_seconds_count", m)] == 3
        assert abs(value[("kvevents_lookup_latency_seconds_sum", m)] - 0.20032) < 1e-9
        assert agg.metrics.totals == {"lookups": 4, "prompt_tokens": 280, "matched_tokens": 128}
        assert agg.metrics.tier_totals == {"GPU": 96, "CPU": 128}
    finally:
        agg.stop()
