"""Churn through discovery leaves nothing behind: the churn target of benchmarks/bench_churn.py
(1,000 cycles, 50 engines) at a test's size (200 cycles, 20 engines at a time).

A real aggregator and discovery manager (grace 0.2 s) follow a listing of real publishers
on 127.0.0.1 in front of vLLM-like block pools; engines are replaced two at a time (half
shut down before they are delisted, half delisted while still publishing), and every 20
cycles one comes back under the same name as a new process, alternately at its old ports
and at new ports while the old process still publishes. After a warm-up that replaces
every engine once, and again at the end, once the grace period has passed and everything
published is applied: open fds, threads (Python and OS, ZeroMQ's IO threads included) and
metric series are back where they were; RSS grew by less than 25 MB (the benchmark's 20 MB,
looser for a run whose warm-up is shorter); the index holds exactly what each followed
engine's pool holds (blocks and lookups), and nothing keeps state of a removed engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_churn import Churn  # noqa: E402

ENGINES = 20
WAVE = 2
CYCLES = 200
RSS_LIMIT_MB = 25


@pytest.mark.timeout(120)
def test_churn_through_discovery_leaves_nothing_behind():
    churn = Churn(engines=ENGINES, wave=WAVE, grace_s=0.2, restart_every=20, seed=1,
                  settle_s=15)
    churn.start()
    try:
        for _ in range(ENGINES // WAVE):  # warm-up: every engine replaced once
            churn.wave()
        start = churn.measure()
        assert start.index_exact, start.index_problems
        assert not start.leftovers, start.leftovers
        first, restarts = churn.cycles, dict(churn.restarts)
        while churn.cycles - first < CYCLES:
            churn.wave()
        end = churn.measure()
    finally:
        churn.stop()

    assert churn.cycles - first == CYCLES
    assert {k: n - restarts[k] for k, n in churn.restarts.items()} == {"same ports": 5,
                                                                       "new ports": 5}
    assert churn.disc.removed >= CYCLES
    # The index: exactly the pools of the engines followed, nothing of the removed ones.
    assert end.index_exact, end.index_problems
    assert not end.leftovers, end.leftovers
    assert end.followed == start.followed == ENGINES
    # Resources and series back to where they were.
    assert end.fds == start.fds
    assert end.py_threads == start.py_threads
    assert end.os_threads == start.os_threads
    assert end.engine_series == start.engine_series, (start.per_family, end.per_family)
    assert end.all_series == start.all_series
    assert (end.rss_kb - start.rss_kb) / 1024 < RSS_LIMIT_MB, (start.rss_kb, end.rss_kb)
