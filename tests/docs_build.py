"""The documentation site built once per test module, as CI builds it.

``build_site(dest)`` runs ``mkdocs build --strict`` (broken links, missing pages, a
failing reference generator: all errors) on the checkout's mkdocs.yml into ``dest``.
Without the ``docs`` extra the tests that need it skip locally and fail under CI
(``make test`` installs it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def require_mkdocs() -> None:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocs_gen_files")
               if importlib.util.find_spec(m) is None]
    if missing:
        msg = (f"{', '.join(missing)} not installed: the docs extra "
               "(pip install -e '.[docs]'; `make test` installs it)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def generator():
    """docs/gen_reference.py as a module (the tests read its list of documented names)."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("kvevents_docs_gen", DOCS / "gen_reference.py")
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_site(dest: Path) -> Path:
    """Build the site into ``dest``; fail the test with mkdocs' output if it does not."""
    require_mkdocs()
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(dest)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return dest
