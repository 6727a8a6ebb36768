"""Write gpu-report.json: the device, its software, the GPU tests' counts and every
benchmark figure of one ``benchmarks/gpu/check.sh`` run, and print a summary.

    python benchmarks/gpu/report.py --out R.json --junit T.xml --bench B.json --tests-rc N --bench-rc N --seconds S
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import torch


def device_info() -> dict:
    info = {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}")
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def test_counts(junit: Path) -> dict:
    """passed / failed / skipped from pytest's JUnit XML (errors count as failed)."""
    if not junit.exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "error": f"{junit.name} missing (pytest did not finish)"}
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failures = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--junit", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--tests-rc", type=int, required=True)
    ap.add_argument("--bench-rc", type=int, required=True)
    ap.add_argument("--seconds", type=int, required=True)
    a = ap.parse_args()
    bench_path = Path(a.bench)
    bench = json.loads(bench_path.read_text()) if bench_path.exists() and a.bench_rc == 0 else None
    report = {**device_info(), "tests": test_counts(Path(a.junit)), "tests_exit": a.tests_rc,
              "benchmark": bench, "benchmark_exit": a.bench_rc, "seconds": a.seconds,
              "ok": a.tests_rc == 0 and a.bench_rc == 0}
    Path(a.out).write_text(json.dumps(report, indent=2))
    t = report["tests"]
    print(f"== gpu-report: {report['device']} {report.get('name')} torch {report['torch']} cuda {report['cuda']}: "
          f"tests {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped; "
          f"benchmark {'worst ratio %.2f' % bench['worst_ratio'] if bench else 'FAILED'}; {a.seconds} s -> {a.out}")


if __name__ == "__main__":
    main()
