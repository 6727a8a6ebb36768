"""Side by side with Dynamo 1.6.1 on the realistic trace (TARGETS P1, P2, P4, P8).

Needs the bench venv (see benchmarks/README.md): the project and
``ai-dynamo-runtime==1.6.1``. Each trace (benchmarks/kvtrace.py) is generated once and
cached in ``--workdir``. Three measurements, both sides in the same invocation:

* ``inproc``: ingest from the same msgpack bytes, in process, runs alternating (ours:
  ``IngestDecoder().decode``, as the aggregator decodes, +
  ``PrefixIndex.apply_batch``; Dynamo: the conversion in
  benchmarks/dynamo_side.py + ``RadixTree.apply_event``; Dynamo's apply-only rate on
  pre-converted JSON is shown too); then lookup p50/p99 at 2,048 and 32,768 tokens,
  alternating per prompt, every answer checked against the other side and against the
  generator's truth (matched blocks per engine);
* ``memory``: RSS growth / resident (engine, block) entries, each side alone in a fresh
  subprocess that streams the trace from disk;
* ``e2e``: see benchmarks/bench_dynamo_e2e.py.

    .venv-bench/bin/python benchmarks/bench_dynamo.py inproc --engines 16 --capacity 20000 --runs 3
    .venv-bench/bin/python benchmarks/bench_dynamo.py memory --engines 64 --capacity 50000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvevents  # noqa: E402
from common import machine, percentile, print_table, write_json  # noqa: E402
from dynamo_side import DynamoFeeder, available  # noqa: E402
from kvevents.index import PrefixIndex  # noqa: E402
from kvevents.index.wire import IngestDecoder  # noqa: E402
from kvtrace import BS, MODEL, TraceConfig, add_trace_args, expected_blocks, generate, load_truth, read  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ours_ingest(records: list[tuple[str, bytes]]) -> tuple[PrefixIndex, float]:
    dec = IngestDecoder()  # as the aggregator decodes
    idx = PrefixIndex()
    t0 = time.perf_counter()
    for engine, payload in records:
        idx.apply_batch(engine, dec.decode(payload).batch, model=MODEL)
    return idx, time.perf_counter() - t0


def dynamo_ingest(records: list[tuple[str, bytes]]) -> tuple[DynamoFeeder, float]:
    feed = DynamoFeeder()
    t0 = time.perf_counter()
    for engine, payload in records:
        feed.apply(engine, payload)
    feed.barrier()
    return feed, time.perf_counter() - t0


def dynamo_apply_only(records: list[tuple[str, bytes]]) -> float:
    """Seconds for ``apply_event`` alone, on events converted beforehand."""
    from dynamo_side import worker_id

    conv = DynamoFeeder()
    events = [(worker_id(engine), ev) for engine, payload in records for ev in conv.convert(payload)]
    feed = DynamoFeeder()
    apply = feed.tree.apply_event
    t0 = time.perf_counter()
    for w, ev in events:
        apply(w, ev)
    feed.barrier()
    return time.perf_counter() - t0


def ours_answer(idx: PrefixIndex, tokens: list[int]) -> dict[str, int]:
    r = idx.lookup(tokens, model=MODEL)
    return {p.engine: p.tokens // BS for p in r.engines if p.tokens}


def lookups(idx: PrefixIndex, feed: DynamoFeeder, resident, prompts, n: int) -> dict:
    """Alternating timed lookups; every distinct prompt's answers checked once."""
    lists = [p.tolist() for p in prompts]
    mismatch_truth = {"ours": 0, "dynamo": 0}
    hit_blocks = []
    for p, arr in zip(lists, prompts):
        exp = expected_blocks(resident, arr)
        hit_blocks.append(max(exp.values(), default=0))
        mismatch_truth["ours"] += ours_answer(idx, p) != exp
        mismatch_truth["dynamo"] += feed.lookup(p) != exp
    for p in lists[:8]:  # warm-up
        idx.lookup(p, model=MODEL)
        feed.lookup_raw(p)
    ours, dyn = [], []
    clock = time.perf_counter_ns
    for i in range(n):
        p = lists[i % len(lists)]
        if i % 2:
            t = clock(); feed.lookup_raw(p); dyn.append(clock() - t)  # noqa: E702
            t = clock(); idx.lookup(p, model=MODEL); ours.append(clock() - t)  # noqa: E702
        else:
            t = clock(); idx.lookup(p, model=MODEL); ours.append(clock() - t)  # noqa: E702
            t = clock(); feed.lookup_raw(p); dyn.append(clock() - t)  # noqa: E702
    out = {"prompts": len(lists), "lookups": n, "mismatches_vs_truth": mismatch_truth,
           "mean_best_hit_blocks": round(sum(hit_blocks) / len(hit_blocks), 1),
           "full_hits": sum(h == len(lists[0]) // BS for h in hit_blocks),
           "misses": sum(h == 0 for h in hit_blocks)}
    for side, lat in (("ours", ours), ("dynamo", dyn)):
        us = [x / 1000 for x in lat]
        out[side] = {"p50_us": round(percentile(us, 50), 1), "p99_us": round(percentile(us, 99), 1)}
    out["ratio_p50"] = round(out["ours"]["p50_us"] / out["dynamo"]["p50_us"], 2)
    out["ratio_p99"] = round(out["ours"]["p99_us"] / out["dynamo"]["p99_us"], 2)
    return out


def cmd_inproc(a, cfg: TraceConfig, paths: dict, meta: dict) -> dict:
    records = list(read(paths["trace"]))
    blocks = meta["block_events"]
    runs = []
    idx = feed = None
    for r in range(a.runs):
        order = ("ours", "dynamo") if r % 2 == 0 else ("dynamo", "ours")
        row = {}
        for side in order:
            idx = feed = None
            gc.collect()
            if side == "ours":
                idx, s = ours_ingest(records)
            else:
                feed, s = dynamo_ingest(records)
            row[side] = round(blocks / s)
        row["dynamo_apply_only"] = 0 if a.skip_apply_only else round(blocks / dynamo_apply_only(records))
        row["ratio"] = round(row["ours"] / row["dynamo"], 2)
        runs.append(row)
        print(f"  run {r}: ours {row['ours']:,} vs dynamo {row['dynamo']:,} block events/s "
              f"(dynamo apply only {row['dynamo_apply_only']:,})", file=sys.stderr)
    # The last run's two indexes hold the whole trace: answer lookups from both.
    if idx is None:
        idx, _ = ours_ingest(records)
    if feed is None:
        feed, _ = dynamo_ingest(records)
    del records
    resident, prompts = load_truth(paths["truth"])
    res_entries = idx.counters().resident_entries
    look = {n: lookups(idx, feed, resident, prompts[n], a.lookups if n <= 2048 else a.lookups_long)
            for n in sorted(prompts)}
    med = sorted(runs, key=lambda x: x["ratio"])[len(runs) // 2]
    return {"ingest_runs": runs, "ingest_median": med, "lookup": look,
            "resident_entries_ours": res_entries, "resident_entries_truth": meta["resident_entries"]}


def memory_worker(side: str, trace: str, resident_entries: int) -> dict:
    gc.collect()
    rss0 = rss_bytes()
    if side == "ours":
        dec = IngestDecoder()  # as the aggregator decodes
        idx = PrefixIndex()
        for engine, payload in read(trace):
            idx.apply_batch(engine, dec.decode(payload).batch, model=MODEL)
        entries = idx.counters().resident_entries
    else:
        feed = DynamoFeeder()
        for engine, payload in read(trace):
            feed.apply(engine, payload)
        feed.barrier()
        entries = resident_entries
    gc.collect()
    growth = rss_bytes() - rss0
    return {"side": side, "rss_growth_bytes": growth, "resident_entries": entries,
            "bytes_per_entry": round(growth / entries, 1)}


def cmd_memory(a, cfg: TraceConfig, paths: dict, meta: dict) -> dict:
    out = {}
    for side in ("ours", "dynamo"):
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "memory-worker", side,
                            paths["trace"], str(meta["resident_entries"])],
                           check=True, capture_output=True, text=True, timeout=1800)
        out[side] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"  {side}: {out[side]['bytes_per_entry']} B/entry at "
              f"{out[side]['resident_entries']:,} entries", file=sys.stderr)
    out["ratio"] = round(out["ours"]["bytes_per_entry"] / out["dynamo"]["bytes_per_entry"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["inproc", "memory", "memory-worker"])
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    add_trace_args(ap)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=2000, help="timed 2k lookups per side")
    ap.add_argument("--lookups-long", type=int, default=400, help="timed 32k lookups per side")
    ap.add_argument("--skip-apply-only", action="store_true",
                    help="skip Dynamo's apply_event-only rate (converting the trace twice is slow)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.mode == "memory-worker":
        side, trace, entries = a.args
        print(json.dumps(memory_worker(side, trace, int(entries))))
        return
    if not available():
        sys.exit("ai-dynamo-runtime is not installed in this interpreter (see benchmarks/README.md)")
    print(f"kvevents from {kvevents.__file__}", file=sys.stderr)
    cfg = TraceConfig.from_args(a)
    paths = generate(cfg, a.workdir)
    with open(paths["meta"]) as f:
        meta = json.load(f)
    shape = f"{cfg.engines} engines x {cfg.capacity:,} blocks"
    print(f"{shape}: {meta['requests']:,} requests, {meta['events']:,} events, "
          f"{meta['block_events']:,} block events, {meta['resident_entries']:,} resident",
          file=sys.stderr)
    result = (cmd_inproc if a.mode == "inproc" else cmd_memory)(a, cfg, paths, meta)
    if a.mode == "inproc":
        m = result["ingest_median"]
        rows = [["ingest from msgpack bytes (block events/s)", f"{m['ours']:,}", f"{m['dynamo']:,}",
                 f"{m['ratio']}x", f"Dynamo apply only {m['dynamo_apply_only']:,}"]]
        for n, lk in result["lookup"].items():
            rows.append([f"lookup {n:,} tokens p50 / p99 (us)",
                         f"{lk['ours']['p50_us']} / {lk['ours']['p99_us']}",
                         f"{lk['dynamo']['p50_us']} / {lk['dynamo']['p99_us']}",
                         f"{lk['ratio_p50']}x / {lk['ratio_p99']}x",
                         f"{lk['prompts']} prompts ({lk['full_hits']} full, {lk['misses']} miss); "
                         f"wrong vs truth: ours {lk['mismatches_vs_truth']['ours']}, "
                         f"dynamo {lk['mismatches_vs_truth']['dynamo']}"])
    else:
        rows = [["bytes per resident (engine, block) entry", result["ours"]["bytes_per_entry"],
                 result["dynamo"]["bytes_per_entry"], f"{result['ratio']}x",
                 f"{result['ours']['resident_entries']:,} entries"]]
    print(f"\n{shape} (ours / Dynamo 1.6.1, same run)")
    print_table(["measure", "ours", "dynamo", "ratio", "note"], rows)
    path = a.json or f"benchmarks/results/dynamo-{a.mode}-p{cfg.engines}-c{cfg.capacity}.json"
    write_json(path, {"benchmark": f"side by side with Dynamo: {a.mode}", "machine": machine(),
                      "kvevents": kvevents.__file__, "trace": meta | {"per_engine": None},
                      "args": vars(a), "result": result})


if __name__ == "__main__":
    main()
