"""MkDocs hooks: flag tables generated into hand-written pages, and the docstrings'
Sphinx roles as plain code in the rendered API pages.

``<!-- kvevents-flags: serve discovery -->`` in a page becomes the table of that argument
group of ``kvevents serve`` (or, with ``--route-``, of the flags starting so), made by
docs/ref_cli.py from the parser itself: a page's flag table cannot drift from the
code. A marker that matches no flag fails the build.

The docstrings cross-reference with Sphinx roles (``:meth:`apply_batch```,
``:class:`~kvevents.index.wire.WireBatch```), which mkdocstrings renders literally as
``:meth:<code>apply_batch</code>``. This drops the role and, as Sphinx does for ``~``,
shows only the last component of the dotted name.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

_MARKER = re.compile(r"<!-- kvevents-flags: (\S+) (.+?) -->")
_gen = None


def _generator():
    global _gen
    if _gen is None:
        here = Path(__file__).resolve().parent
        if str(here) not in sys.path:
            sys.path.insert(0, str(here))  # ref_cli imports ref_common beside it
        spec = importlib.util.spec_from_file_location("kvevents_docs_ref_cli", here / "ref_cli.py")
        _gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_gen)
    return _gen


def on_page_markdown(markdown: str, **kwargs) -> str:
    return _MARKER.sub(lambda m: _generator().flag_table(m.group(1), m.group(2).strip()), markdown)


_ROLE = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _plain(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_plain, html)
