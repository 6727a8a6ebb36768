"""The package layering the design fixes, checked on the source and on real imports.

* The packages of ``kvevents/`` are ordered as the data flows (:data:`ORDER`): each
  imports only itself and the ones before it, at any depth (imports inside functions and
  under ``TYPE_CHECKING`` included), and no module imports another in a circle.
* ``connector/`` imports only ``kvevents.wire`` of ours; only ``kvevents/sim/`` (the
  simulator drives the connector core) imports ``connector``.
* No module under ``kvevents/`` (the simulator included) has an ``import torch`` or
  ``from torch ...`` statement anywhere, nested ones included: torch lives in
  ``connector/`` only.
* The aggregator's import path (the service, its API, the CLI) loads neither torch nor
  ``connector`` nor vLLM, in a fresh interpreter where all of them are installed; the
  connector's loads no HTTP or settings stack and nothing of ours but the wire package.
* Hand-written modules stay small (at most :data:`MAX_LINES` lines; the compiled core is
  exempt), and few modules sit at the top of ``kvevents/``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KVEVENTS = ROOT / "kvevents"
CONNECTOR = ROOT / "connector"

#: The packages of kvevents/ in data-flow order: each may import only those before it.
ORDER = ["wire", "ingest", "engines", "index", "text", "service", "discovery", "routing",
         "gateway", "api", "sim", "demo", "cli"]
#: Modules at the top of kvevents/ that any package may import (they import none of ours).
TOP = {"kvevents", "kvevents.defaults", "kvevents._compat"}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _our_imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of ``kvevents``/``connector`` in the file,
    at any depth, relative imports resolved; ``from X import name`` counts as X.name
    when that is a module of ours, else as X."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.append((node.lineno, sub if _is_module(sub) else module))
    return [(line, m) for line, m in out if m.split(".")[0] in ("kvevents", "connector")]


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists() or \
        any(base.parent.glob(base.name + ".*.so")) or base.with_suffix(".pyx").exists()


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvevents" and len(parts) > 1 and module not in TOP else None


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


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


def test_import_scan_resolves_relative_and_nested_imports(tmp_path):
    # The rules below are only as good as this scan: it must see relative imports,
    # imports inside functions and under TYPE_CHECKING, and name submodules.
    found = dict((m, line) for line, m in _our_imports(KVEVENTS / "index" / "index.py"))
    assert "kvevents.index._core" in found and "kvevents.wire.schema" in found
    found = {m for _, m in _our_imports(KVEVENTS / "cli" / "main.py")}
    assert "kvevents.demo.args" in found  # imported inside a function


def test_packages_import_only_earlier_packages():
    bad = []
    for path in _sources(KVEVENTS):
        own = _package_of(_module_name(path))
        for line, module in _our_imports(path):
            if module.split(".")[0] == "connector":
                if own != "sim":
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
                continue
            dep = _package_of(module)
            if own is None:  # a top-level module imports none of the packages
                if dep is not None:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            elif dep is not None and ORDER.index(dep) > ORDER.index(own):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {own} imports {module} (later: {dep})")
    assert bad == []
    assert {p.name for p in KVEVENTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == set(ORDER), "a package of kvevents/ is missing from ORDER (or ORDER names one that is gone)"


def test_connector_imports_only_the_wire_package():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in _sources(CONNECTOR)
           for line, m in _our_imports(p)
           if m.startswith("kvevents") and not (m == "kvevents.wire" or m.startswith("kvevents.wire."))]
    assert bad == []


def test_no_import_circle_between_modules():
    graph: dict[str, set[str]] = {}
    for root in (KVEVENTS, CONNECTOR):
        for path in _sources(root):
            name = _module_name(path)
            graph[name] = {m for _, m in _our_imports(path) if m != name and m not in TOP}
    # Importing a submodule runs its package's __init__ first, which may import the
    # submodule back: that is loading, not a circle, so edges into one's own package
    # __init__ are not followed.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if d in graph and not name.startswith(d + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(trail[trail.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_modules_stay_small_and_the_top_level_stays_short():
    big = {str(p.relative_to(ROOT)): n for root in (KVEVENTS, CONNECTOR) for p in _sources(root)
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}
    top = sorted(p.name for p in KVEVENTS.glob("*.py"))
    assert top == ["__init__.py", "_compat.py", "defaults.py"]


def test_connector_import_path_loads_only_the_wire_package():
    code = (
        "import json, sys\n"
        "import connector, connector.core, connector.planner, connector.events_tracker, connector.multi\n"
        "ours = sorted(m for m in sys.modules if m.split('.')[0] == 'kvevents')\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'uvicorn', 'pydantic',"
        " 'pydantic_settings', 'starlette', 'prometheus_client'})\n"
        "print(json.dumps([ours, heavy]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert heavy == []
    assert ours and all(m in ("kvevents", "kvevents._compat") or m.startswith("kvevents.wire")
                        for m in ours), ours


def test_old_module_paths_still_import_with_a_deprecation_warning():
    # 0.1.0's documented paths answer for one release: the same module object, warned.
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "out = {}\n"
        "for old in ['kvevents.aggregator', 'kvevents.router', 'kvevents.settings', 'kvevents.schema']:\n"
        "    try:\n"
        "        __import__(old)\n"
        "        out[old] = 'no warning'\n"
        "    except DeprecationWarning as w:\n"
        "        out[old] = str(w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "import kvevents.aggregator as a, kvevents.service.aggregator as b\n"
        "from kvevents.router import KVAwarePolicy\n"
        "from kvevents.routing import KVAwarePolicy as K2\n"
        "from kvevents.settings import EngineSpec, PodSpec\n"
        "from kvevents.engines import EngineSpec as E2\n"
        "out['same'] = a is b and KVAwarePolicy is K2 and EngineSpec is E2 and PodSpec is E2\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("same") is True
    assert out["kvevents.aggregator"].startswith("kvevents.aggregator moved to kvevents.service.aggregator")
    assert out["kvevents.router"].startswith("kvevents.router moved to kvevents.routing.policies")
    assert all("moved to" in v for v in out.values()), out
