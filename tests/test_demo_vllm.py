"""``kvevents demo --engine vllm``: the fleet demo on 2 real vLLM CPU engines with our connector.

Runs the CLI as a real subprocess (a tiny local model, 2 engines, the aggregator, the KV
router) and reads its summary JSON: exit 0, nothing lost, the aggregator's index equals
each engine's true GPU prefix cache and CPU tier (and those were not empty), and some
prompt tokens were served from the CPU tier.

Where vLLM is not installed these tests skip (``make vllm``, or ``make test CI=true``,
installs it); under ``CI=true`` a missing vLLM fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import free_port

ROOT = Path(__file__).resolve().parent.parent
HOW = "vLLM is not installed: run `make vllm` (or `make test CI=true`) to install the vllm extra"

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but vLLM is missing: " + HOW)
    pytest.skip(HOW, allow_module_level=True)

pytestmark = pytest.mark.timeout(600)


def test_demo_on_real_vllm_engines(tmp_path):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "kvevents.cli", "demo", "--engine", "vllm", "--engines", "2",
           "--requests", "30", "--duration", "12", "--port", str(free_port()), "--no-progress",
           "--summary-json", str(out), "--log-dir", str(tmp_path / "logs")]
    t0 = time.monotonic()
    # Bounded: 2 engine starts on 2 cores (10-70 s each) + 12 s of arrivals + the checks.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = json.loads(out.read_text())
    assert s["engine"] == "vllm" and s["engines"] == 2
    assert s["requests"] == 30 and s["rejected_requests"] == 0
    assert s["index_mismatches"] == 0, s["index_mismatches_by_engine"]
    assert s["events"]["lost"] == 0 and s["events"]["applied"] == s["events"]["published"] > 0
    compared = s["index_blocks_compared_by_engine"]
    assert set(compared) == {"engine-0", "engine-1"}
    assert all(c.get("GPU", 0) > 0 for c in compared.values()), compared
    assert sum(c.get("CPU", 0) for c in compared.values()) > 0, compared
    assert s["hit_tokens"]["CPU"] > 0, s["hit_tokens"]  # prompt tokens loaded from the CPU tier
    assert s["offload"]["loaded_bytes"] > 0
    print(f"demo --engine vllm: {wall:.0f} s; requests {s['requests']}, prompt tokens {s['prompt_tokens']}, "
          f"hit GPU {s['hit_tokens']['GPU']} CPU {s['hit_tokens']['CPU']}, blocks compared {compared}, "
          f"index mismatches {s['index_mismatches']}")


def test_demo_vllm_rejects_a_trace(tmp_path):
    """Bad input for the real-engine demo: a one-line error before anything starts."""
    proc = subprocess.run([sys.executable, "-m", "kvevents.cli", "demo", "--engine", "vllm", "--trace",
                           str(tmp_path / "t.jsonl"), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--trace: not with --engine vllm" in proc.stderr
