"""The ingest thread's own work, in process: a realistic trace through the compiled lane.

What it times: every message of the trace (benchmarks/kvtrace.py) received by
``Cursor.lane_drain`` (kvevents/ingest/_lane.pxi: frames, seq, continuity digest) and
applied by the engine's ``WireSink`` (kvevents/index/_sink.pxi: read, lock, apply), the
code the ingest thread runs for each live batch, with nothing else on the machine's
cores: the messages wait on ``inproc://`` sockets (no ZeroMQ I/O thread, no TCP), sent
before the clock starts; engines are drained round robin, 8 messages at a time. Each
engine's first batch goes through the Python path first, as in the server (it teaches
the sink the engine's tier and block size).

Why: the end-to-end run (bench_dynamo_e2e.py) ends with this thread applying the backlog
alone, so its CPU per message is what the wall time follows, but 8 publisher processes
on the same 2 cores make that run too noisy to see a few percent; this isolates it.
Compare builds by running it from each checkout (``PYTHONPATH=<checkout>``), alternating.

    .venv/bin/python benchmarks/bench_lane_replay.py [--engines 16 --capacity 20000] [--reps 5]
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time

import zmq

import kvevents
from common import machine, median, write_json
from kvevents.index import PrefixIndex
from kvevents.index.wire import IngestDecoder
from kvevents.ingest import _zmqrecv
from kvevents.wire.framing import pack_seq
from kvtrace import MODEL, TraceConfig, add_trace_args, generate, read


def replay_once(ctx: zmq.Context, per_engine: dict[str, list[bytes]], tag: str) -> float:
    """Seconds the lane took to apply every engine's batches after its first."""
    index, decoder = PrefixIndex(), IngestDecoder()
    pubs, subs, sinks, cursors = {}, {}, {}, {}
    try:
        for i, (engine, payloads) in enumerate(sorted(per_engine.items())):
            pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            pub.bind(f"inproc://lane-{tag}-{i}")
            sub.connect(f"inproc://lane-{tag}-{i}")
            pubs[engine], subs[engine] = pub, sub
            index.apply_batch(engine, decoder.decode(payloads[0]).batch, model=MODEL)
            sinks[engine] = index.sink(engine, MODEL)
            sinks[engine].refresh()
            cursors[engine] = _zmqrecv.Cursor()
            cursors[engine].expected = 1
        for engine, payloads in per_engine.items():
            for seq, payload in enumerate(payloads[1:], 1):
                pubs[engine].send_multipart((b"", pack_seq(seq), payload), copy=False)
        left = {engine: len(payloads) - 1 for engine, payloads in per_engine.items()}
        handed_over: list[list[bytes]] = []
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        while any(left.values()):
            for engine, n in left.items():
                if n:
                    left[engine] -= cursors[engine].lane_drain(
                        subs[engine].underlying, sinks[engine].capsule, 8, 1 << 20, handed_over)
        elapsed = time.perf_counter() - t0
        gc.enable()
        if handed_over:  # the lane must take every batch of this trace
            raise RuntimeError(f"{len(handed_over)} messages left to the Python path")
        return elapsed
    finally:
        for sock in (*pubs.values(), *subs.values()):
            sock.close(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(ap)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    _zmqrecv.load()
    paths = generate(TraceConfig.from_args(a), a.workdir)
    per_engine: dict[str, list[bytes]] = collections.defaultdict(list)
    for engine, payload in read(paths["trace"]):
        per_engine[engine].append(payload)
    messages = sum(map(len, per_engine.values())) - len(per_engine)
    ctx = zmq.Context()
    times = [replay_once(ctx, per_engine, str(r)) for r in range(a.reps)]
    ctx.term()
    ms = [round(t * 1e3, 1) for t in times]
    mid = round(median(ms), 1)
    print(f"kvevents from {kvevents.__file__}: {messages:,} messages of {a.engines} engines x "
          f"{a.capacity:,}; ms per replay {ms}; min {min(ms)}, median {mid}")
    write_json(a.json or f"benchmarks/results/lane-replay-p{a.engines}-c{a.capacity}.json",
               {"benchmark": "in-process lane replay", "machine": machine(),
                "kvevents": kvevents.__file__, "args": vars(a), "messages": messages,
                "ms": ms, "min_ms": min(ms), "median_ms": mid})


if __name__ == "__main__":
    sys.exit(main())
