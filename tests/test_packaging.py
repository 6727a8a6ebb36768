"""``pip install .`` with no extras, into a fresh virtual environment, as a new user does.

The base install must give a working ``kvevents serve`` and ``kvevents tail`` (and
``--help`` everywhere) without torch, which only the extras bring. The project
is copied to a temporary directory first so the build leaves nothing in the checkout.
pip resolves the base dependencies from the configured index (a local mirror where
there is one): about 40 s on 2 cores; every step is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import kvevents
from support import free_port

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "kvevents", "connector"]


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "_core.c"))
        else:
            shutil.copy2(ROOT / name, src / name)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(src)], timeout=400,
         env={**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return venv


def _py(venv: Path, code: str) -> str:
    return _run([str(venv / "bin" / "python"), "-c", code], timeout=60, cwd=venv).stdout


def _kv(venv: Path, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [str(venv / "bin" / "kvevents"), *args]
    if check:
        return _run(cmd, timeout=timeout, cwd=venv)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=venv)


@pytest.mark.timeout(600)
def test_base_install_brings_no_torch(base_venv):
    # httpx is a base dependency since the OpenAI gateway (its client to the engines).
    found = json.loads(_py(base_venv, (
        "import importlib.util, importlib.metadata as m, json, pathlib, kvevents; "
        "d = m.distribution('kvevents'); p = pathlib.Path(kvevents.__file__).parent; "
        "print(json.dumps({n: importlib.util.find_spec(n) is not None for n in "
        "('torch', 'httpx', 'pydantic_settings', 'uvicorn')} | {'version': d.version, "
        "'module_version': kvevents.__version__, 'py.typed': (p / 'py.typed').exists(), "
        "'static': (p / 'static' / 'index.html').exists(), "
        "'license': any(str(f).endswith('LICENSE') for f in d.files), "
        "'requires_python': d.metadata['Requires-Python']}))")))
    assert found == {"torch": False, "httpx": True, "pydantic_settings": True, "uvicorn": True,
                     "version": kvevents.__version__, "module_version": kvevents.__version__,
                     "py.typed": True, "static": True, "license": True, "requires_python": ">=3.11"}


@pytest.mark.timeout(600)
def test_base_install_help_and_version(base_venv):
    assert _kv(base_venv, "--version").stdout.strip() == f"kvevents {kvevents.__version__}"
    for args in (["--help"], ["serve", "--help"], ["tail", "--help"], ["demo", "--help"],
                 ["loadgen", "--help"]):
        out = _kv(base_venv, *args).stdout
        assert out.startswith("usage: kvevents") and "``" not in out, args
    r = _kv(base_venv, "demo", "--engines", "1", "--port", str(free_port()), check=False)
    assert r.returncode == 2 and r.stderr.strip() == (
        "kvevents demo: error: torch not installed; install the demo extra: "
        "pip install 'kvevents[demo]'"), r.stderr


@pytest.mark.timeout(600)
def test_base_install_serves_and_tails(base_venv):
    port, closed = free_port(), free_port()  # nothing listens on `closed`: the engine stays down
    proc = subprocess.Popen(
        [str(base_venv / "bin" / "kvevents"), "serve", "--port", str(port),
         "--endpoint", f"vllm-0=tcp://127.0.0.1:{closed}"],
        cwd=base_venv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "kvevents serve did not answer /healthz in 60 s"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/engines", timeout=5) as r:
            assert [p["name"] for p in json.load(r)["engines"]] == ["vllm-0"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"kvevents_" in r.read()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    tail = _kv(base_venv, "tail", "--endpoint", f"tcp://127.0.0.1:{closed}", "--duration", "1")
    assert tail.stdout.startswith(f"# following tcp://127.0.0.1:{closed}"), tail.stdout
