"""The Grafana dashboard: importable, templated, and every panel's query runs on a real
Prometheus scraping a real aggregator and a real simulated engine, and returns data.

* Structure: ``__inputs``/``__requires`` for import; variables for the datasource, the
  model (``model_name``), the aggregator's engines and the engines' endpoints; every
  rate uses ``$__rate_interval``; every per-engine selector honours ``$model``.
* Names: every metric a panel uses is in the ``/metrics`` of the aggregator or of a
  simulated engine (which exports vLLM's names: the same panels serve a vLLM fleet),
  and every metric those export has a panel.
* Gateway: the aggregator's OpenAI gateway in front of a real simulated engine process
  (``kvevents.sim.process`` with its OpenAI front) and of an HTTP server that fails with
  500 (so a request is retried); streamed and whole completions go through it.
* Queries: Grafana's variables substituted as Grafana would with "All" selected
  (``$model`` -> ``.*``, ``$__rate_interval`` -> ``1m``), each panel query and each
  variable's query returns series from a real Prometheus.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from support import PrometheusServer, ServerThread, free_port, require_binary, wait_until
from test_metrics import engine_exposition, simulated_engine
from kvevents.sim.metrics import serve_metrics
from kvevents.api import create_app
from kvevents.gateway import GatewayMetrics
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings, EngineSpec

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboard/grafana/dashboards/kvevents.json"

# Grafana's variables as Grafana substitutes them with "All" selected.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
                "$model": ".*", "$engine": ".*", "$instance": ".*"}
METRIC = re.compile(r"\b(?:kvevents_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
_ENGINE_SELECTORS = ("engine=~\"$engine\"", "instance=~\"$instance\"")
# Gateway series without the usual pair of labels (kvevents/gateway/metrics.py): which of
# model_name and engine each one carries. Their selectors name exactly those (a selector
# on a label a series lacks would match nothing); every other gateway series has both.
_GATEWAY_PARTIAL_LABELS = {
    "kvevents_gateway_ttft_seconds": {"model_name"},
    "kvevents_gateway_request_seconds": {"model_name"},
    "kvevents_gateway_inflight_requests": {"engine"},
    "kvevents_gateway_retries_total": set(),
    "kvevents_gateway_untokenized_total": set(),
    # Closed by the server's limits (reason="header_timeout", ...): before any routing,
    # so neither an engine's nor a model's.
    "kvevents_gateway_connections_closed_total": set(),
}


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def family_names(text: str) -> set[str]:
    """Metric families, without the ``*_created`` timestamps prometheus_client adds."""
    return {fam.name for fam in text_string_to_metric_families(text)
            if not fam.name.endswith("_created")}


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def raw_queries(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana variables substituted) for every target."""
    out = []
    for title, expr in raw_queries(dash):
        expr = substitute(expr)
        assert "$" not in expr, f"{title}: unsubstituted variable in {expr!r}"
        out.append((title, expr))
    return out


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def gateway_labels() -> dict[str, set[str]]:
    """Each gateway metric (counters with ``_total``) -> which of model_name and engine it
    carries, read from the metrics the gateway registers."""
    out = {}
    for metric in vars(GatewayMetrics(CollectorRegistry())).values():
        if not isinstance(metric, MetricWrapperBase):  # (its cache of label children)
            continue
        name = metric._name + ("_total" if metric._type == "counter" else "")  # noqa: SLF001
        out[name] = set(metric._labelnames) & {"model_name", "engine"}  # noqa: SLF001
    return out


def test_gateway_label_exceptions_are_the_metrics_own():
    labels = gateway_labels()
    assert {n: ls for n, ls in labels.items() if ls != {"model_name", "engine"}} == _GATEWAY_PARTIAL_LABELS


def test_dashboard_structure(dash):
    assert {i["pluginId"] for i in dash["__inputs"]} == {"prometheus"}
    assert {(r["type"], r["id"]) for r in dash["__requires"]} >= {
        ("grafana", "grafana"), ("datasource", "prometheus"), ("panel", "timeseries"), ("panel", "stat")}
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "engine", "instance"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*", name
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, name
    assert "model_name" in variables["model"]["query"]["query"]

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
    assert "Engines (vLLM metrics)" in rows and "Gateway (OpenAI)" in rows

    for title, expr in raw_queries(dash):
        windows = re.findall(r"\[([^\]]+)\]", expr)
        # Rates follow Grafana's scrape-aware interval; only "last hour" stats are fixed.
        assert all(w == "$__rate_interval" or (w == "1h" and "(1h)" in title) for w in windows), (title, expr)
        for name in METRIC.findall(expr):
            if name.startswith(("kvevents_index_",)):
                continue  # whole-index gauges carry no model or engine
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base in _GATEWAY_PARTIAL_LABELS:
                selector = re.search(re.escape(name) + r"\{([^}]*)\}", expr)
                got = selector.group(1) if selector else ""
                has = _GATEWAY_PARTIAL_LABELS[base]
                assert ('model_name=~"$model"' in got) == ("model_name" in has), (title, name)
                assert ('engine=~"$engine"' in got) == ("engine" in has), (title, name)
                continue
            selector = re.search(re.escape(name) + r"\{([^}]*)\}", expr)
            assert selector and 'model_name=~"$model"' in selector.group(1), (title, name)
            if not name.startswith("kvevents_lookup"):
                assert any(s in selector.group(1) for s in _ENGINE_SELECTORS), (title, name)


def test_panels_use_exported_metrics_and_every_metric_has_a_panel(dash):
    engine_text = engine_exposition()
    used = {m for _, q in queries(dash) for m in METRIC.findall(q)}
    engine_used = {m for m in used if m.startswith(("vllm:", "kvevents_sim_"))}
    assert engine_used <= sample_names(engine_text), sorted(engine_used - sample_names(engine_text))
    unused = [fam for fam in family_names(engine_text)
              if not any(m == fam or m.startswith(fam + "_") for m in engine_used)]
    assert not unused, f"engine metrics without a panel: {unused}"


class _Publisher:
    def __init__(self) -> None:
        self.live, self.replay = free_port(), free_port()
        self.pub = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://*:{self.live}", replay_endpoint=f"tcp://*:{self.replay}"))


class SimOpenAIEngine:
    """``python -m kvevents.sim.process`` with its OpenAI front (``--http-port``) serving
    ``model``; ``spec(name)`` follows it with the gateway on. Stopped on exit."""

    def __init__(self, model: str, log_path: Path, gpu_blocks: int = 256,
                 token_interval: float = 0.0) -> None:
        self.events, self.replay, self.http = free_port(), free_port(), free_port()
        self.model = model
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvevents.sim.process", "--name", log_path.stem,
             "--bind", "127.0.0.1", "--events-port", str(self.events),
             "--replay-port", str(self.replay), "--rpc-port", str(free_port()),
             "--metrics-port", "0", "--gpu-blocks", str(gpu_blocks), "--cpu-blocks", "0",
             "--offloaded-block-size", "16", "--http-port", str(self.http), "--model", model,
             "--http-token-interval", str(token_interval)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})

    def spec(self, name: str) -> EngineSpec:
        return EngineSpec(name, f"tcp://127.0.0.1:{self.events}",
                          replay_endpoint=f"tcp://127.0.0.1:{self.replay}", model=self.model,
                          http=f"http://127.0.0.1:{self.http}")

    def wait_ready(self, timeout: float = 60) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, Path(self._log.name).read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{self.http}/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(up, timeout, 0.1), "the simulated engine's OpenAI front never answered"

    def __enter__(self) -> SimOpenAIEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


class FailingOpenAIServer:
    """An engine's OpenAI server that is up (its /metrics answers) but fails every
    request with 500: the gateway sends the request again to another engine."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # /metrics, as the gateway polls it
                self._answer(200, b"", "text/plain")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self._answer(500, b'{"error": {"message": "broken", "type": "server_error", '
                                  b'"param": null, "code": null}}', "application/json")

            def _answer(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


TOKS = list(range(64))  # engine-0's blocks (and the lookups' prompt): tokens 0..63


def _gateway_requests(srv: ServerThread) -> None:
    """Completions through the gateway, streamed (with usage) and whole. The first
    shares 32 cached tokens with engine-0 only, so it goes there first (a 500: retried on
    the simulated engine); a round later the simulated engine holds all of them."""
    url = f"{srv.url}/v1/completions"
    r = httpx.post(url, json={"model": "llama", "prompt": TOKS[:32] + list(range(3000, 3032)),
                              "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"] is not None, r.text
    for i in range(2):
        prompt = [4000 + 100 * i + t for t in range(48)]
        with httpx.stream("POST", url, timeout=30, json={
                "model": "llama", "prompt": prompt, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}) as s:
            assert s.status_code == 200
            assert any('"cached_tokens"' in line for line in s.iter_lines())
        r = httpx.post(url, json={"model": "llama", "prompt": prompt, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text


def _engine(srv: ServerThread, name: str) -> dict:
    return next(e for e in httpx.get(f"{srv.url}/v1/engines").json()["engines"] if e["name"] == name)


def _exercise(srv: ServerThread, eng: _Publisher, round_: int) -> None:
    """Events of every kind the dashboard plots, lookups that hit both tiers, and
    requests through the gateway."""
    toks = TOKS
    eng.pub.publish(KVEventBatch(time.time(), [
        BlockStored([1, 2, 3, 4], None, toks, 16, None, "GPU", None),
        BlockStored([3, 4], 2, toks[32:], 16, None, "CPU", None),
        BlockRemoved([4], "GPU"),
        BlockStored([100 + round_], 9999, list(range(900, 916)), 16, None, "GPU", None),  # orphan
        BlockRemoved([5000 + round_], "CPU"),  # never stored: an unknown removal
    ]))
    assert wait_until(lambda: _engine(srv, "engine-0")["last_seq"] == round_, 10)
    for _ in range(3):
        r = httpx.post(f"{srv.url}/v1/lookup", json={"token_ids": toks + [7] * 16, "model": "llama"},
                       timeout=5)
        assert r.json()["engines"][0]["tiers"] == {"GPU": 48}, r.text
    _gateway_requests(srv)


def _variable_query(query: str) -> str:
    """A ``label_values`` variable as a PromQL query whose series carry the label."""
    m = re.fullmatch(r"label_values\((?:(?P<sel>.+),\s*)?(?P<label>\w+)\)", query)
    assert m, query
    sel = substitute(m.group("sel")) if m.group("sel") else f'{{{m.group("label")}!=""}}'
    return f'count by ({m.group("label")}) ({sel})'


@pytest.mark.timeout(120)
def test_every_query_returns_data_from_prometheus(dash, tmp_path):
    binary = require_binary("prometheus")
    eng = _Publisher()
    failing = FailingOpenAIServer()
    sim = SimOpenAIEngine("llama", tmp_path / "engine-1.log")
    settings = AggregatorSettings(engines=(EngineSpec(
        "engine-0", f"tcp://127.0.0.1:{eng.live}", replay_endpoint=f"tcp://127.0.0.1:{eng.replay}",
        model="llama", http=failing.url), sim.spec("engine-1")))
    all_queries = queries(dash)
    with sim, ServerThread(create_app(settings)) as srv, simulated_engine() as engine_registry:
        engine_port = free_port()
        httpd = serve_metrics(engine_port, "127.0.0.1", engine_registry)  # as the engine process does
        prom = PrometheusServer(tmp_path, {"kvevents-aggregator": [f"127.0.0.1:{srv.port}"],
                                           "engines": [f"127.0.0.1:{engine_port}"]}, binary)
        try:
            sim.wait_ready()

            def gateway_ready() -> bool:
                engines = httpx.get(f"{srv.url}/v1/engines").json()["engines"]
                return all(e["connected"] and e["gateway"]["reachable"] for e in engines)

            assert wait_until(gateway_ready, 20, 0.1), httpx.get(f"{srv.url}/v1/engines").text
            time.sleep(0.3)  # the subscription is in place (a missed batch would be replayed anyway)
            _exercise(srv, eng, 0)

            # Every aggregator metric a panel names is in the aggregator's /metrics.
            exported = sample_names(httpx.get(f"{srv.url}/metrics").text)
            used = {m for _, q in all_queries for m in METRIC.findall(q)
                    if not m.startswith(("vllm:", "kvevents_sim_"))}
            assert used, "the dashboard has no aggregator panels"
            assert used <= exported, f"not exported by the aggregator: {sorted(used - exported)}"

            # Two scrapes around a second round of events and lookups give every rate()
            # an increase to compute.
            prom.wait_ready()
            assert wait_until(lambda: len(prom.query("up == 1")) == 2, 20, 0.2)
            first = time.time()
            _exercise(srv, eng, 1)

            def scraped_since_round_1() -> bool:
                res = prom.query("timestamp(kvevents_lookups_total)")
                return bool(res) and float(res[0]["value"][1]) > first + 0.2

            assert wait_until(scraped_since_round_1, 20, 0.2)
            assert wait_until(lambda: prom.query("count_over_time(vllm:prompt_tokens_total[1m]) >= 2"), 20, 0.2)
            for title, q in all_queries:
                assert prom.query(q), f"{title}: {q!r} returned no series"
            for v in dash["templating"]["list"]:
                if v["type"] == "query":
                    assert prom.query(_variable_query(v["query"]["query"])), v["name"]
            # (the lookups' own: the gateway's routing looks prompts up too, as api="route")
            ratio = prom.query('sum by (tier) (rate(kvevents_lookup_tier_tokens_total{api="lookup"}[5m])) '
                               '/ ignoring(tier) group_left '
                               'sum(rate(kvevents_lookup_prompt_tokens_total{api="lookup"}[5m]))')
            assert {r["metric"]["tier"]: round(float(r["value"][1]), 3) for r in ratio} == {"GPU": 0.6}
            # The gateway's figures: one retry (engine-0's 500) per round, every answer
            # from engine-1, and the engine reused what the index predicted, short of the
            # last block of a prompt cached whole (an engine computes its last token again).
            metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text)
                       for s in fam.samples}
            assert metrics[("kvevents_gateway_retries_total", (("reason", "5xx"),))] >= 1
            assert metrics[("kvevents_gateway_requests_total",
                            (("engine", "engine-1"), ("model_name", "llama"), ("status", "200")))] == 10, \
                {k: v for k, v in metrics.items() if k[0] == "kvevents_gateway_requests_total"}
            key = (("engine", "engine-1"), ("model_name", "llama"))
            predicted = metrics[("kvevents_gateway_predicted_cached_tokens_total", key)]
            reported = metrics[("kvevents_gateway_reported_cached_tokens_total", key)]
            assert 0 < reported <= predicted <= reported + 16 * 10, (predicted, reported)
        finally:
            prom.close()
            httpd.shutdown()
            failing.close()
    eng.pub.shutdown(0.5)
