"""``kvevents demo`` end to end, as a newcomer runs it, with real Prometheus and Chromium.

One short demo (2 engine processes, the aggregator, the router) serves three checks:
the summary says nothing was lost and the index equals the engines' caches; a real
Prometheus scraping the demo's aggregator and engines evaluates every Grafana panel's
PromQL, and every metric a panel names has data; headless Chromium shows every engine
on the live page, and its screenshot is kept under ``artifacts/``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

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
        missing = {name for name in names if not query_at(f'{{__name__="{name}"}}')}
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
    assert s["engines"] == 2 and s["policy"] == "kv" and s["requests"] == 60, s
    assert s["events"]["lost"] == 0 and s["index_mismatches"] == 0 and s["kv_mismatches"] == 0, s
    assert s["events"]["published"] == s["events"]["applied"] > 0, s
    assert s["hit_tokens"]["GPU"] > 0 and s["prompt_tokens"] > s["computed_prefill_tokens"], s
    assert s["hit_tokens"]["CPU"] > 0 and s["offload"]["loaded_bytes"] > 0, s  # the CPU tier served hits
    assert "OK: nothing lost" in out
    # No process of the demo outlives it.
    assert not subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True).stdout
