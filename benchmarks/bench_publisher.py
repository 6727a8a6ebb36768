"""P5: ``publish()`` call latency and sustained throughput of the ZeroMQ publisher.

Scenarios, each against a real publisher on 127.0.0.1:
  fast    a subscriber process that reads as fast as it can
  slow    a subscriber process that sleeps 1 ms per message (falls behind; HWM fills)
  absent  nobody subscribed
For each: median and p99 of the ``publish()`` call (the engine-side cost), calls/s, the
batches the subscriber received, and the drops the publisher counted. Each batch is a
realistic engine step: one BlockStored of 4 blocks x 16 tokens and one BlockRemoved.

    .venv/bin/python benchmarks/bench_publisher.py [--batches 200000] [--runs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time

import zmq

from common import machine, median, percentile, print_table, write_json
from kvevents.demo.fleet import free_port
from kvevents.wire.publisher import PublisherConfig, ZmqEventPublisher
from kvevents.wire.schema import BlockRemoved, BlockStored, KVEventBatch


def _subscriber(endpoint: str, delay: float, ready, result, duration: float) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    ready.set()
    got = 0
    first = last = None
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if not sub.poll(100):
            if got and time.monotonic() - last > 1.0:
                break
            continue
        sub.recv_multipart()
        now = time.monotonic()
        first = first or now
        last = now
        got += 1
        if delay:
            time.sleep(delay)
    result.put((got, (last - first) if got > 1 else 0.0))
    sub.close(0)
    ctx.term()


def _batches(n: int, seed: int = 0) -> list[KVEventBatch]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hashes = [rng.getrandbits(64) for _ in range(4)]
        out.append(KVEventBatch(float(i), [
            BlockStored(hashes, rng.getrandbits(64), [rng.randrange(32000) for _ in range(64)], 16,
                        None, "GPU", None),
            BlockRemoved([rng.getrandbits(64)], "GPU"),
        ]))
    return out


def run_scenario(kind: str, batches: list[KVEventBatch]) -> dict:
    port = free_port()
    # Bound on loopback only (vLLM's rule binds only for "*": say so explicitly).
    pub = ZmqEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}",
                                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", bind=True))
    proc = None
    result: mp.Queue = mp.Queue()
    if kind != "absent":
        ready = mp.Event()
        proc = mp.Process(target=_subscriber, args=(
            f"tcp://127.0.0.1:{port}", 0.001 if kind == "slow" else 0.0, ready, result, 60.0))
        proc.start()
        ready.wait()
        time.sleep(0.5)  # subscription in place
    lat = []
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    for b in batches:
        s = clock()
        pub.publish(b)
        lat.append(clock() - s)
    call_time = time.perf_counter() - t0
    pub.shutdown(timeout=5.0)
    stats = pub.stats()
    got, span = (0, 0.0)
    if proc is not None:
        if kind == "slow":
            proc.terminate()
        got, span = result.get(timeout=70) if kind == "fast" else (None, 0.0)
        proc.join(5)
    lat_us = [x / 1000 for x in lat]
    return {
        "scenario": kind,
        "calls": len(batches),
        "publish_median_us": round(median(lat_us), 2),
        "publish_p99_us": round(percentile(lat_us, 99), 2),
        "publish_max_us": round(max(lat_us), 1),
        "calls_per_s": round(len(batches) / call_time),
        "received": got,
        "received_per_s": round(got / span) if got and span else None,
        "dropped_at_publish": stats.dropped,
        "sent": stats.sent,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/publisher.json")
    args = ap.parse_args()
    batches = _batches(args.batches)
    rows, results = [], []
    for kind in ("fast", "slow", "absent"):
        runs = [run_scenario(kind, batches) for _ in range(args.runs)]
        med = {k: (median([r[k] for r in runs]) if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None
                   and all(r[k] is not None for r in runs) else runs[0][k]) for k in runs[0]}
        results.append({"median_of_runs": med, "runs": runs})
        rows.append([kind, med["calls"], med["publish_median_us"], med["publish_p99_us"], med["publish_max_us"],
                     med["calls_per_s"], med["received"], med["received_per_s"], med["dropped_at_publish"]])
    print_table(["subscriber", "calls", "median_us", "p99_us", "max_us", "calls/s", "received",
                 "received/s", "dropped"], rows)
    write_json(args.json, {"benchmark": "P5 publisher", "machine": machine(), "args": vars(args),
                           "results": results})


if __name__ == "__main__":
    main()
