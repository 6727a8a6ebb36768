"""The documentation matches the code, both ways.

Code -> docs: the built site's reference pages (generated at build time by
docs/gen_reference.py) name every command and flag of ``kvevents`` (with each
``serve`` flag's environment variable and config key), every setting, every HTTP path
and method of the app's OpenAPI document, and every metric family the aggregator's
registry builds. The expectations here are read from the code independently of the
generator, so a generator that skipped an argument group, a setting without a flag or a
collector's families fails.

Docs -> code: the reference pages name nothing the code lacks, and neither do the
hand-written pages (docs/*.md, README.md, benchmarks/README.md): every ``kvevents``
flag, ``KVEVENTS_*`` variable, config key in a TOML example, HTTP path and metric name
they mention exists; a benchmark command's flags exist in its script.
"""

from __future__ import annotations

import argparse
import ast
import functools
import html as htmllib
import re
import tomllib
from pathlib import Path

import pytest

from docs_build import DOCS, ROOT, build_site, generator

HAND_WRITTEN = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
BENCH_README = ROOT / "benchmarks" / "README.md"

# Flags of other programs that the pages show in their own command lines.
OTHER_PROGRAMS_FLAGS = {
    # vllm serve / python -m vllm.entrypoints.openai.api_server
    "--kv-events-config", "--kv-transfer-config", "--enable-prefix-caching",
    "--enable-prompt-tokens-details", "--model", "--data-parallel-size", "--num-gpu-blocks-override",
    "--chat-template", "--chat-template-content-format", "--trust-request-chat-template",
    "--exclude-tools-when-tool-choice-none", "--enable-scale-out", "--enable-tower-connector-lora",
    # vllm bench serve's dataset flags (bench_gateway.py --vllm-bench-args)
    "--dataset-name", "--num-prompts", "--random-input-len", "--random-output-len", "--random-prefix-len",
    # pip, docker, kubectl, curl, mkdocs, pytest, make
    "--index-url", "--target", "--build", "--no-deps", "--strict", "--upgrade",
    # vllm serve's model naming and cache layout; kubectl create secret; huggingface-cli
    "--served-model-name", "--block-size", "--from-literal", "--local-dir",
    # vllm serve's LoRA adapters
    "--enable-lora", "--lora-modules",
    # vllm-router's PD mode (bench_pd.py passes them as f"--{role}")
    "--prefill", "--decode",
}
# Paths of an engine's own HTTP server that the pages mention (vLLM's, not ours).
ENGINE_PATHS = {"/tokenize", "/metrics/", "/health", "/v1/chat/completions/render"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return build_site(tmp_path_factory.mktemp("docs") / "site")


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page (tags dropped, entities decoded)."""
    raw = (site / page / "index.html").read_text()
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S)
    main = re.search(r'<article\b.*?</article>', raw, re.S)
    text = re.sub(r"<[^>]+>", " ", main.group(0) if main else raw)
    return htmllib.unescape(text)


def sections(text: str, heading: str) -> dict[str, str]:
    """Split a page's text at lines that start with ``heading`` (e.g. "kvevents ")."""
    out: dict[str, str] = {}
    parts = re.split(rf"\n\s*({re.escape(heading)}[a-z]*)\s*¶?\s*\n", "\n" + text)
    for i in range(1, len(parts) - 1, 2):
        out[parts[i].strip()] = parts[i + 1]
    return out


# ---------------------------------------------------------------- what the code has

def parsers() -> dict[str, argparse.ArgumentParser]:
    from kvevents.cli.main import build_parser

    top = build_parser()
    out = {"kvevents": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({f"kvevents {name}": p for name, p in action.choices.items()})
    return out


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if not isinstance(a, argparse._HelpAction)
            for s in a.option_strings if s.startswith("--")}


def all_flags() -> set[str]:
    return set().union(*(flags_of(p) for p in parsers().values())) | {"--help"}


def settings_fields():
    from kvevents.service.settings import AggregatorSettings

    return AggregatorSettings.model_fields


def setting_keys() -> set[str]:
    keys = set()
    for name, f in settings_fields().items():
        keys.add(name)
        if f.validation_alias is not None and hasattr(f.validation_alias, "choices"):
            keys |= {str(c) for c in f.validation_alias.choices}
    return keys


def env_vars() -> set[str]:
    from kvevents.service import settings as s

    out = {"KVEVENTS_CONFIG"}
    for name in settings_fields():
        out.add(s.env_name(name))
        out |= set(s._LEGACY_ENV.get(name, ()))
    return out


def openapi_operations() -> set[tuple[str, str]]:
    from kvevents.api import create_app

    doc = create_app().openapi()
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in item}


def app_paths() -> set[str]:
    """Every path the app answers: OpenAPI's and the routes kept out of it (the page)."""
    from kvevents.api import create_app

    app = create_app()
    return {r.path for r in app.routes if getattr(r, "path", None)} | \
        {p for _, p in openapi_operations()}


@functools.cache
def registry_metrics() -> set[str]:
    """Families as scraped (counters with _total) from the registries ``kvevents serve``
    builds: an app's, its lifespan run (the aggregator with one engine configured, its
    gateway, and a DNS discovery source asking a closed port on 127.0.0.1), and the
    ``--workers`` supervisor's collector over a board of two workers."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from kvevents.api import create_app
    from kvevents.cli.worker_app import WorkerSeries
    from kvevents.cli.worker_board import WorkerBoard
    from kvevents.demo.fleet import free_port
    from kvevents.service.settings import AggregatorSettings

    registry = CollectorRegistry()
    app = create_app(AggregatorSettings(engines=("e0=tcp://127.0.0.1:9",), discover_dns=("engines.invalid",),
                                        dns_server=f"127.0.0.1:{free_port()}"), registry=registry)

    async def served() -> list:
        async with app.router.lifespan_context(app):
            return list(registry.collect())
    families = asyncio.run(served())
    supervisor = CollectorRegistry(auto_describe=False)
    supervisor.register(WorkerSeries(WorkerBoard(2, "test")))
    families += supervisor.collect()
    return {f.name + ("_total" if f.type == "counter" else "") for f in families}


#: prometheus_client's metric classes and collector families, by the name code calls.
METRIC_CONSTRUCTORS = {"Counter", "Gauge", "Histogram", "Summary", "CounterMetricFamily",
                       "GaugeMetricFamily", "HistogramMetricFamily", "SummaryMetricFamily",
                       "GaugeHistogramMetricFamily", "UnknownMetricFamily"}


def source_metrics() -> dict[str, str]:
    """Every ``kvevents_*`` family the product's source defines (a metric class or a
    collector family made with a literal name), as scraped, with the file defining it;
    the simulated engine's (``kvevents/sim/``, vLLM's stand-in) are not the product's."""
    out = {}
    for path in sorted((ROOT / "kvevents").rglob("*.py")):
        if "sim" in path.relative_to(ROOT / "kvevents").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            first = node.args[0]
            if func in METRIC_CONSTRUCTORS and isinstance(first, ast.Constant) \
                    and isinstance(first.value, str) and first.value.startswith("kvevents_"):
                name = first.value
                if func.startswith("Counter"):
                    name = name.removesuffix("_total") + "_total"
                out[name] = str(path.relative_to(ROOT))
    return out


# ---------------------------------------------------------------- code -> reference

def serve_field(dest: str) -> str | None:
    """The setting a ``serve`` flag sets: its dest is the field's name or an accepted
    old name, singular or plural (``--endpoint``: ``endpoints`` -> ``engines``)."""
    fields = settings_fields()
    for candidate in (dest, dest + "s"):
        for name, f in fields.items():
            choices = getattr(f.validation_alias, "choices", ())
            if candidate == name or candidate in map(str, choices):
                return name
    return None


def cli_sections(site: Path) -> dict[str, str]:
    """The CLI reference's text per command, split at its h2 headings (ids
    ``kvevents``, ``kvevents-serve``, ...)."""
    raw = (site / "reference/cli/index.html").read_text()
    raw = re.search(r"<article\b.*?</article>", raw, re.S).group(0)
    parts = re.split(r'<h2 id="([^"]+)"', raw)
    return {parts[i].replace("-", " "): htmllib.unescape(re.sub(r"<[^>]+>", " ", parts[i + 1]))
            for i in range(1, len(parts), 2)}


def test_cli_reference_has_every_command_flag_variable_and_key(site):
    from kvevents.service import settings as s

    secs = cli_sections(site)
    cmds = parsers()
    assert set(secs) == set(cmds), f"commands in the page {sorted(secs)} != code {sorted(cmds)}"
    for name, parser in cmds.items():
        body = secs[name]
        for flag in flags_of(parser):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", body), \
                f"{name} {flag} is missing from the CLI reference"
        documented = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", body))
        # Help texts may name another command's flag (or vLLM's), never an unknown one.
        unknown = documented - all_flags() - OTHER_PROGRAMS_FLAGS
        assert not unknown, f"{name}: the reference names {unknown}"
        if name == "kvevents serve":
            for a in parser._actions:
                field = serve_field(a.dest) if a.option_strings else None
                if field is None:
                    continue
                assert s.env_name(field) in body and f" {field} " in f" {body} ", \
                    f"{a.option_strings}: variable {s.env_name(field)} / key {field} missing"


def test_every_serve_flag_is_a_setting():
    """Each ``serve`` flag (but --config, --help) sets one AggregatorSettings field, so
    its variable and config key exist: what the CLI reference promises."""
    serve = parsers()["kvevents serve"]
    orphans = [a.option_strings for a in serve._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)
               and a.dest != "config" and serve_field(a.dest) is None]
    assert not orphans, f"serve flags with no setting: {orphans}"


def test_settings_reference_has_every_setting(site):
    text = page_text(site, "reference/settings")
    for key in setting_keys():
        assert re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", text), f"setting {key} missing"
    for var in env_vars():
        assert var in text, f"variable {var} missing from the settings reference"
    named = set(re.findall(r"\bKVEVENTS_[A-Z0-9_]+\b", text))
    assert named <= env_vars(), f"the settings reference names unknown variables {named - env_vars()}"


def test_http_reference_matches_the_openapi_document(site):
    text = page_text(site, "reference/http")
    documented = set(re.findall(r"\b(GET|POST|PUT|PATCH|DELETE)\s+(/[^\s¶]*)", text))
    ops = openapi_operations()
    assert ops <= documented, f"missing from the HTTP reference: {sorted(ops - documented)}"
    assert documented <= ops, f"the HTTP reference names {sorted(documented - ops)}"


def test_metrics_reference_matches_the_registry(site):
    text = page_text(site, "reference/metrics")
    documented = set(re.findall(r"\bkvevents_[a-z0-9_]+\b", text))
    metrics = registry_metrics()
    assert metrics <= documented, f"missing from the metrics reference: {sorted(metrics - documented)}"
    assert documented <= metrics, f"the metrics reference names {sorted(documented - metrics)}"
    # Labels as scraped from an aggregator that applied a real publisher's batch, and as
    # the discovery and supervisor collectors declare them.
    for name, labels in (("kvevents_events_applied_total", "engine, model_name, tier, type"),
                         ("kvevents_event_lag_seconds", "engine, model_name"),
                         ("kvevents_refused_events_total", "engine, model_name, reason"),
                         ("kvevents_discovery_query_failures_total", "origin, query, reason"),
                         ("kvevents_worker_restarts_total", "worker")):
        assert re.search(rf"{name}\s+\w+\s+{re.escape(labels)}\s", text), f"{name}: labels {labels} missing"
    # Each family in the section of what exports it.
    heads = ["Every aggregator", "With discovery sources", "With --workers N", "The Grafana dashboard"]
    flat = " ".join(text.split())  # the page's tags became spaces
    at = [flat.index(h) for h in heads]
    assert at == sorted(at), at
    named = [set(re.findall(r"\bkvevents_[a-z0-9_]+\b", flat[a:b])) for a, b in zip(at, at[1:])]
    assert named[1] == {"kvevents_discovery_errors_total", "kvevents_discovery_query_failures_total"}
    assert named[2] == {"kvevents_workers", "kvevents_worker_ready", "kvevents_worker_restarts_total",
                        "kvevents_worker_scraped"}
    assert "kvevents_lookups_total" in named[0] and not named[0] & (named[1] | named[2])


def test_every_metric_the_source_defines_is_exported_and_in_the_reference(site):
    """A family defined anywhere in the product (a new collector, a new module) that
    neither reaches the registries ``kvevents serve`` builds nor the reference fails
    here, whoever forgot to wire or document it."""
    defined = source_metrics()
    assert len(defined) > 50 and {"kvevents_discovery_errors_total", "kvevents_workers",
                                  "kvevents_gateway_requests_total"} <= set(defined)
    unexported = {n: f for n, f in defined.items() if n not in registry_metrics()}
    assert not unexported, f"defined but in no registry kvevents serve builds: {unexported}"
    documented = set(re.findall(r"\bkvevents_[a-z0-9_]+\b", page_text(site, "reference/metrics")))
    missing = {n: f for n, f in defined.items() if n not in documented}
    assert not missing, f"missing from the metrics reference: {missing}"


def test_python_reference_renders_each_documented_name(site):
    PYTHON_API = generator().PYTHON_API
    raw = (site / "reference/python/index.html").read_text()
    for _, names in PYTHON_API:
        for name in names:
            assert f'id="{name}"' in raw, f"{name} was not rendered from its docstring"
    assert not re.search(r":(meth|class|func|attr):<code>", raw), "a Sphinx role was left raw"


# ---------------------------------------------------------------- hand-written -> code

def _strip_urls(text: str) -> str:
    return re.sub(r"https?://\S+", " ", text)


def mentioned(pattern: str, files: list[Path]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in files:
        for m in re.finditer(pattern, _strip_urls(f.read_text())):
            out.setdefault(m.group(0), set()).add(str(f.relative_to(ROOT)))
    return out


def script_source(name: str) -> str:
    """The text of a script a page runs (``benchmarks/bench_x.py``, ``check.sh``)."""
    path = ROOT / name
    if not path.is_file():
        found = [p for p in ROOT.glob(f"**/{Path(name).name}") if ".venv" not in p.parts]
        assert found, f"a page runs {name}, which does not exist"
        path = found[0]
    text = path.read_text()
    # Flags may come from a sibling module it imports (benchmarks/kvtrace.py's trace flags).
    for mod in set(re.findall(r"^\s*(?:from|import)\s+(?:benchmarks\.)?(\w+)", text, re.M)):
        sibling = path.parent / f"{mod}.py"
        if sibling.is_file() and sibling != path:
            text += sibling.read_text()
    return text


def test_hand_written_pages_name_only_existing_flags():
    """A flag on a line that runs a script (``benchmarks/bench_x.py``, ``check.sh``) may
    be that script's; any other must be a kvevents command's, or another program's
    from the short list above."""
    known = all_flags() | OTHER_PROGRAMS_FLAGS
    bad = {}
    for f in HAND_WRITTEN:
        for line in f.read_text().splitlines():
            scripts = re.findall(r"[\w./-]*\w\.(?:py|sh)\b", line)
            sources = "".join(script_source(x) for x in scripts if not x.startswith(("kvevents/", "connector/", "tests/")))
            line = re.sub(r"<!-- kvevents-flags: .*? -->", "", line)  # generated tables
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                if flag in known or f'"{flag}"' in sources or f"'{flag}'" in sources \
                        or f" {flag})" in sources or f"{flag})" in sources:
                    continue
                bad.setdefault(flag, set()).add(str(f.relative_to(ROOT)))
    assert not bad, f"flags that no kvevents command has: {bad}"


def test_benchmark_commands_use_their_scripts_flags():
    bad = {}
    for f in [BENCH_README, DOCS / "benchmarks.md", ROOT / "README.md"]:
        for line in f.read_text().splitlines():
            line = re.sub(r'"[^"]*"', "VALUE", line)  # a quoted value (another program's flags)
            for script, args in re.findall(r"\bbenchmarks/(\w+\.py)((?:\s+--?[\w-]+(?:[ =][^\s`-][^\s`]*)?)*)", line):
                src = script_source(f"benchmarks/{script}")
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", args):
                    if f'"{flag}"' not in src and f"'{flag}'" not in src:
                        bad.setdefault(f"{script} {flag}", set()).add(f.name)
    assert not bad, f"benchmark flags their scripts do not take: {bad}"


def test_hand_written_pages_name_only_existing_variables():
    known = env_vars()
    found = mentioned(r"\bKVEVENTS_[A-Z0-9_]*[A-Z0-9]\b", HAND_WRITTEN + [BENCH_README])
    bench = "".join(p.read_text() for p in (ROOT / "benchmarks").rglob("*.py"))
    # A benchmark's own knobs (KVEVENTS_BENCH_*) live in its script.
    bad = {v: fs for v, fs in found.items() if v not in known and f'"{v}"' not in bench}
    assert not bad, f"variables that are no setting: {bad}"


def test_hand_written_config_examples_use_existing_keys():
    """Every TOML block's keys are settings (or their accepted old names); an
    ``[[engines]]`` table's keys are EngineSpec's fields; every "config key `x`"."""
    import dataclasses

    from kvevents.engines import EngineSpec

    engine_keys = {f.name for f in dataclasses.fields(EngineSpec)}
    keys = setting_keys()
    seen = 0
    for f in HAND_WRITTEN:
        text = f.read_text()
        for block in re.findall(r"```toml\n(.*?)```", text, re.S):
            seen += 1
            data = tomllib.loads(block)
            assert set(data) <= keys, f"{f.name}: unknown config keys {set(data) - keys}"
            for table in data.get("engines", []):
                if isinstance(table, dict):
                    assert set(table) <= engine_keys, f"{f.name}: unknown engine keys {set(table) - engine_keys}"
        for key in re.findall(r"config key `([a-z_]+)`", text):
            assert key in keys, f"{f.name}: config key {key} is no setting"
    assert seen, "no page shows a TOML config file"


def _path_matches(path: str, routes: set[str]) -> bool:
    for route in routes:
        pattern = re.sub(r"\\\{[^}]+\\\}", r"[^/]+", re.escape(route))
        if re.fullmatch(pattern, path):
            return True
    return False


def test_hand_written_pages_name_only_existing_http_paths():
    routes = app_paths()
    found = mentioned(r"(?<![\w.:/])/(?:v1/[A-Za-z0-9_{}./-]*[A-Za-z0-9_}]|healthz|readyz|metrics|docs)\b",
                      HAND_WRITTEN + [BENCH_README])
    bad = {}
    for path, files in found.items():
        path = re.sub(r"\.{3}$", "", path)
        if path in ENGINE_PATHS or _path_matches(path, routes):
            continue
        bad[path] = files
    assert not bad, f"HTTP paths the app does not serve: {bad}"


def test_hand_written_pages_name_only_existing_metrics():
    metrics = registry_metrics()
    sim_source = (ROOT / "kvevents/sim/metrics.py").read_text()
    bad = {}
    for name, files in mentioned(r"(?<![\w.-])(?:kvevents_[a-z0-9_]*[a-z0-9]|vllm:[a-z0-9_]*[a-z0-9])\b",
                                 HAND_WRITTEN + [BENCH_README]).items():
        if name in metrics or re.sub(r"_(bucket|sum|count)$", "", name) in metrics:
            continue
        base = re.sub(r"_total$", "", name)
        if name.startswith(("vllm:", "kvevents_sim_")) and (base in sim_source or name in sim_source):
            continue  # a simulated engine's (vLLM's names): kvevents/sim/metrics.py
        bad[name] = files
    assert not bad, f"metrics nobody exports: {bad}"


def test_benchmarks_readme_names_only_existing_flags():
    """Flags in benchmarks/README.md outside a script's command line still belong to
    something real: a kvevents command, a benchmark script, or another program above."""
    sources = "".join(p.read_text() for p in (ROOT / "benchmarks").rglob("*.py"))
    known = all_flags() | OTHER_PROGRAMS_FLAGS
    bad = {flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _strip_urls(BENCH_README.read_text()))
           if flag not in known and f'"{flag}"' not in sources and f"'{flag}'" not in sources}
    assert not bad, f"benchmarks/README.md names flags nothing takes: {sorted(bad)}"


def test_flag_tables_in_hand_written_pages_are_the_parsers(site):
    """A ``<!-- kvevents-flags: ... -->`` marker becomes the parser's own rows: the
    Discovery page lists every flag of serve's discovery group, the Routing page every
    ``--route-`` flag, and no marker is left in any page."""
    serve = parsers()["kvevents serve"]
    discovery = next(g for g in serve._action_groups if g.title == "discovery")
    pages = {
        "discovery": {s for a in discovery._group_actions for s in a.option_strings if s.startswith("--")},
        "routing": {s for s in flags_of(serve) if s.startswith("--route-")},
    }
    for page, flags in pages.items():
        assert flags, page
        text = page_text(site, page)
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{page}: {flag} missing"
    for html in site.rglob("*.html"):
        assert "kvevents-flags:" not in html.read_text(), f"{html}: a flag marker was not replaced"


#: How the work was tracked, which readers never see: "issue 21", "issues 20 and 21",
#: "#32", work items such as "P3".
_WORK_REFERENCES = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&/(])(?<!\]: )#\d+(?![\w-])|\bP\d{1,2}\b")


def test_no_page_names_an_issue_or_work_item():
    pages = HAND_WRITTEN + [BENCH_README, ROOT / "CHANGELOG.md", ROOT / "deploy/kubernetes/README.md"]
    found = {}
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks: commands
        hits = _WORK_REFERENCES.findall(text)
        if hits:
            found[str(page.relative_to(ROOT))] = hits
    assert not found, found
    assert _WORK_REFERENCES.search("the ingest lane (issue 21)")
    assert _WORK_REFERENCES.search("ingest 0.96 ms (benchmarks/README.md, P3)")
    assert _WORK_REFERENCES.search("fixed in #32.")
    assert not _WORK_REFERENCES.search("p50 / p99 0.42 ms; [link](#the-gateways-cost)")
    assert not _WORK_REFERENCES.search("[0.2.0]: #020---2026-11-25")
