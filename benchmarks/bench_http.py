"""P3: ``POST /v1/lookup`` latency over HTTP while ingest runs, one keep-alive client.

A real ``kvevents serve`` process (uvicorn) follows every engine of the realistic trace
(benchmarks/kvtrace.py). One publisher process replays the trace on one PUB socket per
engine, paced at ``--rate`` block events/s (vLLM framing; when the trace ends it sends
``AllBlocksCleared`` to every engine and starts over, seq continuing), so ingest runs for
the whole measurement; its PUB sockets keep vLLM's default high-water mark (100,000), so
a server that falls far behind loses batches (shown) rather than this process buffering
without bound. After ``--warmup`` seconds, one client sends 2,048-token prompts
drawn from the trace on a keep-alive connection and times each request end to end
(serialisation, HTTP, validation, index lookup, response). Reported with the latency:
the rate the publisher achieved and the rate the server applied during the window
(``kvevents_block_events_applied_total`` from ``/metrics``), so a server that falls
behind shows it. ``--rate 0``: no ingest during the lookups (the trace is applied
first), the old P3 shape.

    .venv/bin/python benchmarks/bench_http.py [--engines 16 --capacity 20000 --rate 200000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
import zmq  # noqa: E402

import kvevents  # noqa: E402
from common import machine, median, percentile, print_table, write_json  # noqa: E402
from kvevents.schema import AllBlocksCleared, BatchDecoder, BatchEncoder, KVEventBatch  # noqa: E402
from kvevents.transport import pack_seq  # noqa: E402
from kvtrace import TraceConfig, generate, load_truth, read  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(trace: str, rate: float, loop: bool, ready, go, stop, sent) -> None:
    """Replay the trace paced at ``rate`` block events/s (0: unpaced, once)."""
    dec = BatchDecoder()
    records = []
    for engine, payload in read(trace):
        records.append((engine, payload, sum(len(e.block_hashes) for e in dec.decode(payload).batch.events)))
    engines = sorted({p for p, _, _ in records})
    ctx = zmq.Context()
    socks, ports = {}, {}
    for engine in engines:
        s = ctx.socket(zmq.PUB)
        # vLLM's default high-water mark: a server that falls far behind loses batches
        # (counted, shown) instead of this process buffering without bound.
        s.setsockopt(zmq.SNDHWM, 100_000)
        ports[engine] = s.bind_to_random_port("tcp://127.0.0.1")
        socks[engine] = s
    clear = BatchEncoder().encode(KVEventBatch(0.0, [AllBlocksCleared()], data_parallel_rank=0))
    ready.put(ports)
    go.wait(300)
    seq = dict.fromkeys(engines, 0)
    t0 = time.perf_counter()
    total = 0
    while not stop.is_set():
        for engine, payload, blocks in records:
            if stop.is_set():
                break
            if rate:
                delay = t0 + total / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            socks[engine].send_multipart((b"", pack_seq(seq[engine]), payload), copy=False)
            seq[engine] += 1
            total += blocks
            sent.value = total
        if not loop:
            break
        for engine in engines:  # the engines reset their caches; the trace starts over
            socks[engine].send_multipart((b"", pack_seq(seq[engine]), clear))
            seq[engine] += 1
    stop.wait(600)
    for s in socks.values():
        s.close(0)
    ctx.term()


def _poster(kind: str, client: httpx.Client, port: int):
    """``post(body) -> (status, response bytes)`` for ``POST /v1/lookup`` on one
    keep-alive connection. ``stdlib``: ``http.client``, whose own cost per request is a
    fraction of httpx's on this machine (httpx alone adds ~0.6 ms per request here),
    so the figure is the server's; ``httpx``: the earlier client, for comparison."""
    headers = {"content-type": "application/json"}
    if kind == "httpx":
        def post_httpx(body: bytes) -> tuple[int, bytes]:
            r = client.post("/v1/lookup", content=body, headers=headers)
            return r.status_code, r.content
        return post_httpx
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post_stdlib(body: bytes) -> tuple[int, bytes]:
        conn.request("POST", "/v1/lookup", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    return post_stdlib


def _applied(client: httpx.Client) -> int:
    total = 0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvevents_block_events_applied_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=200_000, help="block events/s during lookups (0: none)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of ingest before the lookups")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=2048, choices=[2048, 32768])
    ap.add_argument("--workdir", default="/tmp/kvevents-traces")
    ap.add_argument("--client", choices=["stdlib", "httpx"], default="stdlib",
                    help="the timed client (stdlib: http.client, one keep-alive connection)")
    ap.add_argument("--json", default="benchmarks/results/http.json")
    args = ap.parse_args()
    paths = generate(TraceConfig(args.engines, args.capacity), args.workdir)
    with open(paths["meta"]) as f:
        meta = json.load(f)
    _, prompts = load_truth(paths["truth"])
    ready: mp.Queue = mp.Queue()
    go, stop = mp.Event(), mp.Event()
    sent = mp.Value("q", 0)
    pub = mp.Process(target=_publisher, args=(paths["trace"], args.rate, args.rate > 0, ready, go, stop, sent),
                     daemon=True)
    pub.start()
    ports = ready.get(timeout=300)
    http_port = _port()
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(http_port)]
    for engine, p in sorted(ports.items()):
        cmd += ["--endpoint", f"{engine}=tcp://127.0.0.1:{p}"]
    # ``-m`` puts the working directory first on sys.path: run the server from the
    # checkout this process imported, so it serves the same kvevents.
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvevents.__file__)))
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as client:
            for _ in range(300):
                try:
                    engines_now = client.get("/v1/engines").json()["engines"]
                    if len(engines_now) == len(ports) and all(p["connected"] for p in engines_now):
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            time.sleep(1.0)  # subscriptions reach the publisher
            go.set()
            if args.rate:
                time.sleep(args.warmup)
            else:  # idle shape: the whole trace applied first
                deadline = time.monotonic() + 600
                while _applied(client) < meta["block_events"] and time.monotonic() < deadline:
                    time.sleep(0.2)
            bodies = [json.dumps({"token_ids": p.tolist()}).encode() for p in prompts[args.tokens]]
            headers = {"content-type": "application/json"}
            for b in bodies[:20]:  # warm-up
                client.post("/v1/lookup", content=b, headers=headers)
            post = _poster(args.client, client, http_port)
            for b in bodies[:20]:  # warm-up of the timed client's connection
                post(b)
            applied0, sent0, w0 = _applied(client), sent.value, time.perf_counter()
            lat, matched = [], []
            for i in range(args.requests):
                body = bodies[i % len(bodies)]
                t = time.perf_counter()
                status, text = post(body)
                lat.append((time.perf_counter() - t) * 1e6)
                if status != 200:
                    raise RuntimeError(f"lookup answered {status}: {text[:200]!r}")
                res = json.loads(text)
                matched.append(res["engines"][0]["matched_tokens"] if res["engines"] else 0)
            window = time.perf_counter() - w0
            applied1, sent1 = _applied(client), sent.value
            engines_now = client.get("/v1/engines").json()["engines"]
    finally:
        stop.set()
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        pub.join(10)
        if pub.is_alive():
            pub.terminate()
    row = {"engines": len(ports), "prompt_tokens": args.tokens, "requests": args.requests,
           "target_rate": args.rate, "published_per_s": round((sent1 - sent0) / window),
           "applied_per_s": round((applied1 - applied0) / window),
           "backlog_block_events": max(0, sent1 - applied1) if args.rate else 0,
           "resident_entries": sum(sum(p["blocks"].values()) for p in engines_now),
           "lost_batches": sum(p["lost_batches"] for p in engines_now),
           "p50_us": round(median(lat), 1), "p99_us": round(percentile(lat, 99), 1),
           "max_us": round(max(lat), 1), "mean_best_match_tokens": round(sum(matched) / len(matched), 1)}
    print(f"kvevents from {kvevents.__file__}", file=sys.stderr)
    print_table(list(row), [list(row.values())])
    print(f"p99 {row['p99_us'] / 1000:.2f} ms (target <= 1 ms while ingest runs at 200k block events/s)")
    write_json(args.json, {"benchmark": "P3 lookup over HTTP during ingest", "machine": machine(),
                           "kvevents": kvevents.__file__, "args": vars(args), "result": row})


if __name__ == "__main__":
    main()
