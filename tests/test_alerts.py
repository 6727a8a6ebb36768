"""The alerting rules (``dashboard/prometheus/alerts.yml``) and their runbooks.

* Prometheus' own tools: ``promtool check rules`` accepts the file, and ``promtool test
  rules`` runs ``alerts_test.yml``: every alert fires on the series that mean it, with
  its labels and rendered annotations, and not where it should not.
* Every alert has a unit test, a severity, a summary, and a ``runbook_url`` to a section
  of the docs site's Runbooks page that exists and says what the alert means, how to
  confirm it and what to do.
* Every metric an expression names is one ``kvevents serve`` exports (the metrics
  reference's families, generated from the registries the aggregator builds), and every
  label it groups or selects by is one that family (or Prometheus' scrape) carries.
* Per-engine series come once per aggregator process (every worker of every replica
  follows every engine): no expression adds those copies up (the dashboard's check).
* The PrometheusRule of ``deploy/kubernetes/monitoring`` holds the same rules.
* In a real Prometheus, loading these rules, scraping a real aggregator: an engine's
  publisher going away fires ``KveventsEngineDown``; an engine that reuses none of the
  prefix the index predicted for it (what a tokenizer that differs from the engine's
  looks like from the gateway) fires ``KveventsCachedTokensDrift``.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from support import ServerThread, free_port, require_binary, send_answer, stop_process, wait_until

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "dashboard" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "dashboard" / "prometheus" / "alerts_test.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
#: Where runbook_url points: the docs site as ``make docs`` serves it (docs/runbooks.md
#: says how to point it at a hosted site).
DOCS_SITE = "http://127.0.0.1:8000/"
#: Labels Prometheus' scrape adds (static configs, Kubernetes discovery, the operator).
SCRAPE_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint"}
#: PromQL words that look like names: functions, operators, keywords.
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                 "unless", "bool", "offset"}


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _promtool() -> str:
    prometheus = require_binary("prometheus")  # promtool ships in the same package
    return shutil.which("promtool") or str(Path(prometheus).with_name("promtool"))


def test_promtool_checks_the_rules():
    r = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_promtool_unit_tests_of_every_alert():
    r = subprocess.run([_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True,
                       text=True, timeout=120, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
             if t["exp_alerts"]}
    assert fired == {r["alert"] for r in _rules()}, "every alert has a test in which it fires"


def test_the_unit_tests_can_fail(tmp_path):
    """promtool test rules is not vacuous: the same tests against rules whose engine-down
    threshold never holds fail."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == "KveventsEngineDown":
                rule["expr"] = rule["expr"].replace("== 0", "== 2")
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "KveventsEngineDown" in r.stdout + r.stderr


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (MkDocs' default): what an anchor on the site is."""
    s = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", s)


def _runbook_sections() -> dict[str, str]:
    """The Runbooks page's ``## `` sections: anchor -> text."""
    out, name = {}, None
    for line in RUNBOOKS.read_text().splitlines():
        if line.startswith("## "):
            name = _slug(line[3:])
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def test_every_alert_has_a_runbook():
    sections = _runbook_sections()
    names = []
    for rule in _rules():
        name = rule["alert"]
        names.append(name)
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        url = rule["annotations"]["runbook_url"]
        assert url == f"{DOCS_SITE}runbooks/#{_slug(name)}", (name, url)
        text = sections.get(_slug(name))
        assert text is not None, f"{name}: no section in docs/runbooks.md"
        for part in ("**Means.**", "**Confirm.**", "**Do.**"):
            assert part in text, f"{name}: its runbook has no {part}"
    assert len(names) == len(set(names))
    # The page is on the site, and each alert's section is there in the rules' order.
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nextra_css:")[0])["nav"]
    assert "runbooks.md" in json.dumps(nav)
    alert_sections = [s for s in sections if s.startswith("kvevents")]
    assert alert_sections == [_slug(n) for n in names]


def _expr_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses: names in selectors and grouping
    clauses are labels; other identifiers that are not functions are metrics."""
    labels = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    for m in re.finditer(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(1)))
    stripped = re.sub(r"\{[^}]*\}", "", expr)
    stripped = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", stripped)
    stripped = re.sub(r'"[^"]*"', "", stripped)
    metrics = {m.group(1) for m in re.finditer(r"\b([a-zA-Z_:][\w:]*)\b(?!\s*\()", stripped)
               if m.group(1) not in _PROMQL_WORDS and not re.fullmatch(r"\d+[smhdwy]?", m.group(1))}
    return metrics, labels


def test_every_metric_and_label_is_one_the_aggregator_exports():
    import sys

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from ref_http_metrics import metric_families
    finally:
        sys.path.remove(str(ROOT / "docs"))
    families = {f["name"]: f for f in metric_families()}
    for rule in _rules():
        metrics, labels = _expr_names(rule["expr"])
        assert metrics, rule["alert"]
        carried = set(SCRAPE_LABELS) | {"worker", "le"}
        for name in metrics:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            fam = families.get(name) or families.get(base)
            assert fam is not None, f"{rule['alert']}: {name} is not in the metrics reference"
            carried |= set(fam["labels"])
        assert labels <= carried, (rule["alert"], sorted(labels - carried))
        for key in ("summary", "description"):
            used = set(re.findall(r"\$labels\.(\w+)", rule["annotations"][key]))
            assert used <= carried | labels, (rule["alert"], key, used)


def test_the_name_check_sees_what_it_should():
    metrics, labels = _expr_names(
        'sum by (engine) (rate(kvevents_gateway_requests_total{status=~"5.."}[5m])) '
        '/ on (engine) max(kvevents_engine_up) > 0.5 and time() - x_seconds > 30')
    assert metrics == {"kvevents_gateway_requests_total", "kvevents_engine_up", "x_seconds"}
    assert labels == {"engine", "status"}


def test_no_rule_adds_up_per_process_copies():
    from test_dashboard import per_process_copies, per_process_misuse

    copies = per_process_copies()
    problems = [(r["alert"], p) for r in _rules() for p in per_process_misuse(r["expr"], copies)]
    assert not problems, problems


def test_the_prometheus_rule_holds_the_same_rules():
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


# --- alerts firing in a real Prometheus ---------------------------------------------------

class _Engine:
    """An engine as the gateway sees it: a ZeroMQ publisher of KV events (our library's,
    as vLLM's wire) and an OpenAI server whose answers report ``cached_tokens`` =
    ``reuse`` x the prompt's length (0: it reused nothing of what it announced)."""

    def __init__(self, reuse: float = 1.0) -> None:
        from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher

        self.live, self.replay = free_port(), free_port()
        self.pub = ZmqEventPublisher(PublisherConfig(
            endpoint=f"tcp://*:{self.live}", replay_endpoint=f"tcp://*:{self.replay}"))
        self.requests = 0
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # /metrics, as the gateway polls it
                self._answer(b"")

            def do_POST(self) -> None:
                doc = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                engine.requests += 1
                n = len(doc["prompt"])
                self._answer(json.dumps({
                    "id": f"cmpl-{engine.requests}", "object": "text_completion",
                    "created": int(time.time()), "model": doc["model"],
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length",
                                 "logprobs": None}],
                    "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                              "prompt_tokens_details": {"cached_tokens": int(n * reuse)}},
                }).encode(), "application/json")

            def _answer(self, body: bytes, ctype: str = "text/plain") -> None:
                send_answer(self, 200, body, ctype)

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def spec(self, name: str, model: str):
        from kvevents.service.settings import EngineSpec

        return EngineSpec(name, f"tcp://127.0.0.1:{self.live}",
                          replay_endpoint=f"tcp://127.0.0.1:{self.replay}", model=model,
                          http=f"http://127.0.0.1:{self.http.server_port}")

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.pub.shutdown(0.5)


class _Prometheus:
    """A real Prometheus scraping ``target`` every second and evaluating ``rules`` every
    second."""

    def __init__(self, tmp_path: Path, target: str, rules: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "kvevents", "static_configs": [{"targets": [target]}]}],
        }))
        self._log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [require_binary("prometheus"), f"--config.file={cfg}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def query(self, promql: str) -> list[dict]:
        try:
            return httpx.get(f"{self.url}/api/v1/query", params={"query": promql},
                             timeout=2).json()["data"]["result"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def firing(self) -> list[dict]:
        try:
            alerts = httpx.get(f"{self.url}/api/v1/alerts", timeout=2).json()["data"]["alerts"]
        except (httpx.HTTPError, ValueError):
            return []
        return [a for a in alerts if a["state"] == "firing"]

    def close(self) -> None:
        stop_process(self.proc, self._log)


def _rules_without_waits(tmp_path: Path) -> Path:
    """alerts.yml with every ``for:`` removed (the expressions and windows untouched), so
    an alert fires at the first evaluation where its expression holds: the test sees the
    expressions work on real series without waiting minutes; the waits themselves are
    what alerts_test.yml checks."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    out = tmp_path / "alerts.yml"
    out.write_text(yaml.safe_dump(rules))
    return out


@pytest.mark.timeout(90)
def test_alerts_fire_in_a_real_prometheus(tmp_path):
    """Two engines serving model m. ``steady`` reports as cached what the index
    predicted; ``drifting`` announces the blocks of the prompt but reports 0 cached
    tokens for it. 28 requests with that prompt go through the gateway; then steady's
    publisher goes away. Expected, and nothing else of these two: the drift alert for
    drifting, the engine-down alert for steady."""
    from kvevents.api import create_app
    from kvevents.service.settings import AggregatorSettings
    from kvevents.wire.schema import BlockStored, KVEventBatch

    steady, drifting = _Engine(reuse=1.0), _Engine(reuse=0.0)
    settings = AggregatorSettings(engines=(steady.spec("steady", "m"), drifting.spec("drifting", "m")))
    prom, steady_up = None, True
    try:
        with ServerThread(create_app(settings)) as srv:
            def engines() -> dict:
                return {e["name"]: e for e in httpx.get(f"{srv.url}/v1/engines").json()["engines"]}

            assert wait_until(lambda: all(e["connected"] and e["gateway"]["reachable"]
                                          for e in engines().values()), 20, 0.1), engines()
            prom = _Prometheus(tmp_path, f"127.0.0.1:{srv.port}", _rules_without_waits(tmp_path))
            time.sleep(0.3)  # the subscriptions are in place (a missed batch is replayed anyway)
            prompt = list(range(64))
            drifting.pub.publish(KVEventBatch(time.time(), [
                BlockStored([1, 2, 3, 4], None, prompt, 16, None, "GPU", None)]))
            assert wait_until(lambda: engines()["drifting"]["last_seq"] == 0, 10, 0.1)

            def send(n: int) -> None:
                for _ in range(n):
                    r = httpx.post(f"{srv.url}/v1/completions", timeout=10, json={
                        "model": "m", "prompt": prompt + [7, 7], "max_tokens": 1})
                    assert r.status_code == 200, r.text

            # The counters are born with the first answers: a few first, then, a couple of
            # scrapes later, the 24 whose increase the rules see (>= 20 answers).
            assert wait_until(lambda: prom.query('up{job="kvevents"} == 1'), 30, 0.2), "never scraped"
            send(4)

            def scraped(name: str, at_least: float) -> bool:
                return bool(prom.query(f"sum({name}) >= {at_least}"))

            assert wait_until(lambda: scraped("kvevents_gateway_usage_reports_total", 4), 20, 0.2)
            send(24)
            assert drifting.requests >= 24, (drifting.requests, steady.requests)  # it holds the prefix

            def alerts() -> set[tuple[str, str]]:
                return {(a["labels"]["alertname"], a["labels"].get("engine", "")) for a in prom.firing()}

            assert wait_until(lambda: ("KveventsCachedTokensDrift", "drifting") in alerts(), 30, 0.5), \
                (alerts(), [line for line in httpx.get(f"{srv.url}/metrics").text.splitlines()
                            if "cached_tokens" in line or "usage_reports" in line])
            assert ("KveventsEngineDown", "steady") not in alerts()

            steady.pub.shutdown(0.5)  # its publisher goes away, as when the engine is killed
            steady_up = False
            assert wait_until(lambda: ("KveventsEngineDown", "steady") in alerts(), 30, 0.5), alerts()
            got = alerts()
            assert ("KveventsEngineDown", "drifting") not in got
            assert ("KveventsCachedTokensDrift", "steady") not in got
            (down,) = [a for a in prom.firing() if a["labels"]["alertname"] == "KveventsEngineDown"]
            assert down["labels"]["severity"] == "critical" and down["labels"]["model_name"] == "m"
            assert down["annotations"]["runbook_url"].endswith("#kveventsenginedown")
    finally:
        if prom is not None:
            prom.close()
        steady.http.shutdown()
        steady.http.server_close()
        if steady_up:
            steady.pub.shutdown(0.5)
        drifting.close()
