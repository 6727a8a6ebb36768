"""Runs one real vLLM engine (``vllm.LLM`` in process) through the offloading scenario.

Started by the real-engine tests (and usable by hand) as::

    python tests/vllm_engine/driver.py --model DIR [--connector] [--events tcp://127.0.0.1:P]
        [--replay tcp://127.0.0.1:R] --out result.json

Scenario (greedy, token-id prompts, 16 GPU blocks of 32 tokens, so the engine's own
prefix cache evicts): prompt A (100 tokens: a 96-token, 3-block prefix), filler prompts that push A out of the GPU
cache, prompt A again (its prefix now comes from the CPU tier when the connector is on),
then - connector only - a negative control: the CPU pool is zeroed, A is evicted again
and sent a third time, which must change its completion; last, new prompts that
overflow the CPU tier (its evictions and their removal events). After the last request the
engine is stepped until idle (in-flight copies completed, events published), and the
true cache contents are written: the GPU prefix cache's block hashes and the
connector's CPU-tier block hashes, as the engine publishes them (int hashes).

The engine and its truth readers are :class:`kvevents.demo.vllm_engine.VllmEngine`, the
same host the demo's ``--engine vllm`` uses. Its core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the truth can be read from it; the result is written as JSON, then the process waits (at
most ``--linger`` seconds, or until stdin closes) so the tests can still ask its replay
endpoint for every batch it published.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 100  # 3 full blocks (96 tokens) + 4: the prefix the tiers can serve
MAX_TOKENS = 16
NUM_FILLERS = 6
NUM_LATE = 4  # new prompts at the end: they overflow the CPU tier (evictions, removals)


def prompts(seed: int = 7) -> dict[str, list[int]]:
    rng = random.Random(seed)
    out = {"A": [rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS)]}
    for i in range(NUM_FILLERS):
        out[f"F{i}"] = [rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS)]
    for i in range(NUM_LATE):
        out[f"G{i}"] = [rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", action="store_true")
    ap.add_argument("--events", default=None, help="PUB endpoint (explicit 127.0.0.1: vLLM connects)")
    ap.add_argument("--replay", default=None, help="replay ROUTER endpoint (vLLM binds)")
    # 24 blocks of 32 KiB: A and the fillers (21 blocks) fit; the late prompts evict.
    ap.add_argument("--cpu-bytes", type=int, default=24 * 32768)
    ap.add_argument("--out", required=True)
    ap.add_argument("--linger", type=float, default=0.0)
    args = ap.parse_args()
    # The engine (and its truth readers) is the demo's: one implementation.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from kvevents.demo.vllm_engine import VllmEngine

    engine = VllmEngine(args.model, cpu_bytes=args.cpu_bytes if args.connector else 0,
                        events=args.events, replay=args.replay, gpu_blocks=16, max_model_len=256)
    startup_s = engine.startup_s
    sched, conn = engine.sched, engine.conn
    ps = prompts()

    def run(name: str) -> dict:
        return engine.generate(ps[name], MAX_TOKENS)

    def settle() -> None:
        engine.settle()

    gpu_hashes = engine.gpu_hashes
    llm = engine.llm
    params = engine.params(MAX_TOKENS)
    from vllm.inputs import TokensPrompt

    result: dict = {"startup_s": startup_s, "connector": args.connector, "runs": {}}
    t1 = time.monotonic()
    result["runs"]["A"] = run("A")
    settle()
    # A's engine hashes as published: the GPU cache holds exactly A's full blocks now
    # (plus nothing else: it is the first request).
    a_hashes = sorted(gpu_hashes())
    result["a_hashes"] = a_hashes
    for i in range(NUM_FILLERS):
        result["runs"][f"F{i}"] = run(f"F{i}")
        settle()
    result["a_on_gpu_before_rerun"] = bool(set(a_hashes) & gpu_hashes())
    if conn is not None:
        result["a_on_cpu_before_rerun"] = sorted(set(a_hashes) & conn.cpu_block_hashes())
    result["runs"]["A2"] = run("A")
    settle()
    if conn is not None:
        result["stats_before_control"] = dict(vars(conn.scheduler.stats))
        # Negative control: zero every CPU-pool byte, push A out of the GPU cache again,
        # and send it a third time: it is loaded from the (zeroed) CPU tier.
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        wconn = get_kv_transfer_group()
        for t in wconn.worker.cpu_pool.values():
            t.zero_()
        for i in range(NUM_FILLERS):
            run(f"F{i}")
            settle()
        result["a_on_gpu_before_control"] = bool(set(a_hashes) & gpu_hashes())
        result["runs"]["A_zeroed"] = run("A")
        settle()
        # Abort while A's CPU-tier load is in flight: vLLM must not free the blocks under
        # the copy (the connector delays it) nor die when the load is then reported.
        for i in range(NUM_FILLERS):
            run(f"F{i}")
            settle()
        loads_before = conn.scheduler.stats.load_jobs
        llm.llm_engine.add_request("abort-during-load", TokensPrompt(prompt_token_ids=ps["A"]), params)
        llm.llm_engine.step()  # schedules it: the load is issued and the request waits for it
        loading = [r.request_id for r in sched.requests.values() if r.status.name == "WAITING_FOR_REMOTE_KVS"]
        llm.llm_engine.abort_request(["abort-during-load"])
        settle()
        result["abort_during_load"] = {
            "was_loading": bool(loading), "load_jobs": conn.scheduler.stats.load_jobs - loads_before,
            "requests_left": len(sched.requests),
        }
        for i in range(NUM_LATE):
            result["runs"][f"G{i}"] = run(f"G{i}")
            settle()
        result["stats"] = dict(vars(conn.scheduler.stats))
        result["cpu_hashes"] = sorted(conn.cpu_block_hashes())
    result["scenario_s"] = time.monotonic() - t1
    result["gpu_hashes"] = sorted(gpu_hashes())
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    print("RESULT", args.out, flush=True)
    if args.linger > 0:
        # Keep the publisher (and its replay buffer) alive until the tests close stdin.
        import select

        select.select([sys.stdin], [], [], args.linger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
