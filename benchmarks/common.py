"""Helpers shared by the benchmark scripts: machine description, stats, JSON output."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_json(path: str, payload: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {p}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def rerun_in_loopback_netns(script: str, args: list[str]) -> int:
    """Run ``script --inner *args`` with this interpreter inside ``unshare -n`` (a network
    namespace whose only interface is loopback, brought up first) and return its exit
    status. For peers that listen on 0.0.0.0 (``dynamo.indexer``): inside, nothing but
    127.0.0.1 exists. Needs root or user namespaces."""
    argv = [sys.executable, os.path.abspath(script), "--inner", *args]
    return subprocess.call(["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + shlex.join(argv)])
