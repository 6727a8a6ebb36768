"""MkDocs hook: the docstrings' Sphinx roles as plain code in the rendered API pages.

The docstrings cross-reference with Sphinx roles (``:meth:`apply_batch```,
``:class:`~kvevents.index.wire.WireBatch```), which mkdocstrings renders literally as
``:meth:<code>apply_batch</code>``. This drops the role and, as Sphinx does for ``~``,
shows only the last component of the dotted name.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:meth|class|func|attr|mod|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _plain(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_plain, html)
