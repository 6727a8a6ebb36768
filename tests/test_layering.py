"""The package layering the design fixes, checked on the source and on real imports.

* No module under ``kvevents/`` (the simulator included) has an ``import torch`` or
  ``from torch ...`` statement anywhere, nested ones included: torch lives in
  ``connector/`` only.
* Only ``kvevents/sim/`` (the simulator drives the connector core) imports ``connector``.
* The aggregator's import path (the service, its API, the CLI) loads neither torch nor
  ``connector`` nor vLLM, in a fresh interpreter where all of them are installed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KVEVENTS = ROOT / "kvevents"


def _imported_roots(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def _offenders(root: str, allowed_under: Path | None = None) -> list[str]:
    found = []
    for path in sorted(KVEVENTS.rglob("*.py")):
        if allowed_under is not None and allowed_under in path.parents:
            continue
        found.extend(f"{path.relative_to(ROOT)}:{line}" for line, name in _imported_roots(path) if name == root)
    return found


def test_scan_finds_nested_torch_imports(tmp_path):
    # The scan itself must see imports inside functions and `from torch.x import y`.
    src = tmp_path / "m.py"
    src.write_text("import os\ndef f():\n    from torch.nn import Linear\n    import torch as t\n")
    assert [n for _, n in _imported_roots(src)] == ["os", "torch", "torch"]


def test_no_torch_import_anywhere_in_kvevents():
    files = list(KVEVENTS.rglob("*.py"))
    assert len(files) > 30 and any("sim" in p.parts for p in files)
    assert _offenders("torch") == []


def test_only_the_simulator_imports_connector():
    assert _offenders("connector", allowed_under=KVEVENTS / "sim") == []


def test_aggregator_import_path_loads_no_torch_no_connector():
    code = (
        "import json, sys\n"
        "import kvevents.service.aggregator, kvevents.api, kvevents.cli.serve, kvevents.cli, kvevents.cli.tail\n"
        "app = kvevents.api.create_app\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'connector', 'vllm'})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    # The same interpreter can load them (they are installed), so the check is not vacuous.
    probe = subprocess.run([sys.executable, "-c", "import torch, connector.core"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
