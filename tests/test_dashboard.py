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
  variable's query returns series from a real Prometheus. Every rate() is read once
  Prometheus has scraped each series before and after an increase, and every query at
  one moment whose latest scrapes had all succeeded (a later failed scrape, under load,
  would mark the series stale).
* Replicas and workers: a real Prometheus scraping 2 ``kvevents serve --workers 2`` (and
  1 x 1) following the same 4 engines; the fleet panels (engines up, index entries,
  resident blocks per engine and tier, engines connected, processes and replicas,
  lookups, predicted hit ratio) equal what the engines hold and what was asked, where
  the old sums read every engine once per process.
"""

from __future__ import annotations

import dataclasses

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

from support import PrometheusServer, ServerThread, free_port, require_binary, send_answer, wait_until
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
                "$model": ".*", "$engine": ".*", "$instance": ".*", "$replica": ".*",
                "$worker": ".*"}
METRIC = re.compile(r"\b(?:kvevents_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
_ENGINE_SELECTORS = ("engine=~\"$engine\"", "instance=~\"$instance\"")
# The aggregator's processes: instance (one per replica scraped) and worker (one per
# ``serve --workers`` process; absent with one worker, which ".*" matches).
_PROCESS_SELECTORS = ('instance=~"$replica"', 'worker=~"$worker"')
_PROCESS_METRICS = ("kvevents_index_", "kvevents_ingest_", "kvevents_worker_", "kvevents_workers")
# Gateway series without the usual pair of labels (kvevents/gateway/metrics.py): which of
# model_name and engine each one carries. Their selectors name exactly those (a selector
# on a label a series lacks would match nothing); every other gateway series has both.
_GATEWAY_PARTIAL_LABELS = {
    "kvevents_gateway_ttft_seconds": {"model_name"},
    "kvevents_gateway_request_seconds": {"model_name"},
    "kvevents_gateway_inflight_requests": {"engine"},
    "kvevents_gateway_retries_total": set(),
    "kvevents_gateway_untokenized_total": set(),
    # Routed by less than the whole prompt (reason="image", "prompt_embeds", ...): what
    # the request held, counted across models like the untokenized ones.
    "kvevents_gateway_partial_prompts_total": set(),
    # Closed by the server's limits (reason="header_timeout", ...): before any routing,
    # so neither an engine's nor a model's.
    "kvevents_gateway_connections_closed_total": set(),
    # A disaggregated model's decision per request (reason="disaggregated", ...):
    # across models, like the retries; its hop times are per model.
    "kvevents_gateway_pd_decisions_total": set(),
    "kvevents_gateway_pd_prefill_seconds": {"model_name"},
    "kvevents_gateway_pd_decode_ttft_seconds": {"model_name"},
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
    for name in ("model", "engine", "instance", "replica", "worker"):
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
            if name.startswith("kvevents_") and not name.startswith("kvevents_sim_"):
                # Every aggregator series is one process's: the replica and worker
                # variables select processes on every one of them.
                selector = re.search(re.escape(name) + r"\{([^}]*)\}", expr)
                assert selector and all(s in selector.group(1) for s in _PROCESS_SELECTORS), (title, name)
            if name.startswith(_PROCESS_METRICS):
                continue  # a process's own (its index, ingest loop, workers): no model or engine
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


# --- per-process series: one copy per worker of every replica -----------------------------

#: PromQL's aggregation operators.
_AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk",
                 "bottomk", "quantile", "count_values"}
#: Labels that tell the aggregator's processes apart: Prometheus' instance (a replica),
#: the Prometheus operator's and Kubernetes discovery's pod, and serve --workers' worker.
_PROCESS_LABELS = {"instance", "pod", "worker", "replica"}
#: Aggregations that keep one process's value of a series every process exports alike.
_DEDUP = {"max", "min", "avg"}


def per_process_copies() -> set[str]:
    """The aggregator series that every worker of every replica exports alike: the
    families :class:`StateCollector` builds from the engines' streams and the index
    (each process follows every engine and indexes all of it), read from the functions
    that build them, so a family added there is covered here. Not the ingest loop's
    own health (``ingest_health``: each process's own), nor what is observed per
    request or lookup (the gateway's and lookups' metrics: each process counts its own
    requests, so those are summed)."""
    import inspect

    from kvevents.service.metrics import collector

    names = set()
    for fn in (collector.applied_events, collector.index_anomalies, collector.resident_blocks,
               collector.stream_stats, collector.ingest_recovery, collector.apply_errors,
               collector.refused_events, collector.index_totals):
        src = inspect.getsource(fn)
        for m in re.finditer(r'(Counter|Gauge)MetricFamily\(\s*"(kvevents_\w+)"', src):
            names.add(m.group(2) + ("_total" if m.group(1) == "Counter" else ""))
    return names


def _matching(expr: str, at: int, step: int) -> int:
    """Index of the parenthesis matching the one at ``at`` (``step`` -1: an opening one
    to the left of a closing one; +1: a closing one to the right of an opening one)."""
    depth = 0
    i = at
    while 0 <= i < len(expr):
        depth += {"(": 1, ")": -1}.get(expr[i], 0) * step
        if depth == 0:
            return i
        i += step
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def enclosing_aggregations(expr: str, at: int) -> list[tuple[str, str, set[str]]]:
    """The aggregations around position ``at`` of ``expr``, innermost first: (operator,
    "by" or "without" or "", its labels). Handles both ``max by (l) (x)`` and
    ``max(x) by (l)``."""
    out = []
    depth, i = 0, at - 1
    while i >= 0:
        c = expr[i]
        if c == ")":
            depth += 1
        elif c == "(":
            if depth:
                depth -= 1
            else:  # an unclosed "(" left of ``at``: what opens it?
                before = expr[:i].rstrip()
                clause, labels = "", set()
                if before.endswith(")"):  # "op by (labels) (" / "op without (labels) ("
                    open_at = _matching(before, len(before) - 1, -1)
                    labels = {x.strip() for x in before[open_at + 1:-1].split(",") if x.strip()}
                    head = before[:open_at].rstrip()
                    m = re.search(r"(\w+)\s+(by|without)$", head)
                    op, clause = (m.group(1), m.group(2)) if m else ("", "")
                else:
                    m = re.search(r"(\w+)$", before)
                    op = m.group(1) if m else ""
                    after = expr[_matching(expr, i, 1) + 1:]
                    m = re.match(r"\s*(by|without)\s*\(([^)]*)\)", after)
                    if m:
                        clause = m.group(1)
                        labels = {x.strip() for x in m.group(2).split(",") if x.strip()}
                if op in _AGGREGATIONS:
                    out.append((op, clause, labels))
        i -= 1
    return out


def per_process_misuse(expr: str, copies: set[str]) -> list[str]:
    """Why ``expr`` miscounts a series every aggregator process exports alike (empty: it
    does not). Each use must sit inside a ``max``, ``min`` or ``avg`` that aggregates the
    process labels away (``by`` without them), before anything else adds the copies up."""
    problems = []
    for m in re.finditer(r"\b(kvevents_[a-z0-9_]+)", expr):
        if m.group(1) not in copies:
            continue
        aggs = enclosing_aggregations(expr, m.start())
        if not aggs:
            problems.append(f"{m.group(1)}: one series per process, not aggregated")
            continue
        op, clause, labels = aggs[0]
        if op not in _DEDUP:
            problems.append(f"{m.group(1)}: {op} adds up one copy per process (take max by the "
                            f"series' own labels)")
        elif clause == "by" and labels & _PROCESS_LABELS:
            problems.append(f"{m.group(1)}: {op} by {sorted(labels)} keeps one copy per process")
        elif clause == "without" and not {"instance", "worker"} <= labels:
            problems.append(f"{m.group(1)}: {op} without {sorted(labels)} keeps the process labels")
    return problems


def test_the_per_process_copies_are_the_engines_and_the_index():
    copies = per_process_copies()
    assert {"kvevents_engine_up", "kvevents_resident_blocks", "kvevents_index_entries",
            "kvevents_index_distinct_blocks", "kvevents_engine_lag_seconds",
            "kvevents_batches_total", "kvevents_lost_batches_total",
            "kvevents_block_events_applied_total"} <= copies
    assert not {n for n in copies if n.startswith(("kvevents_gateway_", "kvevents_lookup",
                                                    "kvevents_ingest_"))}


def test_the_misuse_check_catches_sums_of_copies():
    """The check is not vacuous: each way a dashboard used to miscount fails it, and the
    ways that count right pass."""
    copies = per_process_copies()
    wrong = ["sum(kvevents_engine_up)", "kvevents_index_entries",
             "sum by (engine, tier) (kvevents_resident_blocks)", "count(kvevents_engine_up)",
             "sum by (engine) (rate(kvevents_batches_total[1m]))",
             "max by (instance, engine) (kvevents_engine_up)",
             "sum(max(kvevents_engine_up) by (engine, worker))",
             "max without (worker) (kvevents_resident_blocks)"]
    for expr in wrong:
        assert per_process_misuse(expr, copies), expr
    right = ["sum(max by (engine) (kvevents_engine_up))", "max(kvevents_index_entries)",
             'max by (engine, tier) (kvevents_resident_blocks{engine=~"e.*"})',
             "count(max by (engine) (kvevents_engine_up))",
             "sum(max(rate(kvevents_batches_total[1m])) by (engine))",
             "min without (instance, worker, pod) (kvevents_engine_up)",
             "sum by (engine) (rate(kvevents_gateway_requests_total[1m]))"]
    for expr in right:
        assert not per_process_misuse(expr, copies), expr


def test_no_panel_adds_up_per_process_copies(dash):
    """With 2 replicas x 2 workers each engine's series comes 4 times: a panel that sums
    them (or shows them bare) reads 4 engines as 16. Every use of such a series takes
    max/min/avg over the processes first."""
    copies = per_process_copies()
    problems = [(title, p) for title, expr in raw_queries(dash)
                for p in per_process_misuse(expr, copies)]
    assert not problems, problems


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
                send_answer(self, status, body, ctype)

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
            # Read to the end, as a client does: one that leaves after the usage chunk,
            # before [DONE], is counted as gone (499), not answered.
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert any('"cached_tokens"' in line for line in lines), lines[-3:]
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
        model="llama", http=failing.url), sim.spec("engine-1"),
        # The simulated engine as a prefill engine too: its requests take two hops
        # (the disaggregation row), the second on engine-1 (or engine-0, which fails).
        dataclasses.replace(sim.spec("engine-p"), role="prefill")),
        pd_skip_uncached_tokens=0, pd_skip_cached_share=1.0)
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
            # (kvevents_worker_*: the --workers N supervisor's, absent with one worker;
            # the panel that reads them falls back to 0)
            used = {m for _, q in all_queries for m in METRIC.findall(q)
                    if not m.startswith(("vllm:", "kvevents_sim_", "kvevents_worker_"))}
            assert used, "the dashboard has no aggregator panels"
            assert used <= exported, f"not exported by the aggregator: {sorted(used - exported)}"

            # Every rate() needs two scrapes of each series that show an increase: one
            # that began after round 0 (which created the lookup, gateway and event
            # series: a scrape that began during it may lack them) and one after round 1.
            # Then every query is evaluated at one moment when the latest scrape of each
            # target had succeeded (a scrape that fails later, under load, marks the
            # series stale from then on; it changes nothing at that moment).
            prom.wait_ready()
            round_0_end = time.time()

            def scraped_after(t: float, at: float | None = None) -> bool:
                stamps = prom.query("timestamp(kvevents_lookups_total)", at)
                return bool(stamps) and all(float(r["value"][1]) > t for r in stamps)

            assert wait_until(lambda: scraped_after(round_0_end), 20, 0.2), \
                prom.query("up[30s]")
            _exercise(srv, eng, 1)
            round_1_end = time.time()

            def settled(at: float) -> bool:
                return (scraped_after(round_1_end, at)
                        and bool(prom.query("count_over_time(kvevents_lookups_total[1m]) >= 2", at))
                        and bool(prom.query("timestamp(vllm:prompt_tokens_total)", at))
                        and bool(prom.query("count_over_time(vllm:prompt_tokens_total[1m]) >= 2", at)))

            deadline = time.monotonic() + 20
            while not settled(at := time.time()):
                assert time.monotonic() < deadline, prom.query("up[30s]")
                time.sleep(0.2)
            for title, q in all_queries:
                assert prom.query(q, at), f"{title}: {q!r} returned no series"
            for v in dash["templating"]["list"]:
                if v["type"] == "query" and v["name"] != "worker":  # (one worker: no label)
                    assert prom.query(_variable_query(v["query"]["query"]), at), v["name"]
            # (the lookups' own: the gateway's routing looks prompts up too, as api="route")
            ratio = prom.query('sum by (tier) (rate(kvevents_lookup_tier_tokens_total{api="lookup"}[5m])) '
                               '/ ignoring(tier) group_left '
                               'sum(rate(kvevents_lookup_prompt_tokens_total{api="lookup"}[5m]))', at)
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


# --- true across replicas and workers ------------------------------------------------------

def _panel_expr(dash: dict, title: str, metric: str) -> str:
    """The one query of panel ``title`` that reads ``metric``, variables substituted."""
    found = [q for t, q in queries(dash) if t == title and re.search(rf"\b{metric}\b", q)]
    assert len(found) == 1, (title, metric, found)
    return found[0]


def _by_worker(text: str, name: str) -> dict[str, float]:
    """Metric ``name`` summed per worker of one scrape (no worker label: one process)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                w = s.labels.get("worker", "0")
                out[w] = out.get(w, 0.0) + s.value
    return out


#: Engine i holds 2 + i blocks on the GPU and i on the CPU (block size 4): the truth.
_N_ENGINES, _BS = 4, 4
_GPU = {f"e{i}": 2 + i for i in range(_N_ENGINES)}
_CPU = {f"e{i}": i for i in range(_N_ENGINES)}


def _engine_batch(i: int) -> KVEventBatch:
    """Engine i's cache: a GPU chain and a CPU chain, every block's tokens its own."""
    gpu = [10_000 * (i + 1) + t for t in range(_GPU[f"e{i}"] * _BS)]
    cpu = [10_000 * (i + 1) + 5_000 + t for t in range(_CPU[f"e{i}"] * _BS)]
    events = [BlockStored([100 * i + b for b in range(_GPU[f"e{i}"])], None, gpu, _BS, None, "GPU", None)]
    if cpu:
        events.append(BlockStored([100 * i + 50 + b for b in range(_CPU[f"e{i}"])], None, cpu, _BS,
                                  None, "CPU", None))
    return KVEventBatch(time.time(), events)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("replicas, workers", [(2, 2), (1, 1)], ids=["2x2", "1x1"])
def test_panels_are_true_across_replicas_and_workers(dash, tmp_path, replicas, workers):
    """A real Prometheus scraping ``replicas`` real ``kvevents serve --workers N`` processes
    that all follow the same 4 engines: the fleet panels read what the engines hold and
    what was asked, whatever the number of processes (each exports its own copy of every
    engine's series), where the old dashboard's sums read each copy once more."""
    from test_workers import _serve

    binary = require_binary("prometheus")
    pubs = [_Publisher() for _ in range(_N_ENGINES)]
    endpoints = [a for i, p in enumerate(pubs) for a in (
        "--endpoint", f"e{i}=tcp://127.0.0.1:{p.live},replay=tcp://127.0.0.1:{p.replay},model=llama")]
    ports = [free_port() for _ in range(replicas)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    procs = [_serve(port, "--workers", str(workers), *endpoints, log=tmp_path / f"serve-{n}.log")
             for n, port in enumerate(ports)]
    prom = PrometheusServer(tmp_path, {"kvevents-aggregator": [f"127.0.0.1:{p}" for p in ports]}, binary)
    processes = replicas * workers

    def scrape(url: str) -> str:
        try:
            with httpx.Client(timeout=5) as client:  # a new connection: any worker
                r = client.get(url + "/metrics")
            return r.text if r.status_code == 200 else ""
        except httpx.HTTPError:
            return ""

    def everywhere(name: str, value: float) -> bool:
        """Every worker of every replica has ``name`` summed to ``value``."""
        return all(_by_worker(scrape(u), name) == {str(w): value for w in range(workers)}
                   for u in urls)

    def ready(url: str) -> bool:
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        for n, url in enumerate(urls):
            assert wait_until(lambda: ready(url), 40, 0.2), (tmp_path / f"serve-{n}.log").read_text()
        assert wait_until(lambda: everywhere("kvevents_engine_up", _N_ENGINES), 20, 0.2)
        for i, pub in enumerate(pubs):
            pub.pub.publish(_engine_batch(i))
        blocks = sum(_GPU.values()) + sum(_CPU.values())
        # Every process applied every block (a batch sent before a subscription took
        # effect is replayed).
        assert wait_until(lambda: everywhere("kvevents_block_events_applied_total", blocks), 30, 0.2), \
            [_by_worker(scrape(u), "kvevents_block_events_applied_total") for u in urls]

        # Lookups, each on a connection of its own (so over every worker), in two rounds
        # that Prometheus scrapes between: rate() sees them increase. Each matches the
        # 16 leading tokens of e3's GPU chain out of 20: the predicted hit ratio is 0.8.
        prompt = [10_000 * _N_ENGINES + t for t in range(16)] + [7, 7, 7, 7]
        prom.wait_ready()

        def scraped_after(t: float, at: float | None = None) -> bool:
            stamps = prom.query("timestamp(kvevents_index_entries)", at)
            return len(stamps) == processes and all(float(r["value"][1]) > t for r in stamps)

        sent = 0
        for _ in range(2):
            for k in range(8):
                r = httpx.post(urls[k % replicas] + "/v1/lookup", json={"token_ids": prompt, "model": "llama"},
                               timeout=5)
                assert r.json()["engines"][0] == {"engine": "e3", "matched_tokens": 16, "tiers": {"GPU": 16}}, r.text
                sent += 1
            end = time.time()
            assert wait_until(lambda: scraped_after(end), 20, 0.2), prom.query("up")

        at = time.time()  # every process scraped after the last lookup: the moment to read

        def value(q: str) -> float:
            res = prom.query(q, at)
            assert len(res) == 1, (q, res)
            return float(res[0]["value"][1])

        def by(q: str, *labels: str) -> dict:
            return {tuple(r["metric"][k] for k in labels): float(r["value"][1]) for r in prom.query(q, at)}

        shown = {
            "engines up": value(_panel_expr(dash, "Engines up", "sum")),
            "engines": value(_panel_expr(dash, "Engines up", "count")),
            "index entries": value(_panel_expr(dash, "Index entries", "kvevents_index_entries")),
            "distinct blocks": value(_panel_expr(dash, "Index entries", "kvevents_index_distinct_blocks")),
            "processes": value(_panel_expr(dash, "Aggregator processes",
                                           r"count\(kvevents_ingest_heartbeat_timestamp_seconds")),
            "replicas": value(_panel_expr(dash, "Aggregator processes", "count by")),
            "hit ratio": round(value(_panel_expr(dash, "Predicted hit ratio (any tier)", "sum")), 6),
        }
        assert shown == {"engines up": 4.0, "engines": 4.0, "index entries": float(blocks),
                         "distinct blocks": float(blocks), "processes": float(processes),
                         "replicas": float(replicas), "hit ratio": 0.8}, shown
        resident = by(_panel_expr(dash, "Resident blocks per engine and tier", "kvevents_resident_blocks"),
                      "engine", "tier")
        assert resident == {**{(e, "GPU"): float(n) for e, n in _GPU.items()},
                            **{(e, "CPU"): float(n) for e, n in _CPU.items() if n}}, resident
        connected = by(_panel_expr(dash, "Engine connected (every replica and worker)", "min"), "engine")
        assert connected == {(f"e{i}",): 1.0 for i in range(_N_ENGINES)}
        # Lookups are each process's own: the panel sums them. Its aggregation over the
        # counters themselves (not their rate) gives every lookup sent, once.
        lookups = _panel_expr(dash, "Lookups / s", "kvevents_lookups_total")
        counted = re.sub(r"rate\((kvevents_lookups_total\{[^}]*\})\[[^\]]+\]\)", r"\1", lookups)
        assert counted != lookups
        assert by(counted, "api") == {("lookup",): float(sent)}

        # What the dashboard used to ask: one copy per process.
        old_up = value('sum(kvevents_engine_up{engine=~".*"})')
        old_resident = by("sum by (engine, tier) (kvevents_resident_blocks)", "engine", "tier")
        assert old_up == 4.0 * processes
        assert old_resident == {k: v * processes for k, v in resident.items()}
        assert value("sum(kvevents_index_entries)") == blocks * processes
    finally:
        prom.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for pub in pubs:
            pub.pub.shutdown(0.5)
