"""`make gpu-check` cannot rot between the days a GPU is lent: its dry run (the same
script, the same tests and benchmark on CPU tensors through the stream handler) runs
here, and `make gpu-wheels` builds the wheelhouse the GPU machine installs from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_dry_run_writes_a_full_report(tmp_path):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["make", "-s", "gpu-check", "CPU=1"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["device"] == "cpu" and report["ok"] is True and report["cuda"] is None
    # Every test that means something without a GPU ran (and went through the stream handler:
    # the tests assert that themselves); none failed.
    assert report["tests"]["failed"] == 0 and report["tests"]["passed"] >= 8, report["tests"]
    bench = report["benchmark"]
    assert bench["device"] == "cpu" and bench["all_bit_exact"] is True
    assert [r["block_size"] for r in bench["throughput"]] == [16, 32, 64, 128, 256]
    assert all(r["store_gbps"] > 0 and r["load_gbps"] > 0 for r in bench["throughput"])
    log = (tmp_path / "gpu-pytest.log").read_text()
    assert "passed" in log and "test_cuda_events" not in log.split("short test summary")[-1]


def test_the_check_fails_loudly_when_a_test_fails(tmp_path):
    """A failing GPU test makes the check exit non-zero and the report say so."""
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable,
           "PYTEST_ADDOPTS": "-k byte_exact", "KVEVENTS_TEST_BREAK_TRANSFERS": "1"}
    env.pop("OUT", None)
    breaker = tmp_path / "sitecustomize.py"
    # Breaks the copy routine the handler calls (torch's index_select), not our code.
    breaker.write_text("import os\nif os.environ.get('KVEVENTS_TEST_BREAK_TRANSFERS'):\n"
                       "    import torch\n    torch.Tensor.index_select = lambda *a, **k: (_ for _ in ()).throw("
                       "RuntimeError('broken copy'))\n")
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(["bash", "benchmarks/gpu/check.sh", "--cpu"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["ok"] is False and report["tests"]["failed"] >= 1


def test_gpu_wheels_are_for_the_gpu_machines_python(tmp_path):
    proc = subprocess.run(["make", "-s", "gpu-wheels", f"WHEELHOUSE={tmp_path}", f"PYTHON={sys.executable}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and os.environ.get("CI") != "true":
        pytest.skip(f"no package index here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == ["msgspec", "pyzmq"], wheels
    for w in wheels:
        tags = w[: -len(".whl")].split("-")[-3:]
        assert tags[0] == "cp312" and tags[1] in ("cp312", "abi3") and "manylinux" in tags[2] and "x86_64" in tags[2], w
        with zipfile.ZipFile(tmp_path / w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            needs = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
        # --no-deps install there: nothing they need on CPython 3.12 may be missing.
        assert all("extra ==" in r or "pypy" in r or "< \"3.11\"" in r for r in needs), (w, needs)
