"""``kvevents demo``: a live KV-aware fleet on one machine.

Starts N engine processes (paged-KV engine + offloading connector with a CPU tier,
publishing KV events like vLLM) and the aggregator with its live page on ``--port``,
then sends a workload through them:

* ``--policy gateway`` (the default): the engines serve OpenAI requests on an HTTP
  port each and the aggregator is their gateway; the demo sends every request as an
  OpenAI client would (``POST /v1/completions``, streamed) to the aggregator, which
  routes it by its index and the engines' load (:mod:`kvevents.demo.openai_client`);
* ``--policy kv|round_robin|least_loaded``: the demo routes each request itself
  (``kv`` through the aggregator's ``/v1/route``) and submits it over the engines' RPC
  (:mod:`kvevents.demo.driver`). ``--engine vllm`` (in-process vLLM engines, RPC only)
  runs this way: it gets the gateway with a ``vllm serve`` fleet, which is separate work.

At the end it drains the engines, checks that nothing was lost and that the
aggregator's index equals every engine's cache, prints a summary and writes it as
JSON. Exit status 1 if anything was lost or mismatched or a request failed, 130 on
Ctrl-C (every child process is stopped either way).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from kvevents.demo.args import add_arguments  # noqa: F401  (the CLI's entry, re-exported)
from kvevents.demo.workload import builtin, compact, mooncake_trace

if TYPE_CHECKING:
    from kvevents.demo.fleet import Fleet

# httpx, the driver and the fleet are imported in run_demo: they need the `demo` extra,
# and `kvevents --help` must work without it.


def write_targets(path: str, fleet: Fleet) -> None:
    """Prometheus ``file_sd_configs`` targets: the aggregator and every engine."""
    groups = [{"targets": [f"127.0.0.1:{fleet.port}"], "labels": {"job": "kvevents-aggregator"}},
              {"targets": [f"127.0.0.1:{e.ports.metrics}" for e in fleet.engines if e.ports.metrics],
               "labels": {"job": "kvevents-engines"}}]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, path)  # Prometheus never sees a half-written file


def print_summary(s: dict) -> None:
    gateway = s["policy"] == "gateway"
    hit = s["hit_tokens"]
    hit_total = hit.get("total", (hit.get("GPU") or 0) + (hit.get("CPU") or 0))
    hit_rate = f"({hit_total / max(s['prompt_tokens'], 1):.1%})"
    if "total" in hit:
        hits = ("hit tokens (engine-reported, no GPU/CPU split)", f"{hit_total:,} {hit_rate}")
    elif gateway:
        hits = ("hit tokens GPU / CPU (engine /metrics)", f"{hit['GPU']:,} / {hit['CPU']:,} {hit_rate}")
    else:
        hits = ("hit tokens GPU / CPU", f"{hit['GPU']:,} / {hit['CPU']:,} {hit_rate}")
    if gateway:
        ttft = "TTFT p50 / p99 (wall, client via gateway)"
    else:
        ttft = "TTFT p50 / p99 " + ("(wall)" if s.get("engine") == "vllm" else "(simulated)")
    rows = [
        ("engines / policy / CPU tier", f"{s['engines']} / {s['policy']} / {'on' if s['cpu_tier'] else 'off'}"),
        ("requests (per engine)", f"{s['requests']} ({', '.join(map(str, s['requests_per_engine'].values()))})"),
    ]
    if gateway:
        failures = ", ".join(f"{n} {why}" for why, n in s["failures"].items())
        rows.append(("failed requests", f"{s['failed_requests']}" + (f" ({failures})" if failures else "")))
    rows += [
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        hits,
        ("prefill tokens computed", f"{s['computed_prefill_tokens']:,}"),
        (ttft, f"{s['ttft_seconds']['p50']:.3f} s / {s['ttft_seconds']['p99']:.3f} s"),
    ]
    if gateway:
        g = s["gateway"]
        ratio = g["predicted_over_reported"]
        rows += [
            ("e2e p50 / p99 (wall, client via gateway)", f"{s['e2e_seconds']['p50']:.3f} s / {s['e2e_seconds']['p99']:.3f} s"),
            ("gateway predicted / reported cached", f"{g['predicted_cached_tokens']:,} / {g['reported_cached_tokens']:,}"
                                                    + (f" ({ratio:.2f}x)" if ratio is not None else " (no reports)")),
        ]
    rows += [
        ("offload stored / loaded", f"{s['offload']['stored_bytes'] / 1e6:,.1f} MB @ {s['offload']['store_gbps']:.2f} GB/s"
                                    f" / {s['offload']['loaded_bytes'] / 1e6:,.1f} MB @ {s['offload']['load_gbps']:.2f} GB/s"),
        ("KV blocks verified / mismatched", "n/a (vLLM keeps no byte check)" if s.get("engine") == "vllm"
                                            else f"{s['verified_blocks']:,} / {s['kv_mismatches']}"),
        ("events published / applied", f"{s['events']['published']:,} / {s['events']['applied']:,}"),
        ("gaps / replayed / lost", f"{s['events']['gaps']} / {s['events']['replayed']} / {s['events']['lost']}"),
        ("index vs engines mismatches", f"{s['index_mismatches']}"),
        ("wall time", f"{s['wall_seconds']} s"),
    ]
    w = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k.ljust(w)}  {v}")
    print()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too: unwind through `finally`, which stops every child


def run_demo(args: argparse.Namespace) -> int:
    import httpx

    from kvevents.demo.driver import Driver
    from kvevents.demo.fleet import Fleet
    from kvevents.demo.openai_client import MODEL, GatewayDriver, gateway_ready

    from kvevents.demo.args import resolve_defaults

    resolve_defaults(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    signal.signal(signal.SIGTERM, _interrupt)
    if args.trace:
        requests = mooncake_trace(args.trace, args.max_requests)
    elif args.engine == "vllm":
        requests = compact(args.requests, seed=args.seed)
    else:
        requests = builtin(args.requests, seed=args.seed)
    if not requests:
        print("no requests to run", file=sys.stderr)
        return 2
    wall = args.duration
    if args.trace and args.time_scale:
        wall = requests[-1].arrival / args.time_scale
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvevents-demo-")
    gpu_blocks = args.gpu_blocks or (8192 if args.trace else 1024)
    vllm_model = None
    if args.engine == "vllm":
        from kvevents.demo.tiny_model import make_tiny_model

        print("making a tiny random Llama model (no model hub) ...", flush=True)
        vllm_model = str(make_tiny_model(os.path.join(log_dir, "tiny-llama")))
    gateway = args.policy == "gateway"  # check_arguments: simulated engines only
    fleet = Fleet(args.engines, args.port, not args.no_cpu_tier, gpu_blocks=gpu_blocks,
                  cpu_blocks=args.cpu_blocks, offloaded_block_size=args.offloaded_block_size,
                  log_dir=log_dir, vllm_model=vllm_model, openai_model=MODEL if gateway else None)
    driver = None
    try:
        print(f"starting {args.engines} engines and the aggregator (logs in {log_dir}) ...", flush=True)
        # A real vLLM engine starts in 10-70 s alone, more with several on 2 cores.
        fleet.wait_engines_ready(600 if vllm_model else 120)
        url = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + 60
        while True:
            fleet.check_alive()
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the aggregator did not start")
            time.sleep(0.2)
        if gateway:  # its first requests must find every engine followed and reachable
            deadline = time.monotonic() + 60
            while not gateway_ready(url, args.engines):
                fleet.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not see every engine (see /v1/engines)")
                time.sleep(0.2)
        print(f"live page: {url}/   (API docs: {url}/docs, metrics: {url}/metrics)", flush=True)
        if args.prometheus_targets:
            write_targets(args.prometheus_targets, fleet)
        if gateway:
            print(f"sending {len(requests)} OpenAI requests through the gateway {url}/v1/completions "
                  f"over ~{wall:.0f} s ({args.clients} clients at most)", flush=True)
            driver = GatewayDriver(fleet, requests, wall, progress=not args.no_progress,
                                   clients=args.clients)
        else:
            print(f"routing {len(requests)} requests with policy {args.policy!r} over ~{wall:.0f} s", flush=True)
            driver = Driver(fleet, requests, args.policy, wall, progress=not args.no_progress)
        elapsed = driver.run()
        print("waiting for the event stream to quiesce ...", flush=True)
        drained = driver.quiesce()
        mismatches = driver.index_mismatches()
        summary = driver.summary(drained, mismatches, elapsed, not args.no_cpu_tier)
        summary["workload"] = args.trace or ("compact" if vllm_model else "builtin")
        summary["engine"] = args.engine
        print_summary(summary)
        if args.summary_json:
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
            print(f"summary written to {args.summary_json}")
        if summary["rejected_requests"]:
            print(f"note: {summary['rejected_requests']} requests were longer than an engine's "
                  "KV cache and were rejected (raise --gpu-blocks)")
        ok = (summary["events"]["lost"] == 0 and summary["index_mismatches"] == 0
              and summary["kv_mismatches"] == 0 and summary["events"]["dropped_at_publish"] == 0
              and summary["failed_requests"] == 0)
        served = (f"{summary['requests']} requests served through the gateway, " if gateway else "")
        print(f"OK: {served}nothing lost, the index equals every engine's cache" if ok
              else "FAILED: something was lost or mismatched, or a request failed (see above)")
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process", file=sys.stderr)
        return 130
    finally:
        if driver is not None:
            driver.close()
        fleet.close()
