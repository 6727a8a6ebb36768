"""The HTTP and metrics references: the app's OpenAPI document, and the registries
``kvevents serve`` builds: an aggregator's with its gateway's and its discovery's
families, and the ``--workers`` supervisor's (plus the Grafana dashboard's rows and
panels).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ref_common import ROOT, cell, code

# ---------------------------------------------------------------- HTTP

def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    return str(schema.get("type", "any"))


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _schema_link(schema: dict[str, Any]) -> str:
    name = _schema_name(schema)
    if "$ref" in schema:
        return f"[`{name}`](#{_anchor(name)})"
    return code(name)


def openapi_document() -> dict[str, Any]:
    from kvevents.api import create_app

    return create_app().openapi()


def http_page() -> str:
    doc = openapi_document()
    lines = [
        "# HTTP reference",
        "",
        f"Generated from the app's own OpenAPI document ({doc['info']['title']} "
        f"{doc['info']['version']}) at every build of this site; a running aggregator serves",
        "the same document at `/openapi.json` and an explorer at `/docs`; the live page is",
        "`/` (HTML, not part of the API). Errors of the",
        "aggregator's own API are `{\"error\": \"...\", \"field\": \"...\"}` with a 4xx status;",
        "the OpenAI endpoints answer errors in OpenAI's shape. Examples are on",
        "[Following engines](../engines.md#querying-the-index), [Gateway](../gateway.md) and",
        "[Routing](../routing.md).",
        "",
        "| method | path | |",
        "|---|---|---|",
    ]
    ops = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            ops.append((path, method, op))
    for path, method, op in ops:
        title = op.get("summary") or op.get("operationId", "")
        dep = " (deprecated)" if op.get("deprecated") else ""
        anchor = "op-" + re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")
        lines.append(f"| {method.upper()} | [{code(path)}](#{anchor}) | {cell(title)}{dep} |")
    lines.append("")
    for path, method, op in ops:
        anchor = "op-" + re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")
        lines += [f"## {method.upper()} `{path}` {{ #{anchor} }}", ""]
        if op.get("deprecated"):
            lines += ["**Deprecated**: kept working until 0.3.0; see the [Changelog](../changelog.md).", ""]
        desc = op.get("description") or op.get("summary") or ""
        if desc:
            lines += [desc.strip(), ""]
        params = op.get("parameters", [])
        if params:
            lines += ["| parameter | in | type | required | |", "|---|---|---|---|---|"]
            for p in params:
                lines.append(f"| {code(p['name'])} | {p['in']} | {code(_schema_name(p.get('schema', {})))} | "
                             f"{'yes' if p.get('required') else 'no'} | {cell(p.get('description', ''))} |")
            lines.append("")
        body = op.get("requestBody")
        if body:
            for ctype, media in body.get("content", {}).items():
                lines += [f"Request body ({code(ctype)}): {_schema_link(media.get('schema', {}))}", ""]
        responses = op.get("responses", {})
        if responses:
            lines += ["| status | | body |", "|---|---|---|"]
            for status, r in responses.items():
                schemas = [_schema_link(m.get("schema", {})) for m in r.get("content", {}).values()
                           if m.get("schema")]
                lines.append(f"| {status} | {cell(r.get('description', ''))} | {' '.join(schemas)} |")
            lines.append("")
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        lines += ["## Schemas", ""]
        for name, schema in schemas.items():
            lines += [f"### {name} {{ #{_anchor(name)} }}", ""]
            if schema.get("description"):
                lines += [" ".join(schema["description"].split()), ""]
            props = schema.get("properties", {})
            if props:
                required = set(schema.get("required", []))
                lines += ["| field | type | required | |", "|---|---|---|---|"]
                for fname, fs in props.items():
                    dep = " (deprecated)" if fs.get("deprecated") else ""
                    lines.append(f"| {code(fname)} | {_schema_link(fs)} | "
                                 f"{'yes' if fname in required else 'no'} | "
                                 f"{cell(fs.get('description', ''))}{dep} |")
                lines.append("")
            elif schema.get("enum"):
                lines += ["One of: " + ", ".join(code(v) for v in schema["enum"]), ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- metrics

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: Where a family comes from, in the order of the page's sections.
AGGREGATOR, DISCOVERY, SUPERVISOR = "aggregator", "discovery", "supervisor"


def _family_rows(registry, families: list) -> list[dict[str, Any]]:
    """Name as scraped (counters with ``_total``), type, help and label names of
    ``families`` (collected from ``registry``): the labels each declares, and any its
    samples carry."""
    from prometheus_client.metrics import MetricWrapperBase

    declared = {c._name: tuple(c._labelnames) for c in list(registry._collector_to_names)
                if isinstance(c, MetricWrapperBase)}
    out = []
    for fam in families:
        # A collector's own family (CounterMetricFamily...) keeps the labels it was made
        # with, even before its first sample.
        labels = set(declared.get(fam.name, ())) | set(getattr(fam, "_labelnames", ()))
        labels |= {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out.append({"name": name, "type": fam.type, "help": fam.documentation,
                    "labels": sorted(labels)})
    return out


def _served(app, during) -> Any:
    """Run ``app``'s lifespan (what ``kvevents serve`` starts: the aggregator's gateway,
    discovery), call ``during()`` on a thread inside it, and return its result."""
    import asyncio

    async def main():
        async with app.router.lifespan_context(app):
            return await asyncio.to_thread(during)
    return asyncio.run(main())


def _aggregator_families() -> tuple[list[dict[str, Any]], set[str]]:
    """The families of an aggregator's registry as ``kvevents serve`` builds it, scraped
    while one engine is followed (on 127.0.0.1, the aggregator binding) whose real
    publisher has sent a stored and a removed block, so every per-engine family carries
    its labels, and a DNS discovery source is configured (asking a closed port on
    127.0.0.1); and the names the same app has without discovery.

    Failure: the engine's batch not applied within 20 s raises (the build fails rather
    than publish a reference with missing labels)."""
    import logging
    import time

    from prometheus_client import CollectorRegistry

    from kvevents.api import create_app
    from kvevents.engines import EngineSpec
    from kvevents.service.aggregator import Aggregator
    from kvevents.service.settings import AggregatorSettings
    from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
    from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    quiet = logging.getLogger("kvevents")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the refused event's and the failed round's warnings are expected
    registry = CollectorRegistry()
    agg = Aggregator(AggregatorSettings(
        engines=(EngineSpec("engine-0", endpoint, model="model", bind=True),),
        discover_dns=("engines.invalid",), dns_server=f"127.0.0.1:{_free_port()}"), registry)
    pub = None

    def scrape() -> list:
        nonlocal pub
        pub = ZmqEventPublisher(PublisherConfig(endpoint=endpoint))
        tokens = list(range(1, 33))
        deadline = time.monotonic() + 20
        # A PUB socket drops what it sends before the subscription reaches it: resend
        # (the same content, new seqs) until the index holds it.
        while not any(e.get("blocks") for e in agg.engine_statuses()):
            if time.monotonic() > deadline:
                raise RuntimeError("metrics reference: the engine's batch was not applied in 20 s")
            pub.publish(KVEventBatch(time.time(), [
                BlockStored([1, 2], None, tokens, 16, None, "GPU", None),
                BlockStored([3], 2, list(range(33, 49)), 16, None, "GPU", None),
                BlockRemoved([3], "GPU"),
                # a token id the index refuses (>= 2**63): the refusal counter's labels
                BlockStored([4], None, [2**63] * 16, 16, None, "GPU", None)]))
            time.sleep(0.05)
        time.sleep(0.2)  # the lane's applied batches reach the lag histogram within 0.1 s
        return list(registry.collect())

    try:
        agg.start()
        families = _served(create_app(aggregator=agg), scrape)
        plain_registry = CollectorRegistry()
        plain = _served(create_app(AggregatorSettings(), registry=plain_registry),
                        lambda: [f.name for f in plain_registry.collect()])
    finally:
        if pub is not None:
            pub.shutdown(0.5)
        agg.stop()  # releases its sockets and ZeroMQ context
        quiet.setLevel(level)
    return _family_rows(registry, families), set(plain)


def _supervisor_families() -> list[dict[str, Any]]:
    """The families the ``--workers`` supervisor adds to the workers' merged series,
    from its own collector over a board of two workers."""
    from prometheus_client import CollectorRegistry

    from kvevents.cli.worker_app import WorkerSeries
    from kvevents.cli.worker_board import WorkerBoard

    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerSeries(WorkerBoard(2, "docs")))
    return _family_rows(registry, list(registry.collect()))


def metric_families() -> list[dict[str, Any]]:
    """Every family ``kvevents serve`` exports, gathered from the registries it builds
    (:func:`_aggregator_families`, :func:`_supervisor_families`): name, type, help,
    label names, and ``source``: :data:`AGGREGATOR` (every aggregator and worker),
    :data:`DISCOVERY` (only with discovery sources) or :data:`SUPERVISOR`
    (``--workers``). Sorted by source, then name."""
    rows, plain = _aggregator_families()
    for row in rows:
        base = row["name"].removesuffix("_total") if row["type"] == "counter" else row["name"]
        row["source"] = AGGREGATOR if base in plain else DISCOVERY
    for row in _supervisor_families():
        rows.append({**row, "source": SUPERVISOR})
    order = (AGGREGATOR, DISCOVERY, SUPERVISOR)
    return sorted(rows, key=lambda m: (order.index(m["source"]), m["name"]))


_SECTIONS = {
    AGGREGATOR: ("Every aggregator",
                 "The families of an aggregator and its gateway, as scraped from one following",
                 "an engine that has published. Labels: `engine` is the followed engine's name,",
                 "`model_name` its model; a family that counts failures shows a sample once",
                 "something has failed."),
    DISCOVERY: ("With discovery sources",
                "Registered when `--discover-dns`, `--discover-dns-srv` or",
                "`--discover-k8s-selector` configures a source; `origin` names the source",
                "(`dns:NAME`, ...)."),
    SUPERVISOR: ("With `--workers N`",
                 "One `GET /metrics` of a `kvevents serve --workers N` returns every worker's",
                 "families above, each sample labelled `worker=\"i\"`, and these, the",
                 "supervisor's own."),
}


#: Every label of every family, and where its values come from. No value is taken from
#: a request: a label a client could name would mint a series per request
#: (:mod:`kvevents.service.metrics.labels`). A label missing here fails the build.
LABEL_SOURCES = {
    "engine": "The followed engine's name, as the operator gave it (`--endpoint NAME=...`, "
              "`POST /v1/engines` behind `--auth-token`) or discovery found it; `\"\"` on a "
              "gateway request answered before any engine was chosen.",
    "model_name": "The model the engine serves, as configured (`model=` of `--endpoint`, "
                  "`--discover-model`), `\"\"` when unset. On lookup and gateway families: the "
                  "request's model when a followed engine serves it, `unknown` for any other "
                  "name, `\"\"` for none.",
    "status": "The HTTP status of the answer (the gateway's own, or the engine's it relayed; "
              "`499` a client that left, `502` an engine that broke off).",
    "api": "`lookup` or `route`: which endpoint served the lookup.",
    "result": "`match` or `mismatch`: a token-parity check's outcome.",
    "tier": "The cache tier of the blocks, as the engines' events name it (`GPU`, `CPU`, ...).",
    "type": "The event's type (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).",
    "kind": "A fixed set of failure kinds, named by the family's help.",
    "reason": "A fixed set of reasons, named by the family's help.",
    "origin": "The discovery source, as configured (`dns:NAME`, `dns-srv:NAME`, `k8s:NAMESPACE/SELECTOR`).",
    "query": "The DNS name a discovery source asks, as configured.",
    "worker": "The worker's index, `0` to `N-1` of `--workers N`.",
}


def metrics_page() -> str:
    fams = metric_families()
    used = sorted({label for m in fams for label in m["labels"]})
    missing = [label for label in used if label not in LABEL_SOURCES]
    if missing:
        raise RuntimeError(f"labels with no stated source: {missing} (docs/ref_http_metrics.py)")
    lines = [
        "# Metrics reference",
        "",
        "Generated at every build of this site from the Prometheus registries that",
        "`kvevents serve` builds (its `/metrics`): every family, with its type, labels and help.",
        "What the families mean together is on [Metrics and Grafana](../metrics.md).",
    ]
    lines += ["", "## Labels", "",
              "Every label a family here carries, and where its values come from. None takes",
              "its value from a request: a model, adapter, salt, session, header or path that a",
              "client names never becomes a label value, so no client can add series.", "",
              "| label | values |", "|---|---|"]
    lines += [f"| `{label}` | {cell(LABEL_SOURCES[label])} |" for label in used]
    for source, (title, *intro) in _SECTIONS.items():
        rows = [m for m in fams if m["source"] == source]
        if not rows:
            continue
        lines += ["", f"## {title}", "", *intro, "", "| metric | type | labels | |", "|---|---|---|---|"]
        for m in rows:
            lines.append(f"| {code(m['name'])} | {m['type']} | {cell(', '.join(m['labels']))} | "
                         f"{cell(m['help'])} |")
    lines += ["", "## The Grafana dashboard", "",
              "Rows and panels of `dashboard/grafana/dashboards/kvevents.json`, read from the file:", ""]
    dash = json.loads((ROOT / "dashboard/grafana/dashboards/kvevents.json").read_text())
    for panel in dash.get("panels", []):
        if panel.get("type") == "row":
            lines += ["", f"- **{cell(panel.get('title', ''))}**"]
        else:
            lines.append(f"    - {cell(panel.get('title', ''))} ({panel.get('type')})")
    return "\n".join(lines) + "\n"
