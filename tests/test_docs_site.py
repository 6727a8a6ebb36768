"""The documentation site: it builds with ``mkdocs build --strict``, reads offline, and
its pages render in a real headless Chromium without console errors.

* Build: the whole site, as ``make docs-build`` and CI build it (a broken link, a missing
  page or a failing reference generator fails the build).
* Offline: no page asks for anything outside the site (no web fonts, no CDN scripts or
  styles); every page of the navigation exists.
* Browser: the site served over HTTP on 127.0.0.1, each page opened in Chromium with the
  DevTools console and network recorded; no console error, no exception, no request
  leaves the site; the Quickstart and the Gateway page are saved as screenshots in
  artifacts/.
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
import time
from pathlib import Path

import pytest

from browser import Browser, DevTools
from docs_build import ROOT, build_site
from support import require_binary, wait_until

ARTIFACTS = ROOT / "artifacts"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return build_site(tmp_path_factory.mktemp("docs") / "site")


def nav_pages() -> list[str]:
    """The Markdown files mkdocs.yml's navigation names, in order."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may use !!python/name tags (Material's emoji); none is needed here.
    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    conf = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    out: list[str] = []

    def walk(items) -> None:
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                walk(value)
            else:
                out.append(value)

    walk(conf["nav"])
    return out


def page_dir(md: str) -> str:
    return "" if md == "index.md" else md[:-3] + "/"


def test_the_site_builds_strict_and_has_every_page(site):
    pages = nav_pages()
    for required in ("quickstart.md", "engines.md", "gateway.md", "routing.md", "discovery.md",
                     "deployment.md", "metrics.md", "connector.md", "reliability.md",
                     "benchmarks.md", "design.md", "changelog.md", "reference/cli.md",
                     "reference/settings.md", "reference/http.md", "reference/metrics.md",
                     "reference/python.md"):
        assert required in pages, f"{required} is not in mkdocs.yml's nav"
    for md in pages:
        html = site / page_dir(md) / "index.html"
        assert html.is_file(), f"{md} was not built"
        assert "<h1" in html.read_text(), f"{md} has no title"


def test_the_site_reads_offline(site):
    """Nothing a page loads comes from outside the site: Material's web fonts are off
    (font: false) and no script, style or image has an absolute URL."""
    conf = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+font: false", conf, re.M)
    loads = re.compile(r"<(?:script|img|iframe)[^>]*\ssrc=\"([^\"]+)\"|<link[^>]*\shref=\"([^\"]+)\"[^>]*>")
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, html
        for m in loads.finditer(text):
            url = m.group(1) or m.group(2)
            tag = m.group(0)
            if m.group(2) and not re.search(r'rel="(stylesheet|icon|preload|modulepreload|manifest)"', tag):
                continue  # canonical, alternate, prev/next: links, not loads
            assert not re.match(r"(https?:)?//", url), f"{html.relative_to(site)} loads {url}"


class _Recorder(DevTools):
    """DevTools that keeps the events it receives (console, exceptions, network)."""

    events: list[dict]

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self._send_text(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._recv_message())
            if msg.get("id") == self._next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            if "method" in msg:
                self.events.append(msg)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_pages_render_in_chromium_without_console_errors(site, tmp_path):
    binary = require_binary("chromium")
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}/"
    browser = Browser(binary, "about:blank", tmp_path / "profile")
    shots = {"quickstart.md": "docs_quickstart.png", "gateway.md": "docs_gateway.png"}
    try:
        tools = browser.tools
        tools.__class__ = _Recorder
        tools.events = []
        for domain in ("Runtime", "Log", "Network", "Page"):
            tools.call(f"{domain}.enable")
        ARTIFACTS.mkdir(exist_ok=True)
        for md in nav_pages():
            url = base + page_dir(md)
            tools.events.clear()
            tools.call("Page.navigate", url=url)

            def loaded() -> bool:
                return tools.call("Runtime.evaluate", expression="document.readyState",
                                  returnByValue=True)["result"].get("value") == "complete"

            assert wait_until(loaded, 20, 0.1), f"{url} did not load"
            # The theme's scripts run after load (search index, palette): let them settle.
            time.sleep(0.3)
            title = tools.call("Runtime.evaluate", expression="document.querySelector('h1')?.innerText",
                               returnByValue=True)["result"].get("value")
            assert title, f"{url}: no h1 rendered"
            problems = []
            for ev in tools.events:
                m, p = ev["method"], ev.get("params", {})
                if m == "Runtime.exceptionThrown":
                    problems.append(f"exception: {p['exceptionDetails'].get('text')} "
                                    f"{p['exceptionDetails'].get('exception', {}).get('description', '')}")
                elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                    problems.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
                elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                    problems.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
                elif m == "Network.requestWillBeSent":
                    req = p["request"]["url"]
                    if not (req.startswith(base) or req.startswith("data:") or req.startswith("blob:")):
                        problems.append(f"request outside the site: {req}")
                elif m == "Network.loadingFailed" and not p.get("canceled"):
                    problems.append(f"failed to load: {p.get('errorText')} ({p.get('type')})")
            assert not problems, f"{md}: {problems}"
            if md in shots:
                data = tools.call("Page.captureScreenshot", format="png")["data"]
                import base64

                png = base64.b64decode(data)
                assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
                (ARTIFACTS / shots[md]).write_bytes(png)
    finally:
        browser.close()
        server.shutdown()
        server.server_close()


def test_readme_is_the_front_door():
    """Under 150 lines; the two set-up commands, exactly; every relative link resolves
    (to a page of the site, or a file of the repository)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    setup = re.search(r"## Set up.*?```bash\n(.*?)```", readme, re.S)
    assert setup, "the README has a set-up block"
    commands = [line.split("#")[0].strip() for line in setup.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target = ROOT / link.split("#")[0]
        assert target.exists(), f"README links {link}, which does not exist"


def test_user_facing_text_tells_no_diary():
    """The README, the site's pages and benchmarks/README.md speak of the product: no
    issue numbers, no sessions or days of the work (the changelog may link issues)."""
    diary = re.compile(r"\bissue \d+|\b(first|second|third|fourth|fifth|next) session\b"
                       r"|\bearlier today\b|\byesterday\b|\bstart of the day\b|\bP\d\b", re.I)
    files = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {str(f.relative_to(ROOT)): m.group(0) for f in files for m in [diary.search(f.read_text())] if m}
    assert not found, f"diary in user-facing text: {found}"
