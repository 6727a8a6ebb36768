"""How many cores this process may use: ``--workers auto``.

The smaller of two limits, at least 1:

* the CPUs the scheduler lets it run on (``os.sched_getaffinity``: a cpuset or
  ``taskset`` narrows it);
* its cgroup's CPU quota, rounded up: a container's CPU limit (Kubernetes
  ``resources.limits.cpu``, ``docker run --cpus``). cgroup v2 reads ``cpu.max``
  (``QUOTA PERIOD``, or ``max``: none); cgroup v1 reads ``cpu.cfs_quota_us`` (-1: none)
  and ``cpu.cfs_period_us``. The quota is looked for in this process's own cgroup (from
  ``/proc/self/cgroup``) and every cgroup above it (the tightest counts), and at the
  root of the mount (a container with its own cgroup namespace sees its cgroup there).

``os.cpu_count()`` counts the node's cores, which a container's quota does not change:
in a pod limited to 2 CPUs on a 64-core node it would start 64 workers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _own_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path: (v2's, v1's cpu controller's), None where absent."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _dirs(mount: Path, own: str | None) -> list[Path]:
    """The cgroup directories whose quota applies: the process's own and those above
    it that exist under ``mount``, then the mount's root."""
    out = []
    parts = [p for p in (own or "").split("/") if p]
    for n in range(len(parts), 0, -1):
        d = mount.joinpath(*parts[:n])
        if d.is_dir():
            out.append(d)
    out.append(mount)
    return out


def _quota_v2(d: Path) -> float | None:
    text = _read(d / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    try:
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (ValueError, ZeroDivisionError):
        return None


def _quota_v1(d: Path) -> float | None:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota over this process's cgroups, in CPUs (e.g. 1.5); None when
    no cgroup sets one."""
    v2_path, v1_path = _own_paths(proc_cgroup)
    quotas = []
    if (root / "cgroup.controllers").exists():  # cgroup v2 mounted at the root
        quotas += [_quota_v2(d) for d in _dirs(root, v2_path)]
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # cgroup v1's cpu controller
        mount = root / name
        if mount.is_dir():
            quotas += [_quota_v1(d) for d in _dirs(mount, v1_path)]
            break
    quotas = [q for q in quotas if q is not None and q > 0]
    return min(quotas) if quotas else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may use: the smaller of its CPU affinity and its cgroup's
    CPU quota rounded up; at least 1 (module docstring)."""
    n = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)
