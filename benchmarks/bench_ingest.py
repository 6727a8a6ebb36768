"""P1: ingest throughput over ZeroMQ, 8 publisher processes -> one aggregator process.

Older, flattering shapes (large events, per-engine salted hashes), kept as extra rows; the
figures that count are the side-by-side ones on the realistic trace (bench_dynamo.py).

The workload (benchmarks/workload.py: shared system prompts and documents, per-engine
engine hashes, 16-token blocks, LRU-like evictions once each engine's cache is full) is
recorded to a file first. Each publisher process then replays its engine's recorded
batches, as fast as it can, on its own PUB socket (seq from 0, vLLM framing). The
aggregator (the real ``Aggregator``: subscriber thread, decoder, prefix index) follows
all 8. Measured: block events applied per second from "go" until the last one is
applied, and that nothing was lost (every seq of every engine delivered, lost == 0).

    .venv/bin/python benchmarks/bench_ingest.py [--capacity 40000] [--runs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import zmq

from common import machine, median, print_table, write_json
from kvevents.service.aggregator import Aggregator
from kvevents.demo.fleet import free_port
from kvevents.wire.schema import BatchDecoder
from kvevents.service.settings import AggregatorSettings, EngineSpec
from kvevents.wire.framing import pack_seq
from workload import Workload, read, write


def _publisher(path: str, engine: str, port: int, ready, go) -> None:
    payloads = [p for name, p in read(path) if name == engine]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # unbounded: this benchmark measures the consumer
    pub.bind(f"tcp://127.0.0.1:{port}")
    ready.put(len(payloads))
    go.wait()
    for seq, payload in enumerate(payloads):
        pub.send_multipart((b"", pack_seq(seq), payload), copy=False)
    time.sleep(60)  # keep the socket open until the parent terminates us
    pub.close(0)


def count_blocks(path: str) -> dict[str, int]:
    """Block entries (stored + removed) per engine in the recorded workload."""
    dec = BatchDecoder()
    out: dict[str, int] = {}
    for engine, payload in read(path):
        b = dec.decode(payload).batch
        out[engine] = out.get(engine, 0) + sum(len(e.block_hashes) for e in b.events)
    return out


def run_once(path: str, engines: list[str], expected_blocks: int) -> dict:
    ports = {engine: free_port() for engine in engines}
    ready: mp.Queue = mp.Queue()
    go = mp.Event()
    procs = [mp.Process(target=_publisher, args=(path, engine, ports[engine], ready, go), daemon=True)
             for engine in engines]
    for p in procs:
        p.start()
    counts = [ready.get(timeout=120) for _ in engines]
    agg = Aggregator(AggregatorSettings(engines=tuple(
        EngineSpec(engine, f"tcp://127.0.0.1:{ports[engine]}") for engine in engines)))
    agg.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
            s.connected for s in agg.source_stats().values()) or len(agg.source_stats()) < len(engines):
        time.sleep(0.05)
    time.sleep(0.5)  # subscriptions propagate to the publishers
    t0 = time.perf_counter()
    go.set()

    def applied() -> int:
        return sum(r.blocks for r in agg.index.counters().applied)

    while applied() < expected_blocks and time.perf_counter() - t0 < 300:
        time.sleep(0.005)
    elapsed = time.perf_counter() - t0
    got = applied()
    stats = agg.source_stats()
    agg.stop()
    for p in procs:
        p.terminate()
        p.join(5)
    total_batches = sum(counts)
    delivered = sum(s.batches for s in stats.values())
    lost = sum(s.lost_batches for s in stats.values())
    return {
        "publishers": len(engines),
        "batches": total_batches,
        "block_events": got,
        "expected_block_events": expected_blocks,
        "seconds": round(elapsed, 3),
        "block_events_per_s": round(got / elapsed),
        "batches_per_s": round(delivered / elapsed),
        "delivered_batches": delivered,
        "lost_batches": lost,
        "zero_loss": lost == 0 and delivered == total_batches and got == expected_blocks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--publishers", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=40_000, help="resident blocks per engine")
    ap.add_argument("--events-per-batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/ingest.json")
    args = ap.parse_args()
    w = Workload(engines=args.publishers, capacity=args.capacity, events_per_batch=args.events_per_batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "workload.bin")
        write(w, path)
        per_engine = count_blocks(path)
        engines = sorted(per_engine)
        expected = sum(per_engine.values())
        runs = [run_once(path, engines, expected) for _ in range(args.runs)]
    rate = median([r["block_events_per_s"] for r in runs])
    print_table(["run", "publishers", "batches", "block events", "seconds", "block events/s", "lost", "zero loss"],
                [[i, r["publishers"], r["batches"], r["block_events"], r["seconds"], r["block_events_per_s"],
                  r["lost_batches"], r["zero_loss"]] for i, r in enumerate(runs)])
    print(f"median: {rate:,.0f} block events/s (target >= 500,000)")
    write_json(args.json, {"benchmark": "P1 ingest", "machine": machine(), "args": vars(args),
                           "median_block_events_per_s": rate, "runs": runs})


if __name__ == "__main__":
    main()
