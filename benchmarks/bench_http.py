"""P3: lookup latency over HTTP while ingest runs, one keep-alive client; ``kvevents
serve`` and Dynamo 1.6.1's ``python -m dynamo.indexer`` in the same run, alternating.

Each side is a real server process following every engine of the realistic trace
(benchmarks/kvtrace.py), fed by a fresh publisher process that replays the trace on one
PUB socket per engine, paced at ``--rate`` block events/s (vLLM framing; when the trace
ends it sends ``AllBlocksCleared`` to every engine and starts over, seq continuing), so
ingest runs for the whole measurement; its PUB sockets keep vLLM's default high-water
mark (100,000), so a server that falls far behind loses batches (shown) rather than this
process buffering without bound. After ``--warmup`` seconds, one client sends 2,048-token
prompts drawn from the trace on a keep-alive connection (``POST /v1/lookup`` to ours,
``POST /query`` to Dynamo's) and times each request end to end (serialisation, HTTP,
validation, index lookup, response). Reported with the latency: the rate the publisher
achieved and the rate the server applied during the window (ours: block events from
``kvevents_block_events_applied_total``; Dynamo: events, from
``dynamo_kvrouter_kv_cache_events_applied``), so a server that falls behind shows it.

The machine's own share of the latency is measured too: during each window a separate
process (no GIL, no sockets) sleeps 1 ms at a time and counts how often it wakes more
than 1 ms / 2 ms late, which is what every wake-up of the client and the server
(request arrival, response arrival, GIL hand-over) is exposed to on a busy machine.
For ours, the ingest thread's stretches between GIL releases during the window
(``kvevents_ingest_gil_hold_seconds``, before and after): how many were over 0.5 ms, and
the bucket bound that covers the longest.

The server's CPU time per lookup (user + system of the whole process over the window,
divided by the lookups; with ingest running it includes the ingest) is reported too.

``--rate 0``: no ingest during the lookups (the trace is applied first), the old P3
shape. ``dynamo.indexer`` listens on 0.0.0.0, so with ``--sides`` naming it the whole
benchmark re-executes itself inside ``unshare -n`` (loopback only; root or user
namespaces), as ``bench_dynamo_e2e.py`` does; it needs the bench venv.

    .venv/bin/python benchmarks/bench_http.py [--engines 16 --capacity 20000 --rate 200000]
    .venv-bench/bin/python benchmarks/bench_http.py --sides ours,dynamo --runs 3
    .venv-bench/bin/python benchmarks/bench_http.py --sides ours,ours_asgi,dynamo --rate 0 --runs 4
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
import zmq  # noqa: E402

import kvevents  # noqa: E402
from common import (cpu_seconds, gil_hold_window, gil_holds, machine, median, percentile, print_table,  # noqa: E402
                    rerun_in_loopback_netns, write_json)
from dynamo_side import worker_id  # noqa: E402
from kvevents.demo.fleet import free_port  # noqa: E402
from kvevents.wire.schema import AllBlocksCleared, BatchDecoder, BatchEncoder, KVEventBatch  # noqa: E402
from kvevents.wire.framing import pack_seq  # noqa: E402
from kvtrace import BS, TraceConfig, generate, load_truth, read  # noqa: E402


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


class _Ours:
    """``kvevents serve``: ``POST /v1/lookup``; applied = block events."""
    name = "ours"
    path = "/v1/lookup"
    applied_unit = "block events"
    env: dict | None = None  # the server's environment (None: this process's)

    def command(self, port: int, ports: dict[str, int]) -> list[str]:
        cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port)]
        for engine, p in sorted(ports.items()):
            cmd += ["--endpoint", f"{engine}=tcp://127.0.0.1:{p}"]
        return cmd

    # ``-m`` puts the working directory first on sys.path: run the server from the
    # checkout this process imported, so it serves the same kvevents.
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(kvevents.__file__)))

    def ready(self, client: httpx.Client, n: int) -> bool:
        engines = client.get("/v1/engines").json()["engines"]
        return len(engines) == n and all(p["connected"] for p in engines)

    def applied(self, client: httpx.Client) -> int:
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in client.get("/metrics").text.splitlines()
                   if line.startswith("kvevents_block_events_applied_total{"))

    def body(self, tokens: list[int]) -> bytes:
        return json.dumps({"token_ids": tokens}).encode()

    def best_match(self, res: dict) -> int:
        return res["engines"][0]["matched_tokens"] if res["engines"] else 0

    def extra(self, client: httpx.Client) -> dict:
        engines = client.get("/v1/engines").json()["engines"]
        return {"resident_entries": sum(sum(p["blocks"].values()) for p in engines),
                "lost_batches": sum(p["lost_batches"] for p in engines)}


class _OursAsgi(_Ours):
    """``kvevents serve`` with every lookup through the ASGI app
    (``KVEVENTS_LOOKUP_IN_PROTOCOL=false``): the comparison for the protocol's path."""
    name = "ours_asgi"
    env = {**os.environ, "KVEVENTS_LOOKUP_IN_PROTOCOL": "false"}


class _Dynamo:
    """``python -m dynamo.indexer``: ``POST /query``; applied = events (its metric)."""
    name = "dynamo"
    path = "/query"
    applied_unit = "events"
    cwd = None
    env = None

    def command(self, port: int, ports: dict[str, int]) -> list[str]:
        workers = ",".join(f"{worker_id(e)}=tcp://127.0.0.1:{p}" for e, p in sorted(ports.items()))
        return [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(BS),
                "--workers", workers]

    def ready(self, client: httpx.Client, n: int) -> bool:
        ws = client.get("/workers").json()
        return len(ws) == n and all(all(lst["status"] == "active" for lst in w["listeners"].values())
                                    for w in ws)

    def applied(self, client: httpx.Client) -> int:
        return sum(int(m[3]) for m in _DYNAMO_APPLIED.finditer(client.get("/metrics").text))

    def body(self, tokens: list[int]) -> bytes:
        return json.dumps({"token_ids": tokens, "model_name": "default"}).encode()

    def best_match(self, res: dict) -> int:
        # Per worker, per data-parallel rank: matched tokens (bench_dynamo_e2e reads
        # them the same way, checked against the generator's truth there).
        return max((max(d.values()) for d in res["scores"].values() if d), default=0)

    def extra(self, client: httpx.Client) -> dict:
        return {"resident_entries": None, "lost_batches": None}


_DYNAMO_APPLIED = re.compile(
    r'^dynamo_kvrouter_kv_cache_events_applied\{event_type="(\w+)",status="(\w+)"\} (\d+)', re.M)


def _poster(kind: str, client: httpx.Client, port: int, path: str):
    """``post(body) -> (status, response bytes)`` on one keep-alive connection.
    ``stdlib``: ``http.client``, whose own cost per request is a fraction of httpx's on
    this machine (httpx alone adds ~0.6 ms per request here), so the figure is the
    server's; ``httpx``: the earlier client, for comparison."""
    headers = {"content-type": "application/json"}
    if kind == "httpx":
        def post_httpx(body: bytes) -> tuple[int, bytes]:
            r = client.post(path, content=body, headers=headers)
            return r.status_code, r.content
        return post_httpx
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post_stdlib(body: bytes) -> tuple[int, bytes]:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    return post_stdlib


def _wakeup_probe(stop, result) -> None:
    """Sleep 1 ms at a time until ``stop``; put (wake-ups, > 1 ms late, > 2 ms late)."""
    n = late1 = late2 = 0
    while not stop.is_set():
        t = time.perf_counter()
        time.sleep(0.001)
        late = time.perf_counter() - t - 0.001
        n += 1
        late1 += late > 0.001
        late2 += late > 0.002
    result.put((n, late1, late2))


def run_side(side, args, paths: dict, meta: dict, prompts: dict) -> dict:
    """One server of ``side`` with a fresh publisher: warm-up, timed lookups, the row."""
    ready: mp.Queue = mp.Queue()
    go, stop = mp.Event(), mp.Event()
    sent = mp.Value("q", 0)
    pub = mp.Process(target=_publisher, args=(paths["trace"], args.rate, args.rate > 0, ready, go, stop, sent),
                     daemon=True)
    pub.start()
    ports = ready.get(timeout=300)
    http_port = free_port()
    server = subprocess.Popen(side.command(http_port, ports), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=side.cwd, env=side.env)
    probe_stop, probe_out = mp.Event(), mp.Queue()
    probe = mp.Process(target=_wakeup_probe, args=(probe_stop, probe_out), daemon=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if side.ready(client, len(ports)):
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{side.name} server never became ready")
                time.sleep(0.1)
            time.sleep(1.0)  # subscriptions reach the publisher
            go.set()
            if args.rate:
                time.sleep(args.warmup)
            else:  # idle shape: the whole trace applied first
                target = meta["block_events"] if side.applied_unit == "block events" else meta["events"]
                deadline = time.monotonic() + 600
                while side.applied(client) < target and time.monotonic() < deadline:
                    time.sleep(0.2)
            bodies = [side.body(p.tolist()) for p in prompts[args.tokens]]
            headers = {"content-type": "application/json"}
            for b in bodies[:20]:  # warm-up
                client.post(side.path, content=b, headers=headers)
            post = _poster(args.client, client, http_port, side.path)
            for b in bodies[:20]:  # warm-up of the timed client's connection
                post(b)
            probe.start()
            holds0 = gil_holds(client.get("/metrics").text)
            cpu0 = cpu_seconds(server.pid)
            applied0, sent0, w0 = side.applied(client), sent.value, time.perf_counter()
            lat, matched = [], []
            for i in range(args.requests):
                body = bodies[i % len(bodies)]
                t = time.perf_counter()
                status, text = post(body)
                lat.append((time.perf_counter() - t) * 1e6)
                if status != 200:
                    raise RuntimeError(f"{side.name} lookup answered {status}: {text[:200]!r}")
                matched.append(side.best_match(json.loads(text)))
            window = time.perf_counter() - w0
            cpu = cpu_seconds(server.pid) - cpu0
            applied1, sent1 = side.applied(client), sent.value
            holds = gil_hold_window(holds0, gil_holds(client.get("/metrics").text))
            probe_stop.set()
            wakeups, late1, late2 = probe_out.get(timeout=10)
            extra = side.extra(client)
    finally:
        stop.set()
        probe_stop.set()
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        for proc in (pub, probe):
            if proc.pid is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.terminate()
    row = {"side": side.name, "engines": len(ports), "prompt_tokens": args.tokens, "requests": args.requests,
           "target_rate": args.rate, "published_per_s": round((sent1 - sent0) / window),
           "applied_per_s": round((applied1 - applied0) / window), "applied_unit": side.applied_unit,
           **extra,
           "p50_us": round(median(lat), 1), "p99_us": round(percentile(lat, 99), 1),
           "max_us": round(max(lat), 1), "server_cpu_us_per_lookup": round(1e6 * cpu / args.requests, 1), "mean_best_match_tokens": round(sum(matched) / len(matched), 1),
           "probe_late_1ms_pct": round(100 * late1 / max(1, wakeups), 2),
           "probe_late_2ms_pct": round(100 * late2 / max(1, wakeups), 2), **holds}
    print(f"  {row}", file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=200_000, help="block events/s during lookups (0: none)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of ingest before the lookups")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=2048, choices=[2048, 32768])
    ap.add_argument("--sides", default="ours",
                    help="servers to measure, from ours, ours_asgi (lookups through the ASGI app), dynamo")
    ap.add_argument("--runs", type=int, default=1, help="runs per side (alternating order)")
    ap.add_argument("--workdir", default="/tmp/kvevents-traces")
    ap.add_argument("--client", choices=["stdlib", "httpx"], default="stdlib",
                    help="the timed client (stdlib: http.client, one keep-alive connection)")
    ap.add_argument("--json", default="benchmarks/results/http.json")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    known = {"ours": _Ours, "ours_asgi": _OursAsgi, "dynamo": _Dynamo}
    names = args.sides.split(",")
    if not names or any(n not in known for n in names):
        ap.error(f"--sides: expected names from {sorted(known)}, got {args.sides!r}")
    paths = generate(TraceConfig(args.engines, args.capacity), args.workdir)
    if "dynamo" in names and not args.inner:  # it binds 0.0.0.0: run where only loopback exists
        sys.exit(rerun_in_loopback_netns(__file__, sys.argv[1:]))
    with open(paths["meta"]) as f:
        meta = json.load(f)
    _, prompts = load_truth(paths["truth"])
    sides = [known[n]() for n in names]
    rows = []
    for r in range(args.runs):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            rows.append(run_side(side, args, paths, meta, prompts) | {"run": r})
    print(f"kvevents from {kvevents.__file__}", file=sys.stderr)
    cols = ["run", "side", "published_per_s", "applied_per_s", "applied_unit", "resident_entries",
            "lost_batches", "p50_us", "p99_us", "max_us", "server_cpu_us_per_lookup", "mean_best_match_tokens",
            "probe_late_1ms_pct", "probe_late_2ms_pct", "gil_over_0_5ms", "gil_longest_le_s"]
    print_table(cols, [[row[c] for c in cols] for row in rows])
    summary = {}
    for side in sides:
        mine = [row for row in rows if row["side"] == side.name]
        summary[side.name] = {"p50_us": median([row["p50_us"] for row in mine]),
                              "p99_us": median([row["p99_us"] for row in mine]),
                              "server_cpu_us_per_lookup": median([row["server_cpu_us_per_lookup"] for row in mine])}
        print(f"{side.name}: median p50 {summary[side.name]['p50_us'] / 1000:.2f} ms, "
              f"p99 {summary[side.name]['p99_us'] / 1000:.2f} ms over {len(mine)} runs "
              f"(target p99 <= 1 ms while ingest runs at 200k block events/s)")
    write_json(args.json, {"benchmark": "P3 lookup over HTTP during ingest", "machine": machine(),
                           "kvevents": kvevents.__file__, "args": vars(args), "runs": rows,
                           "median": summary})


if __name__ == "__main__":
    main()
