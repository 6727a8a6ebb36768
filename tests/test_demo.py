"""``kvevents demo`` end to end, as a newcomer runs it, with real Prometheus and Chromium.

One short demo with its defaults (2 engine processes with their OpenAI front, the
aggregator as their gateway, the demo as an OpenAI client) serves three checks: the
summary says every request was served, nothing was lost and the index equals the
engines' caches; a real Prometheus scraping the demo's aggregator and engines evaluates
every Grafana panel's PromQL, and every metric a panel names has data (but those that
only count trouble); headless Chromium shows every engine on the live page, and its
screenshot is kept under ``artifacts/``. Then one shorter run per policy the demo routes itself (``kv``,
``round_robin``, ``least_loaded``, over engine RPC) checks its summary, and the
gateway client's failure accounting is checked against answers made up for it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from browser import READ_PAGE, Browser
from support import PrometheusServer, free_port, require_binary, wait_until

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboard/grafana/dashboards/kvevents.json"
ARTIFACTS = ROOT / "artifacts"
# Grafana's variables as Grafana substitutes them with "All" selected.
_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
         "$model": ".*", "$engine": ".*", "$instance": ".*"}
_METRIC = re.compile(r"\b(?:kvevents_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for q in [p, *p.get("panels", [])]:
            for t in q.get("targets", []):
                expr = t["expr"]
                for var, value in _VARS.items():
                    expr = expr.replace(var, value)
                out.append((q["title"], expr))
    return out


@pytest.mark.timeout(240)
def test_demo_runs_a_live_fleet_exactly_with_prometheus_and_the_page(tmp_path):
    prometheus_bin = require_binary("prometheus")
    chromium_bin = require_binary("chromium")
    port = free_port()
    targets = tmp_path / "targets.json"
    summary_path = tmp_path / "summary.json"
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "demo", "--engines", "2", "--requests", "60",
         "--duration", "20", "--port", str(port), "--gpu-blocks", "1024", "--cpu-blocks", "512",
         "--summary-json", str(summary_path), "--prometheus-targets", str(targets), "--no-progress",
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    prom = browser = None
    try:
        assert wait_until(targets.exists, 90, 0.2), "the demo never started its fleet"
        (tmp_path / "prom").mkdir()
        prom = PrometheusServer(tmp_path / "prom", {}, prometheus_bin, file_sd=str(targets))
        prom.wait_ready()
        browser = Browser(chromium_bin, f"http://127.0.0.1:{port}/", tmp_path / "profile")
        tools = browser.tools

        def page_ready() -> bool:
            try:
                page = tools.evaluate(READ_PAGE)
            except RuntimeError:  # the page is still loading
                return False
            return (len(page["rows"]) == 2 and page["lookups"] > 0
                    and all(r["tiers"].get("GPU", 0) > 0 for r in page["rows"]))

        assert wait_until(page_ready, 30, 0.5), tools.evaluate(READ_PAGE)
        ARTIFACTS.mkdir(exist_ok=True)
        browser.screenshot(ARTIFACTS / "demo_page.png")
        page = tools.evaluate(READ_PAGE)
        assert sorted(r["engine"] for r in page["rows"]) == ["engine-0", "engine-1"]
        assert all(r["status"] == "live" for r in page["rows"])

        # Every panel's PromQL runs on the real Prometheus scraping the demo, and every
        # metric family a panel uses has samples from the demo's real processes.
        def scraped() -> bool:
            up = prom.query("up")
            return len(up) == 3 and all(r["value"][1] == "1" for r in up) and bool(
                prom.query('vllm:prompt_tokens_by_source_total{source="local_cache_hit"} > 0'))

        assert wait_until(scraped, 60, 0.5), prom.query("up")
        # Every query is evaluated at this instant, while the fleet runs: the demo may
        # end (and its series go stale) while the queries are still being asked.
        at = time.time()

        def query_at(promql: str) -> list:
            r = httpx.get(f"{prom.url}/api/v1/query", params={"query": promql, "time": at}, timeout=10)
            body = r.json()
            assert body.get("status") == "success", (promql, body)  # Prometheus's error if invalid
            return body["data"]["result"]

        queries = panel_queries()
        assert len(queries) > 20
        names = set()
        for title, expr in queries:
            query_at(expr)
            names.update(_METRIC.findall(expr))
        # (kvevents_worker_*: the --workers N supervisor's, absent from the demo's one
        # process; the prefill/decode hops' histograms: the demo's fleet is not
        # disaggregated, tests/test_dashboard.py's is)
        missing = {name for name in names if not name.startswith(("kvevents_worker_", "kvevents_gateway_pd_"))
                   and not query_at(f'{{__name__="{name}"}}')}
        assert not missing, f"panel metrics with no data from the demo: {sorted(missing)}"
        out, _ = demo.communicate(timeout=180)
    finally:
        if browser is not None:
            browser.close()
            shutil.rmtree(tmp_path / "profile", ignore_errors=True)
        if prom is not None:
            prom.close()
        if demo.poll() is None:
            demo.terminate()
            demo.wait(30)
    assert demo.returncode == 0, out
    s = json.loads(summary_path.read_text())
    check_summary(s, out, "gateway", 2, 60)
    assert s["hit_tokens"]["CPU"] > 0 and s["offload"]["loaded_bytes"] > 0, s  # the CPU tier served hits
    # No process of the demo outlives it.
    assert not subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True).stdout


def check_summary(s: dict, out: str, policy: str, engines: int, requests: int) -> None:
    """What every healthy demo's summary says, and what its policy adds."""
    assert s["engines"] == engines and s["policy"] == policy and s["requests"] == requests, s
    assert s["failed_requests"] == 0 and s["rejected_requests"] == 0, s
    assert s["events"]["lost"] == 0 and s["index_mismatches"] == 0 and s["kv_mismatches"] == 0, s
    assert s["events"]["published"] == s["events"]["applied"] > 0, s
    assert s["hit_tokens"]["GPU"] > 0 and s["prompt_tokens"] > s["computed_prefill_tokens"], s
    per_engine = s["requests_per_engine"]
    assert sorted(per_engine) == [f"engine-{i}" for i in range(engines)], s
    assert sum(per_engine.values()) == requests, s
    if policy == "gateway":
        # Every request served through the gateway, spread over the engines, with what
        # the engines reported (usage at the client, their /metrics, the gateway's count)
        # agreeing, and the gateway's prediction close to it.
        assert min(per_engine.values()) >= requests / engines / 4, per_engine
        assert s["hit_tokens_source"] == "engine /metrics", s
        hits = s["hit_tokens"]["GPU"] + s["hit_tokens"]["CPU"]
        assert hits == s["reported_cached_tokens"] > 0, s
        g = s["gateway"]
        assert g["usage_reports"] == requests and g["reported_cached_tokens"] == hits, g
        assert g["predicted_cached_tokens"] > 0, g
        assert 0.5 <= g["predicted_cached_tokens"] / g["reported_cached_tokens"] <= 2.0, g
        assert 0 < s["ttft_seconds"]["p50"] <= s["ttft_seconds"]["p99"] <= s["e2e_seconds"]["p99"] < 60, s
        assert f"OK: {requests} requests served through the gateway, nothing lost" in out
        for row in ("failed requests", "TTFT p50 / p99 (wall, client via gateway)",
                    "gateway predicted / reported cached", "hit tokens GPU / CPU (engine /metrics)"):
            assert row in out, out
    else:
        assert all(n > 0 for n in per_engine.values()), per_engine
        assert s["route_errors"] == 0, s
        assert "OK: nothing lost" in out and "TTFT p50 / p99 (simulated)" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["kv", "round_robin", "least_loaded"])
def test_each_rpc_policy_serves_every_request_exactly(tmp_path, policy):
    """The policies the demo routes itself, over engine RPC (the default, the gateway,
    is the run above)."""
    summary_path = tmp_path / "summary.json"
    r = subprocess.run(
        [sys.executable, "-m", "kvevents.cli", "demo", "--engines", "2", "--requests", "24",
         "--duration", "3", "--policy", policy, "--port", str(free_port()), "--no-progress",
         "--summary-json", str(summary_path), "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=110)
    assert r.returncode == 0, r.stdout
    check_summary(json.loads(summary_path.read_text()), r.stdout, policy, 2, 24)


def test_the_client_counts_every_failed_request():
    """Answers made up for the gateway client: only a whole 200 stream with the engine
    header, a usage chunk and [DONE] is served; a prompt too long is rejected, not failed."""
    from kvevents.demo.openai_client import GatewayDriver
    from kvevents.demo.workload import DemoRequest

    def sse(*docs: object) -> bytes:
        return b"".join(b"data: " + (d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n\n"
                        for d in docs)

    usage = {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}, "choices": []}
    text = {"choices": [{"index": 0, "text": " a"}]}
    head = {"x-kvevents-engine": "engine-1", "content-type": "text/event-stream"}
    answers = {
        0: httpx.Response(200, headers=head, content=sse(text, usage, b"[DONE]")),
        1: httpx.Response(200, headers=head, content=sse(text, usage)),  # cut before [DONE]
        2: httpx.Response(200, headers=head, content=sse(text, b"[DONE]")),  # no usage chunk
        3: httpx.Response(503, json={"error": {"message": "busy", "code": None}}),
        4: httpx.Response(400, json={"error": {"message": "too long", "code": "context_length_exceeded"}}),
    }
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/v1/completions" and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == "sim"
        sent.append(body["max_tokens"])
        if body["prompt"][0] == 5:
            raise httpx.ConnectError("refused")
        return answers[body["prompt"][0]]

    fleet = SimpleNamespace(engines=[], url="http://gateway.test", check_alive=lambda: None)
    requests = [DemoRequest(f"r{i}", i * 0.01, [i, 7, 7], 4) for i in range(6)]
    driver = GatewayDriver(fleet, requests, 0.05, progress=False, clients=2,  # type: ignore[arg-type]
                           transport=httpx.MockTransport(answer))
    try:
        driver.run()
    finally:
        driver.close()
    r = driver.results
    assert sent == [4] * 6 and all(o.done for o in r.values())
    assert r["r0"].failed is None and (r["r0"].engine, r["r0"].prompt_tokens, r["r0"].cached_tokens) == ("engine-1", 5, 3)
    assert r["r0"].ttft is not None and r["r0"].e2e is not None
    assert [r[f"r{i}"].failed for i in range(1, 6)] == [
        "stream ended before [DONE]", "no usage chunk", "HTTP 503", None, "ConnectError"]
    assert r["r4"].rejected == "too long"


def test_free_ports_are_not_handed_out_twice():
    """A fleet draws all its ports before any child binds them: a port drawn again
    before it is bound would make two engines bind one port (an engine exiting at
    start). 300 draws from the ~12,700 ports below the ephemeral range would repeat one
    about 97% of the time if each draw only checked that the port was free."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
