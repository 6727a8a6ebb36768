"""Hostile but legal input against our index (TARGETS P8): memory and lookup cost.

Each shape runs in a fresh subprocess: build an index from the realistic trace
(benchmarks/kvtrace.py), measure RSS and 2,048-token lookup p50, apply the hostile
events from one extra engine of the same model, apply ``--after`` ordinary blocks from
another new engine (does the hostile input make later ordinary blocks dearer?), and
measure again. A control run applies only the ordinary blocks. Shapes:

* ``huge_block``: one ``BlockStored`` with ``block_size`` 262,144 (one block);
* ``block_sizes``: 2,048 one-block events, each with its own block size (17 .. 2,064);
* ``lora_names``: 65,536 one-block events, each under its own LoRA name; then one
  event under yet another new LoRA name is probed: indexed, refused or lost.

Each worker's address space is capped (``KVEVENTS_BENCH_MAX_GB``, default 6) so an
index that allocates without bound fails with a recorded MemoryError instead of
swallowing the machine. Reported per shape: RSS growth (MB), lookup p50 before/after, and every counter of
``PrefixIndex.counters()`` that changed (read generically: whatever fields the index
has), so refused events show up under whatever name the index counts them.

    .venv/bin/python benchmarks/bench_hostile.py [--engines 8 --capacity 10000]

Hostile HTTP clients against the gateway (disconnect storms, over capacity, malformed
bodies, slowloris, slow readers): ``benchmarks/bench_hostile_clients.py``.
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

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

import kvevents  # noqa: E402
from common import machine, percentile, print_table, write_json  # noqa: E402
from kvtrace import BS, MODEL, VOCAB, TraceConfig, generate, load_truth, read  # noqa: E402

SHAPES = ("control", "huge_block", "block_sizes", "lora_names")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _flat(counters) -> dict[str, float]:
    """Numeric leaves of a counters struct: ints as they are, dicts and lists summed by key."""
    out: dict[str, float] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, bool):
            out[prefix] = int(v)
        elif isinstance(v, (int, float)):
            out[prefix] = out.get(prefix, 0) + v
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(x, (int, float)):
                    out[prefix] = out.get(prefix, 0) + x  # per engine: total
                else:
                    walk(f"{prefix}.{k}", x)
        elif isinstance(v, list):
            for x in v:
                if isinstance(x, dict) and "events" in x:  # applied rows: by type
                    key = f"{prefix}.{x.get('type', '?')}"
                    out[key + ".events"] = out.get(key + ".events", 0) + x["events"]
                    out[key + ".blocks"] = out.get(key + ".blocks", 0) + x.get("blocks", 0)
                else:
                    walk(prefix, x)

    for k, v in msgspec.to_builtins(counters).items():
        walk(k, v)
    return out


def _p50(idx, prompts: list[list[int]], n: int) -> float:
    lat = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        t = time.perf_counter_ns()
        idx.lookup(p, model=MODEL)
        lat.append((time.perf_counter_ns() - t) / 1000)
    return percentile(lat, 50)


def _hostile_batches(shape: str, rng: np.random.Generator):
    from kvevents.wire.schema import BlockStored, KVEventBatch

    def stored(h: int, tokens: np.ndarray, bs: int, lora: str | None = None) -> BlockStored:
        return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=tokens.tolist(),
                           block_size=bs, lora_id=None, medium="GPU", lora_name=lora)

    if shape == "huge_block":
        yield KVEventBatch(0.0, [stored(1, rng.integers(0, VOCAB, 262_144, dtype=np.int32), 262_144)])
    elif shape == "block_sizes":
        evs = [stored(10 + i, rng.integers(0, VOCAB, 17 + i, dtype=np.int32), 17 + i) for i in range(2048)]
        for i in range(0, len(evs), 64):
            yield KVEventBatch(0.0, evs[i:i + 64])
    elif shape == "lora_names":
        for i in range(0, 65_536, 256):
            yield KVEventBatch(0.0, [stored(10 + j, rng.integers(0, VOCAB, BS, dtype=np.int32), BS,
                                            f"lora-{j}") for j in range(i, i + 256)])


def worker(shape: str, trace: str, truth: str, after: int, lookups: int) -> dict:
    import resource

    # A shape that makes the index allocate without bound must fail here (MemoryError,
    # recorded) rather than take the shared machine's memory.
    limit = int(float(os.environ.get("KVEVENTS_BENCH_MAX_GB", "6")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from kvevents.index import PrefixIndex
    from kvevents.index.wire import IngestDecoder
    from kvevents.wire.schema import BlockStored, KVEventBatch

    dec = IngestDecoder()  # as the aggregator decodes
    idx = PrefixIndex()
    rng = np.random.default_rng(7)
    gc.collect()
    rss_start = rss_mb()
    for engine, payload in read(trace):
        idx.apply_batch(engine, dec.decode(payload).batch, model=MODEL)
    _, prompts = load_truth(truth)
    plist = [p.tolist() for p in prompts[2048]]
    gc.collect()
    rss0 = rss_mb()
    c0 = _flat(idx.counters())
    p50_before = _p50(idx, plist, lookups)
    sent = errors = 0
    first_error = None
    t0 = time.perf_counter()
    for b in _hostile_batches(shape, rng):
        sent += len(b.events)
        try:  # apply_batch should never raise on content; if it does, that is a finding
            idx.apply_batch("hostile", b, model=MODEL)
        except Exception as exc:  # noqa: BLE001 - recorded and reported
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"[:200]
    hostile_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_mb()
    # Later ordinary blocks from a new engine: 64-block sequences of fresh content.
    later_errors = 0
    for i in range(0, after, 64):
        toks = rng.integers(0, VOCAB, 64 * BS, dtype=np.int32)
        hashes = [int(x) for x in rng.integers(1, 2**63, 64)]
        try:
            idx.apply_batch("later", KVEventBatch(0.0, [BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=toks.tolist(), block_size=BS,
                lora_id=None, medium="GPU", lora_name=None)]), model=MODEL)
        except Exception:  # noqa: BLE001 - counted and reported
            later_errors += 1
    probe = None
    if shape == "lora_names":  # one more new namespace after the flood: what happens to it?
        toks = rng.integers(0, VOCAB, BS, dtype=np.int32).tolist()
        try:
            idx.apply_batch("probe", KVEventBatch(0.0, [BlockStored(
                block_hashes=[5], parent_block_hash=None, token_ids=toks, block_size=BS, lora_id=None,
                medium="GPU", lora_name="after-the-flood")]), model=MODEL)
            r = idx.lookup(toks, model=MODEL, lora_name="after-the-flood")
            probe = "indexed" if any(p.engine == "probe" for p in r.engines) else "not indexed"
        except Exception as exc:  # noqa: BLE001
            probe = f"raised {type(exc).__name__}"
    gc.collect()
    rss2 = rss_mb()
    p50_after = _p50(idx, plist, lookups)
    c1 = _flat(idx.counters())
    changed = {k: c1.get(k, 0) - c0.get(k, 0) for k in sorted(set(c0) | set(c1))
               if c1.get(k, 0) != c0.get(k, 0)}
    return {"shape": shape, "hostile_events": sent, "hostile_apply_s": round(hostile_s, 3),
            "apply_batch_raised": errors, "first_error": first_error,
            "later_ordinary_batches_raised": later_errors,
            "index_rss_mb": round(rss0 - rss_start, 1),
            "rss_growth_hostile_mb": round(rss1 - rss0, 1),
            "rss_growth_after_ordinary_mb": round(rss2 - rss1, 1), "ordinary_blocks_after": after,
            "lookup_p50_before_us": round(p50_before, 1), "lookup_p50_after_us": round(p50_after, 1),
            "lookup_p50_ratio": round(p50_after / p50_before, 2), "new_namespace_probe": probe,
            "counters_changed": changed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=10_000)
    ap.add_argument("--after", type=int, default=20_000, help="ordinary blocks applied after")
    ap.add_argument("--lookups", type=int, default=400)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per shape")
    ap.add_argument("--workdir", default="/tmp/kvevents-traces")
    ap.add_argument("--json", default="benchmarks/results/hostile.json")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        shape, trace, truth, after, lookups = a.worker
        print(json.dumps(worker(shape, trace, truth, int(after), int(lookups))))
        return
    print(f"kvevents from {kvevents.__file__}", file=sys.stderr)
    paths = generate(TraceConfig(a.engines, a.capacity), a.workdir)
    results = []
    for shape in a.shapes.split(","):
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", shape, paths["trace"],
                                paths["truth"], str(a.after), str(a.lookups)],
                               capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            results.append({"shape": shape, "error": [f"did not finish within {a.timeout:.0f} s"]})
            continue
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            results.append({"shape": shape, "error": p.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"  {results[-1]}", file=sys.stderr)
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"{r['shape']}: the worker died: {r['error']}")
    print(f"\nhostile shapes after a {a.engines} engines x {a.capacity:,} blocks trace (ours only)")
    print_table(["shape", "events", "RSS growth MB", f"+{a.after:,} ordinary MB", "p50 before us", "p50 after us",
                 "ratio", "raised", "probe", "counters changed"],
                [[r["shape"], r["hostile_events"], r["rss_growth_hostile_mb"], r["rss_growth_after_ordinary_mb"],
                  r["lookup_p50_before_us"], r["lookup_p50_after_us"], r["lookup_p50_ratio"],
                  r["apply_batch_raised"], r["new_namespace_probe"] or "-",
                  json.dumps({k: v for k, v in r["counters_changed"].items()
                              if not k.startswith("applied.")})] for r in ok])
    write_json(a.json, {"benchmark": "P8 hostile shapes", "machine": machine(), "kvevents": kvevents.__file__,
                        "args": vars(a), "results": results})


if __name__ == "__main__":
    main()
