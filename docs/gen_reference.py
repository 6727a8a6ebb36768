"""Generates the site's reference pages from the code, at every ``mkdocs build``.

Run by the mkdocs-gen-files plugin (mkdocs.yml); docs/ref_cli.py makes the command-line
and settings pages, docs/ref_http_metrics.py the HTTP and metrics pages. Nothing is
written to docs/ on disk, so a flag, setting, path or metric added to the code appears
in the next build without a hand edit, and one removed disappears. tests/test_docs_reference.py checks
the built pages against the code, and the hand-written pages against the code.

Pages:

* ``reference/cli.md``: every command of ``kvevents`` from ``kvevents.cli.main.build_parser``
  (each flag, its default, and for ``serve`` its environment variable and config key);
* ``reference/settings.md``: every field of ``AggregatorSettings`` (config key, variable,
  flag, default, bounds), and the keys of an engine (``EngineSpec``);
* ``reference/http.md``: every path of the app's own OpenAPI document (``create_app().openapi()``);
* ``reference/metrics.md``: every metric family in the registries ``kvevents serve``
  builds (an aggregator's, with its gateway and a discovery source; the ``--workers``
  supervisor's), and the Grafana dashboard's rows and panels;
* ``reference/python.md``: the documented Python API, from the docstrings (mkdocstrings);
* ``changelog.md``: CHANGELOG.md;
* ``assets/live-page.png``: the live page's screenshot from dashboard/.

Failure: any import or introspection error stops the build (mkdocs reports the
traceback), so a reference is never published half generated.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ref_* modules beside it

from ref_cli import cli_page, settings_page  # noqa: E402
from ref_common import ROOT  # noqa: E402
from ref_http_metrics import http_page, metrics_page  # noqa: E402


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
