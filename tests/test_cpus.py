"""``--workers auto``: the cores this process may use, from its CPU affinity and its
cgroup's CPU quota (kvevents/service/cpus.py).

* On cgroup trees written to a tmp dir as the kernel lays them out (v2: ``cpu.max`` and
  ``cgroup.controllers``; v1: the ``cpu`` controller's ``cpu.cfs_quota_us`` and
  ``cpu.cfs_period_us``), with the ``/proc/self/cgroup`` a process in such a tree reads:
  the quota is rounded up, never below 1, never above the affinity, the tightest over
  the process's cgroup and those above it counts, and "no quota" (``max``, -1, files
  absent or unreadable) leaves the affinity.
* For real: a fresh interpreter in a mount namespace whose ``/sys/fs/cgroup`` carries a
  quota of 1 CPU (as a container limited to 1 CPU sees it) loads ``workers = "auto"``
  through the settings ``kvevents serve`` reads, from the real paths. Needs root and
  ``unshare``; skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvevents.service.cpus import cgroup_cpu_quota, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))
ROOT = Path(__file__).resolve().parent.parent


def _v2(tmp_path: Path, own: str, cpu_max: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 tree (``cpu_max``: cgroup path -> ``cpu.max``) and the process's
    ``/proc/self/cgroup`` naming cgroup ``own``."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for path in {own, *cpu_max}:
        (root / path.strip("/")).mkdir(parents=True, exist_ok=True)
    for path, text in cpu_max.items():
        (root / path.strip("/") / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def _v1(tmp_path: Path, own: str, quotas: dict[str, tuple[str, str]],
        mount: str = "cpu,cpuacct") -> tuple[Path, Path]:
    """A cgroup v1 tree with the cpu controller at ``mount`` (``quotas``: cgroup path ->
    (cpu.cfs_quota_us, cpu.cfs_period_us)) and the ``/proc/self/cgroup`` naming ``own``."""
    root = tmp_path / "cgroup"
    base = root / mount
    base.mkdir(parents=True)
    (root / "memory").mkdir()
    for path, (quota, period) in quotas.items():
        d = base / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(quota + "\n")
        (d / "cpu.cfs_period_us").write_text(period + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"12:memory:{own}\n4:cpu,cpuacct:{own}\n1:name=systemd:{own}\n")
    return root, proc


def test_v2_quota_is_rounded_up_and_capped_by_the_affinity(tmp_path):
    root, proc = _v2(tmp_path, "/", {"/": "150000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert usable_cpus(root, proc) == min(AFFINITY, 2)


@pytest.mark.parametrize("cpu_max, quota", [("100000 100000", 1.0), ("50000 100000", 0.5),
                                            ("1000 100000", 0.01), ("200000", 2.0)])
def test_a_quota_of_one_cpu_or_less_gives_one_worker(tmp_path, cpu_max, quota):
    root, proc = _v2(tmp_path, "/", {"/": cpu_max})
    assert cgroup_cpu_quota(root, proc) == quota
    assert usable_cpus(root, proc) == (1 if quota <= 1 else min(AFFINITY, 2))


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path):
    root, proc = _v2(tmp_path, "/", {"/": f"{(AFFINITY + 3) * 100000} 100000"})
    assert usable_cpus(root, proc) == AFFINITY


def test_v2_tightest_quota_over_the_own_cgroup_and_its_parents(tmp_path):
    # A pod's limit on the pod cgroup, a looser one on its container: the pod's counts.
    own = "/kubepods.slice/pod1/ctr"
    root, proc = _v2(tmp_path, own, {"/": "max 100000", "/kubepods.slice/pod1": "100000 100000",
                                     own: "400000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.0
    assert usable_cpus(root, proc) == 1


def test_v2_no_quota(tmp_path):
    root, proc = _v2(tmp_path, "/system.slice/x.service",
                     {"/": "max 100000", "/system.slice/x.service": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cpus(root, proc) == AFFINITY


def test_v1_quota(tmp_path):
    root, proc = _v1(tmp_path, "/", {"/": ("50000", "100000")})
    assert cgroup_cpu_quota(root, proc) == 0.5
    assert usable_cpus(root, proc) == 1


def test_v1_controller_mounted_alone_and_quota_on_a_parent(tmp_path):
    own = "/kubepods/burstable/pod1/ctr"
    root, proc = _v1(tmp_path, own, {"/": ("-1", "100000"), "/kubepods/burstable/pod1": ("100000", "100000"),
                                     own: ("-1", "100000")}, mount="cpu")
    assert cgroup_cpu_quota(root, proc) == 1.0
    assert usable_cpus(root, proc) == 1


def test_v1_host_path_not_under_the_mount_falls_back_to_its_root(tmp_path):
    # A container without its own cgroup namespace: /proc/self/cgroup names the host's
    # path, and the container sees its own cgroup at the mount's root.
    root, proc = _v1(tmp_path, "/docker/abc123", {"/": ("100000", "100000")})
    assert not (root / "cpu,cpuacct/docker").exists()
    assert usable_cpus(root, proc) == 1


def test_v1_no_quota(tmp_path):
    root, proc = _v1(tmp_path, "/", {"/": ("-1", "100000")})
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cpus(root, proc) == AFFINITY


@pytest.mark.parametrize("cpu_max", ["", "garbage", "100000 0", "abc 100000", "-5 100000"])
def test_unreadable_quotas_are_ignored(tmp_path, cpu_max):
    root, proc = _v2(tmp_path, "/", {"/": cpu_max})
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cpus(root, proc) == AFFINITY


def test_no_cgroup_at_all(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "none.cgroup") is None
    assert usable_cpus(tmp_path / "none", tmp_path / "none.cgroup") == AFFINITY


_LOAD = ("from kvevents.service.settings import load_settings; "
         "print(load_settings(env={}, workers='auto').workers)")


def _in_fake_container(setup: str) -> subprocess.CompletedProcess:
    """``_LOAD`` in a fresh interpreter, in a mount namespace whose /sys/fs/cgroup is a
    tmpfs that ``setup`` (shell, run in it) fills as a container's would look."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give a process a cgroup tree of its own")
    script = (f"mount -t tmpfs none /sys/fs/cgroup && cd /sys/fs/cgroup && {setup} && "
              f'cd "$KV_ROOT" && exec "$KV_PY" -c "$KV_LOAD"')
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "KV_ROOT": str(ROOT),
                                           "KV_PY": sys.executable, "KV_LOAD": _LOAD})
    if proc.returncode and "mount" in proc.stderr and "ermission" in proc.stderr:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return proc


def test_workers_auto_in_a_container_limited_to_one_cpu_v2():
    proc = _in_fake_container("touch cgroup.controllers && echo '100000 100000' > cpu.max")
    assert int(proc.stdout) == 1, (proc.stdout, AFFINITY)


def test_workers_auto_in_a_container_limited_to_one_cpu_v1():
    proc = _in_fake_container("mkdir cpu && echo 100000 > cpu/cpu.cfs_quota_us && "
                              "echo 100000 > cpu/cpu.cfs_period_us")
    assert int(proc.stdout) == 1, (proc.stdout, AFFINITY)


def test_workers_auto_without_a_quota_is_the_affinity():
    proc = _in_fake_container("touch cgroup.controllers && echo 'max 100000' > cpu.max")
    assert int(proc.stdout) == AFFINITY
