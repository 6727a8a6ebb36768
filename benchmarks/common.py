"""Helpers shared by the benchmark scripts: machine description, stats, JSON output."""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    child = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec " + shlex.join(argv)])
    # A SIGTERM (timeout, kill) reaches the benchmark inside too, which then stops what
    # it started (its finally blocks) instead of leaving engines running for nobody.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def main_in_loopback_netns(script: str, a, inner) -> None:
    """A benchmark's main: ``inner(a)`` when run inside already (``a.inner``), else
    ``script`` again inside ``unshare -n`` (:func:`rerun_in_loopback_netns`), told the
    command line it was given (``--command``, printed with its figures); exits with the
    status."""
    if a.inner:
        # (SIGTERM as SystemExit: the finally blocks stop the engines and routers started)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        sys.exit(inner(a))
    argv = sys.argv[1:]
    root = Path(script).resolve().parent.parent
    exe = os.path.relpath(sys.executable, root) if sys.executable.startswith(str(root)) else sys.executable
    command = a.command or " ".join(shlex.quote(x) for x in [exe, os.path.relpath(script, root), *argv])
    sys.exit(rerun_in_loopback_netns(script, [*argv, "--command", command]))


def gil_holds(metrics_text: str) -> dict[float, int]:
    """``kvevents_ingest_gil_hold_seconds``' cumulative bucket counts by bound, from a
    ``/metrics`` page (empty for a server without it)."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("kvevents_ingest_gil_hold_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = int(float(line.rsplit(" ", 1)[1]))
    return out


def gil_hold_window(before: dict[float, int], after: dict[float, int]) -> dict:
    """The ingest thread's stretches between GIL releases during a window, from the
    histogram before and after it: how many, how many over 0.5 ms, and the smallest
    bucket bound that covers the longest (an upper bound of it; inf: beyond the last)."""
    delta = {b: after.get(b, 0) - before.get(b, 0) for b in after}
    bounds = sorted(delta)
    if not bounds:
        return {"gil_stretches": None, "gil_over_0_5ms": None, "gil_longest_le_s": None}
    total = delta[bounds[-1]]
    under = max((delta[b] for b in bounds if b <= 0.0005), default=0)
    longest = next((b for b in bounds if delta[b] == total), None)
    return {"gil_stretches": total, "gil_over_0_5ms": total - under, "gil_longest_le_s": longest}
