"""Generates the site's reference pages from the code, at every ``mkdocs build``.

Run by the mkdocs-gen-files plugin (mkdocs.yml): nothing here is written to docs/ on
disk, so a flag, setting, path or metric added to the code appears in the next build
without a hand edit, and one removed disappears. tests/test_docs_reference.py checks
the built pages against the code, and the hand-written pages against the code.

Pages:

* ``reference/cli.md``: every command of ``kvevents`` from ``kvevents.cli.main.build_parser``
  (each flag, its default, and for ``serve`` its environment variable and config key);
* ``reference/settings.md``: every field of ``AggregatorSettings`` (config key, variable,
  flag, default, bounds), and the keys of an engine (``EngineSpec``);
* ``reference/http.md``: every path of the app's own OpenAPI document (``create_app().openapi()``);
* ``reference/metrics.md``: every metric family in the registry an ``Aggregator`` and its
  gateway build, and the Grafana dashboard's rows and panels;
* ``reference/python.md``: the documented Python API, from the docstrings (mkdocstrings);
* ``changelog.md``: CHANGELOG.md;
* ``assets/live-page.png``: the live page's screenshot from dashboard/.

Failure: any import or introspection error stops the build (mkdocs reports the
traceback), so a reference is never published half generated.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's kvevents, whatever the working directory
    sys.path.insert(0, str(ROOT))

def cell(text: Any) -> str:
    """One Markdown table cell: pipes escaped, newlines folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: Any) -> str:
    return f"`{cell(text)}`" if str(text) != "" else ""


# ---------------------------------------------------------------- the command line

def serve_field(dest: str) -> str | None:
    """The ``AggregatorSettings`` field a ``serve`` flag sets, or None (``--config``...).

    The flag's dest is the field's name or one of its accepted aliases, singular or
    plural (``--endpoint`` -> ``engines`` via its alias ``endpoints``)."""
    from pydantic import AliasChoices

    from kvevents.service.settings import AggregatorSettings

    fields = AggregatorSettings.model_fields
    aliases = {}
    for name, f in fields.items():
        if isinstance(f.validation_alias, AliasChoices):
            for choice in f.validation_alias.choices:
                aliases[str(choice)] = name
    for candidate in (dest, dest + "s"):
        if candidate in fields:
            return candidate
        if candidate in aliases:
            return aliases[candidate]
    return None


def env_names(field: str) -> list[str]:
    from kvevents.service import settings as s

    return [s.env_name(field), *s._LEGACY_ENV.get(field, ())]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text exactly as ``--help`` prints it ({default} filled in)."""
    formatter = parser._get_formatter()
    text = formatter._get_help_string(action)  # type: ignore[attr-defined]
    params = {"default": action.default, "prog": parser.prog, "dest": action.dest}
    try:
        return text % params
    except (KeyError, TypeError, ValueError):
        return text


def default_of(command: str, action: argparse.Action) -> str:
    if command == "serve":
        field = serve_field(action.dest)
        if field is not None:
            from kvevents.service.settings import field_default

            value = field_default(field)
            return "none" if value in (None, (), "") else str(value)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if not action.default else "on"
    if action.default in (None, argparse.SUPPRESS):
        return "none"
    return str(action.default)


def flag_rows(command: str, parser: argparse.ArgumentParser, select: str | None = None,
              headings: bool = True, compact: bool = False) -> list[str]:
    """One Markdown table per argument group, one row per option. ``select``: only the
    group of that title, or only the flags starting with it (``--route-``); ``compact``:
    flag, default and help only (a page's table; the reference has every column)."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if select is not None and select.startswith("--"):
            actions = [a for a in actions if a.option_strings[-1].startswith(select)]
        elif select is not None and group.title != select:
            actions = []
        if not actions:
            continue
        title = group.title or "options"
        if headings:
            out.append(f"**{title[0].upper() + title[1:]}**"
                       + (f": {group.description}" if group.description else ""))
            out.append("")
        if command == "serve" and not compact:
            out.append("| flag | default | environment variable | config key | |")
            out.append("|---|---|---|---|---|")
        else:
            out.append("| flag | default | |")
            out.append("|---|---|---|")
        for a in actions:
            flags = ", ".join(a.option_strings)
            if a.nargs != 0 and not isinstance(a, argparse._VersionAction):
                flags += " " + (a.metavar or a.dest.upper())
            helptext = option_help(parser, a)
            if a.choices and not isinstance(a.choices, dict):
                helptext += " (one of: " + ", ".join(map(str, a.choices)) + ")"
            row = [code(flags), code(default_of(command, a))]
            if command == "serve" and not compact:
                field = serve_field(a.dest)
                if field is not None:
                    row += ["<br>".join(code(e) for e in env_names(field)), code(field)]
                elif a.dest == "config":
                    row += [code("KVEVENTS_CONFIG"), ""]
                else:
                    row += ["", ""]
            row.append(cell(helptext))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return out


def flag_table(command: str, select: str) -> str:
    """The reference's rows for some flags of ``kvevents COMMAND``, for a hand-written
    page (docs/hooks.py replaces ``<!-- kvevents-flags: COMMAND SELECT -->`` with it)."""
    from kvevents.cli.main import build_parser

    parser = subcommands(build_parser())[command]
    rows = flag_rows(command, parser, select, headings=False, compact=True)
    if not any(line.startswith("| `") for line in rows):
        raise ValueError(f"kvevents-flags: no flag of kvevents {command} matches {select!r}")
    return "\n".join(rows)


def cli_page() -> str:
    from kvevents.cli.main import build_parser

    parser = build_parser()
    lines = [
        "# Command-line reference",
        "",
        "Generated from the `kvevents` command's own argument parsers at every build of",
        "this site: every command, flag and default here is what `kvevents COMMAND --help`",
        "prints. For `kvevents serve`, every flag is also a setting: the environment",
        "variable and the config-file key set the same value, with the precedence",
        "flag > environment > config file > default; settings with no flag are on the",
        "[settings reference](settings.md).",
        "",
        "## kvevents",
        "",
        "```",
        parser.format_usage().strip(),
        "```",
        "",
        cell(parser.description or ""),
        "",
        *flag_rows("kvevents", parser),
    ]
    for name, sub in subcommands(parser).items():
        lines += [f"## kvevents {name}", "", "```", sub.format_usage().strip(), "```", ""]
        if sub.description:
            lines += [" ".join(sub.description.split()), ""]
        lines += flag_rows(name, sub)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- settings

def settings_page() -> str:
    import dataclasses

    from kvevents.cli.main import build_parser
    from kvevents.engines import EngineSpec
    from kvevents.service.settings import AggregatorSettings, field_default

    serve = subcommands(build_parser())["serve"]
    flags: dict[str, list[str]] = {}
    for a in serve._actions:
        field = serve_field(a.dest) if a.option_strings else None
        if field is not None:
            flags.setdefault(field, []).append(a.option_strings[-1])
    lines = [
        "# Settings reference",
        "",
        "Every setting of `kvevents serve`, generated from `AggregatorSettings` at every",
        "build of this site. Each comes, in this order of precedence, from its flag (where",
        "it has one), its environment variable, the config file (`--config FILE` or",
        "`KVEVENTS_CONFIG`: JSON, or TOML when the name ends in `.toml`; unknown keys are",
        "errors), or its default. Older names still accepted are listed after the current",
        "one.",
        "",
        "| config key | environment variable | flag | default | bounds | |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in AggregatorSettings.model_fields.items():
        bounds = []
        for m in f.metadata:
            for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                               ("min_length", "length >=")):
                value = getattr(m, attr, None)
                if value is not None:
                    bounds.append(f"{sign} {value}")
        keys = [name]
        va = f.validation_alias
        if va is not None and hasattr(va, "choices"):
            keys += [str(c) for c in va.choices if str(c) != name]
        default = field_default(name)
        lines.append("| " + " | ".join([
            "<br>".join(code(k) for k in keys),
            "<br>".join(code(e) for e in env_names(name)),
            "<br>".join(code(x) for x in flags.get(name, [])),
            code("none" if default in (None, (), "") else default),
            cell(", ".join(bounds)),
            cell(f.description or ""),
        ]) + " |")
    lines += [
        "",
        "## An engine",
        "",
        "An entry of `engines` (a TOML `[[engines]]` table, a JSON object, the body of",
        "`POST /v1/engines`), or the same as `NAME=ENDPOINT[,replay=E][,model=M][,topic=T]"
        "[,bind=1][,http=URL]` on the command line (`--endpoint`) and in `KVEVENTS_ENGINES`",
        "(`;`-separated). Generated from `EngineSpec`:",
        "",
        "| key | default | on the command line |",
        "|---|---|---|",
    ]
    short = {"replay_endpoint": "replay=", "model": "model=", "topic": "topic=",
             "bind": "bind=1", "http": "http=", "name": "NAME=", "endpoint": "=ENDPOINT"}
    for fld in dataclasses.fields(EngineSpec):
        if fld.default is dataclasses.MISSING:
            default = "required"
        else:
            default = "none" if fld.default in (None, "") else str(fld.default)
        lines.append(f"| {code(fld.name)} | {code(default)} | {code(short.get(fld.name, ''))} |")
    lines += ["", "[EngineSpec in the Python API](python.md#kvevents.engines.EngineSpec).", ""]
    return "\n".join(lines) + "\n"


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
        "the same document at `/openapi.json` and an explorer at `/docs`. Errors of the",
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

def metric_families() -> list[dict[str, Any]]:
    """Every family the aggregator's registry exposes, with one engine configured (so
    the per-engine families carry their labels), plus its gateway's: name as scraped
    (counters with ``_total``), type, help and label names."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from kvevents.gateway import GatewayMetrics
    from kvevents.service.aggregator import Aggregator
    from kvevents.service.settings import AggregatorSettings

    registry = CollectorRegistry()
    # Built, never started: no socket is opened; port 9 on 127.0.0.1 is never dialled.
    agg = Aggregator(AggregatorSettings(engines=("engine-0=tcp://127.0.0.1:9",)), registry)
    try:
        GatewayMetrics(agg.registry)
        declared = {c._name: tuple(c._labelnames) for c in list(registry._collector_to_names)
                    if isinstance(c, MetricWrapperBase)}
        families = list(registry.collect())
    finally:
        agg.stop()  # releases its ZeroMQ context (left to the GC, its term() would wait)
    out = []
    for fam in families:
        labels = set(declared.get(fam.name, ()))
        labels |= {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out.append({"name": name, "type": fam.type, "help": fam.documentation,
                    "labels": sorted(labels)})
    return sorted(out, key=lambda m: m["name"])


def metrics_page() -> str:
    fams = metric_families()
    lines = [
        "# Metrics reference",
        "",
        "Generated at every build of this site from the Prometheus registry that an",
        "aggregator and its gateway build (`kvevents serve`'s `/metrics`): every family,",
        "as scraped. Labels are those the family declares or carries with one engine",
        "followed; `engine` is the followed engine's name, `model_name` its model.",
        "What the families mean together is on [Metrics and Grafana](../metrics.md).",
        "",
        "| metric | type | labels | |",
        "|---|---|---|---|",
    ]
    for m in fams:
        lines.append(f"| {code(m['name'])} | {m['type']} | {cell(', '.join(m['labels']))} | {cell(m['help'])} |")
    lines += ["", "## The Grafana dashboard", "",
              "Rows and panels of `dashboard/grafana/dashboards/kvevents.json`, read from the file:", ""]
    dash = json.loads((ROOT / "dashboard/grafana/dashboards/kvevents.json").read_text())
    for panel in dash.get("panels", []):
        if panel.get("type") == "row":
            lines += ["", f"- **{cell(panel.get('title', ''))}**"]
        else:
            lines.append(f"    - {cell(panel.get('title', ''))} ({panel.get('type')})")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- Python API

PYTHON_API = [
    ("The index", ["kvevents.index.PrefixIndex", "kvevents.index.IngestDecoder",
                   "kvevents.index.IndexBusy", "kvevents.index.LookupResult",
                   "kvevents.index.EngineMatch"]),
    ("The wire", ["kvevents.wire.schema.BatchDecoder"]),
    ("The service", ["kvevents.service.aggregator.Aggregator",
                     "kvevents.service.settings.AggregatorSettings",
                     "kvevents.engines.EngineSpec"]),
    ("Routing", ["kvevents.routing.Router", "kvevents.routing.KVAwarePolicy",
                 "kvevents.routing.KVRouterConfig", "kvevents.routing.RoundRobinPolicy",
                 "kvevents.routing.LeastLoadedPolicy", "kvevents.routing.Candidate",
                 "kvevents.routing.EngineLoad", "kvevents.routing.RouteDecision"]),
]


def python_page() -> str:
    lines = ["# Python API reference", "",
             "The documented Python API, rendered from its docstrings and signatures at every",
             "build of this site (mkdocstrings). How the pieces fit is on",
             "[Embedding the index](../python.md).", ""]
    for title, names in PYTHON_API:
        lines += [f"## {title}", ""]
        for name in names:
            lines += [f"::: {name}", ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- changelog, assets

def changelog_page() -> str:
    """CHANGELOG.md as it is; a relative link in it (the site has no copy of
    benchmarks/README.md and the like) is shown as its text, not a broken link."""
    text = (ROOT / "CHANGELOG.md").read_text()

    def unlink(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        return f"{m.group(1)} (`{target}`)"

    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", unlink, text)
    # Version links point at GitHub's heading anchors; the site's are toc's.
    from markdown.extensions.toc import slugify

    for label, rest in re.findall(r"^## \[([^\]]+)\](.*)$", text, re.M):
        slug = slugify(f"{label}{rest}", "-")
        text = re.sub(rf"^\[{re.escape(label)}\]: #.*$", f"[{label}]: #{slug}", text, flags=re.M)
    return text


def write_all() -> None:
    import mkdocs_gen_files

    pages = {
        "reference/cli.md": cli_page, "reference/settings.md": settings_page,
        "reference/http.md": http_page, "reference/metrics.md": metrics_page,
        "reference/python.md": python_page, "changelog.md": changelog_page,
    }
    for path, make in pages.items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(make())
    with mkdocs_gen_files.open("assets/live-page.png", "wb") as f:
        f.write((ROOT / "dashboard/live-page.png").read_bytes())


if __name__ in ("<run_path>", "__main__"):  # run by mkdocs-gen-files; importable by the tests
    write_all()
