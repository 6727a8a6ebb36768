"""The Grafana dashboard's queries name real metrics and run on a real Prometheus.

* Aggregator metrics: a real aggregator follows a real publisher and serves lookups;
  every ``kvevents_*`` name a panel uses must be in its ``/metrics`` output, and every
  panel query must return data from a real Prometheus scraping it.
* Engine metrics (``kvevents_engine_*``): checked against :data:`ENGINE_METRICS`, the
  names the engine process exports, through :func:`engine_sample_names` (the one place
  to switch to a scrape of a real engine process), and their queries must at least parse
  and run on Prometheus (a query over an absent metric answers an empty result, not an
  error).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import PrometheusServer, ServerThread, free_port, require_binary, wait_until
from kvevents.api import create_app
from kvevents.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.schema import BlockRemoved, BlockStored, KVEventBatch
from kvevents.settings import AggregatorSettings, PodSpec

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboard/grafana/dashboards/kvevents.json"

# Family name -> type, as the engine process (kvevents/sim/metrics.py) exports them.
ENGINE_METRICS = {
    "kvevents_engine_requests": "counter",
    "kvevents_engine_prompt_tokens": "counter",
    "kvevents_engine_hit_tokens": "counter",
    "kvevents_engine_computed_prefill_tokens": "counter",
    "kvevents_engine_offload_bytes": "counter",
    "kvevents_engine_offload_seconds": "counter",
    "kvevents_engine_cpu_pool_used_blocks": "gauge",
    "kvevents_engine_cpu_pool_capacity_blocks": "gauge",
    "kvevents_engine_gpu_blocks_used": "gauge",
    "kvevents_engine_gpu_blocks_total": "gauge",
    "kvevents_engine_evictions": "counter",
    "kvevents_engine_published_batches": "counter",
    "kvevents_engine_publish_dropped": "counter",
    "kvevents_engine_waiting_requests": "gauge",
    "kvevents_engine_running_requests": "gauge",
    "kvevents_engine_kv_usage_ratio": "gauge",
    "kvevents_engine_ttft_seconds": "histogram",
}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}

# Grafana's own variables, as Grafana would substitute them before sending a query.
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
_METRIC = re.compile(r"\bkvevents_[a-z0-9_]+\b")


def engine_sample_names() -> set[str]:
    """Sample names the engine process exposes on its /metrics.

    Built from :data:`ENGINE_METRICS`. To check against a running engine instead, start
    ``python -m kvevents.sim.process --metrics-port PORT ...`` and return
    ``scrape_sample_names(f"http://127.0.0.1:{PORT}/metrics")``.
    """
    return {family + suffix for family, kind in ENGINE_METRICS.items() for suffix in _SUFFIXES[kind]}


def scrape_sample_names(url: str) -> set[str]:
    """Every sample name (with ``_total``/``_bucket``... suffixes) served at ``url``."""
    text = httpx.get(url, timeout=5).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana variables substituted) for every target."""
    out = []
    for p in panels(dash):
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, value in _GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{p['title']}: unsubstituted variable in {expr!r}"
            out.append((p["title"], expr))
    return out


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_structure(dash):
    var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    ids, cells = set(), set()
    for p in panels(dash):
        assert p["id"] not in ids, f"duplicate panel id {p['id']}"
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        # One datasource variable, everywhere: switching it switches every panel.
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    rows = [p["title"] for p in panels(dash) if p["type"] == "row"]
    assert "Engines" in rows


def test_engine_panels_use_exported_engine_metrics(dash):
    exported = engine_sample_names()
    used = {m for _, q in queries(dash) for m in _METRIC.findall(q) if m.startswith("kvevents_engine_")}
    assert used <= exported, f"not exported by the engine: {sorted(used - exported)}"
    unused = [family for family, kind in ENGINE_METRICS.items()
              if not any(family + suffix in used for suffix in _SUFFIXES[kind])]
    assert not unused, f"engine metrics without a panel: {unused}"


class _Engine:
    def __init__(self) -> None:
        self.live, self.replay = free_port(), free_port()
        self.pub = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://*:{self.live}", replay_endpoint=f"tcp://*:{self.replay}"))


def _exercise(srv: ServerThread, eng: _Engine, round_: int) -> None:
    """Events of every kind the dashboard plots, then lookups that hit both tiers."""
    toks = list(range(64))
    eng.pub.publish(KVEventBatch(time.time(), [
        BlockStored([1, 2, 3, 4], None, toks, 16, None, "GPU", None),
        BlockStored([3, 4], 2, toks[32:], 16, None, "CPU", None),
        BlockRemoved([4], "GPU"),
        BlockStored([100 + round_], 9999, list(range(900, 916)), 16, None, "GPU", None),  # orphan
        BlockRemoved([5000 + round_], "CPU"),  # never stored: an unknown removal
    ]))
    assert wait_until(lambda: httpx.get(f"{srv.url}/v1/pods").json()["pods"][0]["last_seq"] == round_, 10)
    for _ in range(3):
        r = httpx.post(f"{srv.url}/v1/lookup", json={"token_ids": toks + [7] * 16}, timeout=5)
        assert r.json()["pods"][0]["tiers"] == {"GPU": 48}, r.text


@pytest.mark.timeout(90)
def test_panel_queries_name_real_metrics_and_run_on_prometheus(dash, tmp_path):
    binary = require_binary("prometheus")
    eng = _Engine()
    settings = AggregatorSettings(pods=(PodSpec(
        "engine-0", f"tcp://127.0.0.1:{eng.live}", replay_endpoint=f"tcp://127.0.0.1:{eng.replay}"),))
    all_queries = queries(dash)
    with ServerThread(create_app(settings)) as srv:
        prom = PrometheusServer(tmp_path, {"kvevents-aggregator": [f"127.0.0.1:{srv.port}"]}, binary)
        try:
            assert wait_until(lambda: httpx.get(f"{srv.url}/v1/pods").json()["pods"][0]["connected"], 10)
            time.sleep(0.3)  # the subscription is in place (a missed batch would be replayed anyway)
            _exercise(srv, eng, 0)

            # (a) Every aggregator metric a panel names is in the aggregator's /metrics.
            exported = scrape_sample_names(f"{srv.url}/metrics")
            used = {m for _, q in all_queries for m in _METRIC.findall(q)
                    if not m.startswith("kvevents_engine_")}
            assert used, "the dashboard has no aggregator panels"
            assert used <= exported, f"not exported by the aggregator: {sorted(used - exported)}"

            # (b) Each query runs on Prometheus. Two scrapes around a second round of
            # events and lookups give every rate() an increase to compute.
            prom.wait_ready()
            assert wait_until(lambda: prom.query('up{job="kvevents-aggregator"}') != [], 20, 0.2)
            first = time.time()
            _exercise(srv, eng, 1)

            def scraped_since_round_1() -> bool:
                res = prom.query("timestamp(kvevents_lookups_total)")
                return bool(res) and float(res[0]["value"][1]) > first + 0.2

            assert wait_until(scraped_since_round_1, 20, 0.2)
            for title, q in all_queries:
                result = prom.query(q)  # raises with Prometheus's message if it fails
                if not any(m.startswith("kvevents_engine_") for m in _METRIC.findall(q)):
                    assert result, f"{title}: {q!r} returned no series from a live aggregator"
            ratio = prom.query('sum by (tier) (rate(kvevents_lookup_tier_tokens_total[5m])) / ignoring(tier) '
                               'group_left sum(rate(kvevents_lookup_prompt_tokens_total[5m]))')
            assert {r["metric"]["tier"]: round(float(r["value"][1]), 3) for r in ratio} == {"GPU": 0.6}
        finally:
            prom.close()
    eng.pub.shutdown(0.5)
