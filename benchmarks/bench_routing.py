"""P7: routing quality on the production conversation trace.

Simulated engines (the real paged-KV engine with its offloading connector, in process)
replay a fixed slice of ``shared/traces/conversation_trace.jsonl`` in simulated time:
before each request is routed at its arrival time, every engine is stepped up to that
time and the KV events it published are applied to a real ``PrefixIndex`` (exactly what
the aggregator would hold). Then the policy picks the engine: ``kv`` (the KV-aware
policy with the engines' load), ``round_robin`` or ``least_loaded``; with and without
the CPU tier. Reported per run: prefix-hit tokens per tier, prefill tokens computed,
simulated TTFT p50/p99, requests per engine and max/min balance.

    .venv/bin/python benchmarks/bench_routing.py [--requests 1500] [--engines 4]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from common import machine, print_table, write_json
from connector import OffloadConfig
from kvevents.sim import EngineConfig, PagedEngine
from kvevents.demo.workload import mooncake_trace
from kvevents.index import PrefixIndex
from kvevents.wire.publisher import EventPublisher
from kvevents.routing.policies import POLICIES, Candidate, EngineLoad
from kvevents.wire.schema import KVEventBatch

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


class IndexFeed(EventPublisher):
    """Applies each published batch to the index at once (in-process aggregator)."""

    def __init__(self, index: PrefixIndex, engine: str) -> None:
        self.index, self.engine = index, engine

    def publish(self, batch: KVEventBatch) -> bool:
        self.index.apply_batch(self.engine, batch)
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        return None


def simulate(requests, policy: str, n_engines: int, cpu_tier: bool, gpu_blocks: int,
             cpu_blocks: int, chunk: int) -> dict:
    index = PrefixIndex()
    engines = []
    for i in range(n_engines):
        offload = OffloadConfig(cpu_capacity_blocks=cpu_blocks, offloaded_block_size=chunk) if cpu_tier else None
        engines.append(PagedEngine(EngineConfig(num_gpu_blocks=gpu_blocks, verify_loads=True),
                                   offload=offload, publisher=IndexFeed(index, f"engine-{i}")))
    names = [f"engine-{i}" for i in range(n_engines)]
    chooser = POLICIES[policy]()
    results, assigned = [], {n: 0 for n in names}
    t0 = time.perf_counter()
    for req in requests:
        for eng in engines:  # engines run up to the arrival; their events reach the index
            while eng.has_work() and eng.clock < req.arrival:
                results.extend(eng.step())
        candidates = [Candidate(n, EngineLoad(**e.load())) for n, e in zip(names, engines)]
        lookup = index.lookup(req.token_ids) if policy == "kv" else None
        engine = chooser.choose(req.token_ids, lookup, candidates).engine
        assigned[engine] += 1
        engines[names.index(engine)].add_request(req.id, req.token_ids, req.max_new_tokens, req.arrival)
    for eng in engines:
        results.extend(eng.run_until_idle())
    wall = time.perf_counter() - t0
    mismatches = sum(e.kv_mismatches for e in engines)
    for e in engines:
        e.shutdown()
    ttft = np.array([r.ttft for r in results])
    counts = list(assigned.values())
    return {
        "policy": policy, "cpu_tier": cpu_tier, "requests": len(results),
        "prompt_tokens": int(sum(r.num_prompt_tokens for r in results)),
        "hit_gpu": int(sum(r.num_gpu_cached_tokens for r in results)),
        "hit_cpu": int(sum(r.num_cpu_loaded_tokens for r in results)),
        "computed": int(sum(r.num_computed_prompt_tokens for r in results)),
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
        "per_engine": assigned, "balance_max_over_min": max(counts) / max(min(counts), 1),
        "kv_mismatches": mismatches, "wall_seconds": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=1500, help="first N requests of the trace")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--gpu-blocks", type=int, default=8192, help="16-token blocks per engine")
    ap.add_argument("--cpu-blocks", type=int, default=8192, help="offloaded blocks per engine")
    ap.add_argument("--offloaded-block-size", type=int, default=64)
    ap.add_argument("--policies", default="kv,round_robin,least_loaded")
    ap.add_argument("--cpu-tiers", default="off,on", help="run without and/or with the CPU tier")
    ap.add_argument("--json", default="benchmarks/results/routing.json")
    args = ap.parse_args()
    requests = mooncake_trace(args.trace, args.requests)
    runs = []
    for cpu_tier in [t == "on" for t in args.cpu_tiers.split(",")]:
        for policy in args.policies.split(","):
            r = simulate(requests, policy, args.engines, cpu_tier, args.gpu_blocks, args.cpu_blocks,
                         args.offloaded_block_size)
            runs.append(r)
            print(f"  {policy:13s} cpu_tier={cpu_tier!s:5s} hit GPU {r['hit_gpu']:,} CPU {r['hit_cpu']:,} "
                  f"({r['wall_seconds']} s)", flush=True)
    rows = []
    for r in runs:
        n = max(r["prompt_tokens"], 1)
        rows.append([r["policy"], "on" if r["cpu_tier"] else "off", r["requests"],
                     f"{r['hit_gpu']:,}", f"{r['hit_cpu']:,}", f"{(r['hit_gpu'] + r['hit_cpu']) / n:.1%}",
                     f"{r['computed']:,}", f"{r['ttft_p50']:.3f}", f"{r['ttft_p99']:.3f}",
                     "/".join(map(str, r["per_engine"].values())), f"{r['balance_max_over_min']:.2f}",
                     r["kv_mismatches"]])
    print_table(["policy", "CPU tier", "requests", "hit GPU", "hit CPU", "hit %", "prefill computed",
                 "TTFT p50 s", "TTFT p99 s", "requests/engine", "max/min", "kv mismatches"], rows)
    by = {(r["policy"], r["cpu_tier"]): r for r in runs}
    headline = {}
    for cpu in (False, True):
        kv, rr = by.get(("kv", cpu)), by.get(("round_robin", cpu))
        if kv and rr:
            ratio = (kv["hit_gpu"] + kv["hit_cpu"]) / max(rr["hit_gpu"] + rr["hit_cpu"], 1)
            headline[f"kv_over_round_robin_hit_tokens_cpu_{'on' if cpu else 'off'}"] = round(ratio, 2)
            print(f"KV-aware / round-robin hit tokens (CPU tier {'on' if cpu else 'off'}): {ratio:.2f}x")
    if ("kv", True) in by and ("kv", False) in by:
        on, off = by[("kv", True)], by[("kv", False)]
        gain = (on["hit_gpu"] + on["hit_cpu"]) - (off["hit_gpu"] + off["hit_cpu"])
        headline["cpu_tier_extra_hit_tokens_kv"] = gain
        print(f"CPU tier adds {gain:,} hit tokens under KV-aware routing")
    write_json(args.json, {"benchmark": "P7 routing quality", "machine": machine(), "args": vars(args),
                           "headline": headline, "runs": runs})


if __name__ == "__main__":
    main()
