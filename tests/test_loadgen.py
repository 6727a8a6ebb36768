"""``kvevents loadgen`` against a running fleet, as docker-compose.yml runs it.

Real engine processes and a real aggregator (started by the demo's :class:`Fleet` on
free 127.0.0.1 ports); the load generator is a separate ``kvevents loadgen`` process
that knows them only by their endpoints. After one round, every engine has served
requests and the aggregator has applied their KV events: the panels move.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_one_round_reaches_every_engine_and_the_index(tmp_path):
    pytest.importorskip("torch")
    from kvevents.demo.fleet import Fleet

    fleet = Fleet(2, free_port(), True, gpu_blocks=1024, cpu_blocks=256, offloaded_block_size=64,
                  log_dir=str(tmp_path / "logs"))
    try:
        fleet.wait_engines_ready()
        assert wait_until(lambda: _healthy(fleet.url), 60, 0.2), "the aggregator did not start"
        cmd = [sys.executable, "-m", "kvevents.cli", "loadgen", "--aggregator", fleet.url,
               "--rounds", "1", "--requests", "24", "--duration", "4", "--ready-timeout", "60"]
        for e in fleet.engines:
            cmd += ["--engine", f"{e.name}=tcp://127.0.0.1:{e.ports.rpc}"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "round 0 done" in r.stderr and "24 requests" in r.stderr, r.stderr
        assert "route errors 0" in r.stderr, r.stderr
        # Every engine got work (KV-aware routing still spreads 24 mixed requests) and the
        # aggregator applied its events.
        loads = {e.name: e.call({"op": "drain"}, "drained", 60)["published"] for e in fleet.engines}
        assert all(n > 0 for n in loads.values()), loads

        def applied() -> bool:
            engines = httpx.get(f"{fleet.url}/v1/engines", timeout=5).json()["engines"]
            return all(p["batches"] > 0 for p in engines) and len(engines) == 2

        assert wait_until(applied, 30, 0.2)
        lookups = httpx.get(f"{fleet.url}/metrics", timeout=5).text
        assert any(line.startswith("kvevents_lookups_total") and not line.endswith(" 0.0")
                   for line in lookups.splitlines()), "no /v1/route lookups counted"
    finally:
        fleet.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
