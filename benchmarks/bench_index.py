"""Benchmark of the prefix index (TARGETS P2, P4, P8, and in-process ingest).

Older, flattering shapes (large events, per-engine salted hashes), kept as extra rows; the
figures that count are the side-by-side ones on the realistic trace (bench_dynamo.py).

For each index size (x1, x4, x16, x64: 64 engines x 1,563 .. 100,000 resident 16-token
blocks; x64 is the P2 configuration) a realistic workload (benchmarks/workload.py) is
generated once to a file, then replayed ``--runs`` times, each in a fresh process that
only decodes and applies it, so that RSS growth is the index's own:

* ingest: blocks applied per second by ``PrefixIndex.apply_batch`` (decode excluded,
  reported separately), over the whole fill + steady store/remove phase;
* P4: RSS growth (``/proc/self/statm``, after ``gc.collect()``) / resident entries;
* P2: ``lookup`` latency p50 / p99 for 2,048- and 32,768-token prompts (token lists,
  as the HTTP layer passes them), prompts that hit long cached prefixes.

Medians over runs are printed as a table and written as JSON.

    .venv/bin/python benchmarks/bench_index.py            # full (a few minutes)
    .venv/bin/python benchmarks/bench_index.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workload import MODEL, Workload, read, write  # noqa: E402

FULL_CAPACITY = 100_000
SCALES = [1, 4, 16, 64]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(path: str, engines: int, capacity: int, lookups: int) -> dict:
    import numpy as np

    from kvevents.index import PrefixIndex
    from kvevents.index.wire import IngestDecoder

    dec = IngestDecoder()  # as the aggregator decodes
    idx = PrefixIndex()
    gc.collect()
    rss0 = rss_bytes()
    t_apply = t_dec = 0.0
    blocks = events = 0
    for engine, payload in read(path):
        t0 = time.perf_counter()
        batch = dec.decode(payload).batch
        t1 = time.perf_counter()
        st = idx.apply_batch(engine, batch, model=MODEL)
        t_apply += time.perf_counter() - t1
        t_dec += t1 - t0
        blocks += st.stored_blocks + st.removed_blocks
        events += st.events
    del batch, payload
    gc.collect()
    rss1 = rss_bytes()
    c = idx.counters()
    out = {
        "blocks_applied": blocks,
        "events_applied": events,
        "apply_s": t_apply,
        "apply_blocks_per_s": blocks / t_apply,
        "decode_blocks_per_s": blocks / t_dec,
        "resident_entries": c.resident_entries,
        "distinct_blocks": c.distinct_blocks,
        "rss_growth_bytes": rss1 - rss0,
        "bytes_per_entry": (rss1 - rss0) / c.resident_entries,
        "array_bytes_per_entry": idx.memory_bytes() / c.resident_entries,
    }
    w = Workload(engines=engines, capacity=capacity)
    for n_tok in (2048, 32768):
        prompts = w.prompts(n_tok)
        for p in prompts[:10]:
            idx.lookup(p, model=MODEL)
        lat = []
        matched = []
        for i in range(lookups):
            p = prompts[i % len(prompts)]
            t0 = time.perf_counter_ns()
            r = idx.lookup(p, model=MODEL)
            lat.append((time.perf_counter_ns() - t0) / 1000)
            matched.append(r.engines[0].tokens if r.engines else 0)
        lat.sort()
        out[f"lookup_{n_tok}"] = {
            "p50_us": lat[len(lat) // 2],
            "p99_us": lat[int(len(lat) * 0.99)],
            "mean_best_match_tokens": float(np.mean(matched)),
        }
    return out


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--json", default="benchmarks/results/index.json")
    ap.add_argument("--scales", default=",".join(map(str, SCALES)))
    ap.add_argument("--workdir", default="/tmp/kvevents-bench-index")
    ap.add_argument("--worker", nargs=4, metavar=("PATH", "ENGINES", "CAPACITY", "LOOKUPS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        path, engines, cap, lk = a.worker
        print(json.dumps(worker(path, int(engines), int(cap), int(lk))))
        return
    engines = 8 if a.quick else 64
    full = 64_000 if a.quick else FULL_CAPACITY
    runs = 1 if a.quick else a.runs
    lookups = 300 if a.quick else a.lookups
    os.makedirs(a.workdir, exist_ok=True)
    results = []
    scales = [1, 4, 16] if a.quick and a.scales == ",".join(map(str, SCALES)) else [int(s) for s in a.scales.split(",")]
    for scale in scales:
        cap = max(1, full * scale // 64)
        w = Workload(engines=engines, capacity=cap)
        path = os.path.join(a.workdir, f"wl-{engines}x{cap}.bin")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            write(w, path + ".tmp")
            os.replace(path + ".tmp", path)
            print(f"generated {path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        rs = []
        for _ in range(runs):
            p = subprocess.run(
                [sys.executable, __file__, "--worker", path, str(engines), str(cap), str(lookups)],
                check=True, capture_output=True, text=True,
            )
            rs.append(json.loads(p.stdout.strip().splitlines()[-1]))

        def med(f):
            return statistics.median(f(r) for r in rs)

        results.append({
            "scale": f"x{scale}", "engines": engines, "capacity_per_engine": cap,
            "resident_entries": int(med(lambda r: r["resident_entries"])),
            "distinct_blocks": int(med(lambda r: r["distinct_blocks"])),
            "apply_blocks_per_s": med(lambda r: r["apply_blocks_per_s"]),
            "decode_blocks_per_s": med(lambda r: r["decode_blocks_per_s"]),
            "bytes_per_entry": med(lambda r: r["bytes_per_entry"]),
            "array_bytes_per_entry": med(lambda r: r["array_bytes_per_entry"]),
            "lookup_2048_p50_us": med(lambda r: r["lookup_2048"]["p50_us"]),
            "lookup_2048_p99_us": med(lambda r: r["lookup_2048"]["p99_us"]),
            "lookup_2048_match_tokens": med(lambda r: r["lookup_2048"]["mean_best_match_tokens"]),
            "lookup_32768_p50_us": med(lambda r: r["lookup_32768"]["p50_us"]),
            "lookup_32768_p99_us": med(lambda r: r["lookup_32768"]["p99_us"]),
            "lookup_32768_match_tokens": med(lambda r: r["lookup_32768"]["mean_best_match_tokens"]),
            "runs": rs,
        })
        r = results[-1]
        print(f"x{scale}: {r['resident_entries']:,} entries, {r['apply_blocks_per_s']:,.0f} blk/s, "
              f"{r['bytes_per_entry']:.0f} B/entry, 2k p99 {r['lookup_2048_p99_us']:.0f} us, "
              f"32k p99 {r['lookup_32768_p99_us']:.0f} us", file=sys.stderr)
    cols = [
        ("scale", "scale", "{}"), ("entries", "resident_entries", "{:,}"),
        ("distinct", "distinct_blocks", "{:,}"), ("apply blk/s", "apply_blocks_per_s", "{:,.0f}"),
        ("decode blk/s", "decode_blocks_per_s", "{:,.0f}"), ("B/entry", "bytes_per_entry", "{:.1f}"),
        ("2k p50 us", "lookup_2048_p50_us", "{:.1f}"), ("2k p99 us", "lookup_2048_p99_us", "{:.1f}"),
        ("2k hit tok", "lookup_2048_match_tokens", "{:.0f}"),
        ("32k p50 us", "lookup_32768_p50_us", "{:.1f}"), ("32k p99 us", "lookup_32768_p99_us", "{:.1f}"),
        ("32k hit tok", "lookup_32768_match_tokens", "{:.0f}"),
    ]
    rows = [[fmt.format(r[k]) for _, k, fmt in cols] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (h, _, _) in enumerate(cols)]
    print(" | ".join(h.rjust(wd) for (h, _, _), wd in zip(cols, widths)))
    print("-+-".join("-" * wd for wd in widths))
    for row in rows:
        print(" | ".join(v.rjust(wd) for v, wd in zip(row, widths)))
    m = machine()
    print(f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; medians of {runs} run(s)")
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"machine": m, "quick": a.quick, "runs": runs, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
