"""Helpers shared by the reference generators (docs/ref_*.py): Markdown cells.

Part of the site's build (mkdocs.yml); imports nothing of kvevents.
"""

from __future__ import annotations

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
