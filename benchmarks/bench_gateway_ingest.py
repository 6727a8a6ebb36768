"""Issue 21: the gateway's added latency, and the ingest thread's GIL holds, while ingest runs.

One ``kvevents serve`` process follows every engine of the realistic trace
(benchmarks/kvtrace.py, as ``bench_http.py``); a fresh publisher process per run replays
the trace paced at ``--rate`` block events/s (``bench_http._publisher``: at the end of
the trace it clears every engine and starts over). One of the engines also has an
OpenAI server: a raw ASGI app on uvicorn that answers every chat completion at once with
one token, so what is measured is the gateway, not an engine. The gateway tokenizes
locally (``--tokenizer``, the tiny tokenizer with its chat template).

After ``--warmup`` seconds of ingest, one keep-alive client (``http.client``) sends
``--requests`` one-token chat completions through the gateway, each interleaved with the
same request sent to the upstream directly; the added latency is the difference of the
two distributions' percentiles. Rate 0 is the idle shape (nothing published). Alongside:
the rate the server applied during the window, and the ingest thread's stretches between
GIL releases during the window (``kvevents_ingest_gil_hold_seconds``: the count above
0.5 ms and the bucket bound that covers the longest; see kvevents/ingest/gilmeter.py).
``KVEVENTS_INGEST_LANE=false`` in the environment runs the server without the lane.

    .venv/bin/python benchmarks/bench_gateway_ingest.py --rates 0,200000 --runs 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

import kvevents  # noqa: E402
from bench_http import _Ours, _publisher  # noqa: E402
from common import gil_hold_window, gil_holds, machine, median, percentile, print_table, write_json  # noqa: E402
from kvevents.demo.fleet import free_port  # noqa: E402
from kvevents.demo.tiny_model import make_tiny_tokenizer  # noqa: E402
from kvtrace import TraceConfig, generate  # noqa: E402

MODEL = "tiny"
_ANSWER = json.dumps({
    "id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
              "prompt_tokens_details": {"cached_tokens": 0}},
}).encode()
_METRICS = (b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
            b"vllm:kv_cache_usage_perc 0\n")


async def upstream(scope, receive, send) -> None:
    """An OpenAI server that answers at once (raw ASGI: no framework cost of its own)."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    path = scope["path"]
    body = _ANSWER if path.endswith("/completions") else _METRICS if path == "/metrics" else (
        json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        if path == "/v1/models" else b"{}")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _serve_upstream(port: int) -> None:
    import uvicorn
    uvicorn.run(upstream, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools")


def run(args, trace: str, tok_dir: str, rate: float) -> dict:
    ready: mp.Queue = mp.Queue()
    go, stop = mp.Event(), mp.Event()
    sent = mp.Value("q", 0)
    pub = mp.Process(target=_publisher, args=(trace, rate, rate > 0, ready, go, stop, sent), daemon=True)
    pub.start()
    ports = ready.get(timeout=300)
    up_port, http_port = free_port(), free_port()
    up = mp.Process(target=_serve_upstream, args=(up_port,), daemon=True)
    up.start()
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(http_port),
           "--tokenizer", f"{MODEL}={tok_dir}"]
    for i, (engine, p) in enumerate(sorted(ports.items())):
        extra = f",model={MODEL},http=http://127.0.0.1:{up_port}" if i == 0 else ""
        cmd += ["--endpoint", f"{engine}=tcp://127.0.0.1:{p}{extra}"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(kvevents.__file__))))
    body = json.dumps({"model": MODEL, "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello! How are you today?"}]}).encode()
    headers = {"content-type": "application/json"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    engines = client.get("/v1/engines").json()["engines"]
                    if len(engines) == len(ports) and all(e["connected"] for e in engines) and \
                            client.get("/v1/models").json()["data"]:
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("server never became ready")
                time.sleep(0.1)
            time.sleep(1.0)  # subscriptions reach the publisher
            if rate:  # idle: the publisher never starts
                go.set()
                time.sleep(args.warmup)
            via = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
            direct = http.client.HTTPConnection("127.0.0.1", up_port, timeout=60)

            def once(conn) -> float:
                t = time.perf_counter()
                conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                if r.status != 200:
                    raise RuntimeError(f"answered {r.status}: {data[:200]!r}")
                return time.perf_counter() - t

            for _ in range(50):  # warm-up of both connections and the gateway's pool
                once(direct), once(via)
            holds0, applied0, sent0, w0 = gil_holds(client.get("/metrics").text), _Ours().applied(client), sent.value, time.perf_counter()
            routed, plain = [], []
            for _ in range(args.requests):
                plain.append(once(direct))
                routed.append(once(via))
            window = time.perf_counter() - w0
            holds1, applied1, sent1 = gil_holds(client.get("/metrics").text), _Ours().applied(client), sent.value
            via.close()
            direct.close()
    finally:
        stop.set()
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        for proc in (pub, up):
            proc.terminate()
            proc.join(10)
    row = {"rate": rate, "published_per_s": round((sent1 - sent0) / window),
           "applied_per_s": round((applied1 - applied0) / window), "requests": args.requests,
           "gateway_p50_ms": percentile(routed, 50) * 1e3, "gateway_p99_ms": percentile(routed, 99) * 1e3,
           "direct_p50_ms": percentile(plain, 50) * 1e3, "direct_p99_ms": percentile(plain, 99) * 1e3,
           **gil_hold_window(holds0, holds1)}
    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    print(f"  {row}", file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--rates", default="0,200000", help="block events/s per run kind (0: idle)")
    ap.add_argument("--runs", type=int, default=2, help="runs per rate (alternating)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--workdir", default="/tmp/kvevents-traces")
    ap.add_argument("--json", default="benchmarks/results/gateway_ingest.json")
    args = ap.parse_args()
    cfg = TraceConfig(engines=args.engines, capacity=args.capacity)
    trace = generate(cfg, args.workdir)["trace"]
    tok_dir = make_tiny_tokenizer(os.path.join(tempfile.gettempdir(), "kvevents-bench-tokenizer"))
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for i in range(args.runs):
        for rate in (rates if i % 2 == 0 else rates[::-1]):
            rows.append({"run": i, **run(args, trace, str(tok_dir), rate)})
    lane = os.environ.get("KVEVENTS_INGEST_LANE", "true")
    cols = ["run", "rate", "published_per_s", "applied_per_s", "gateway_p50_ms", "gateway_p99_ms",
            "direct_p50_ms", "direct_p99_ms", "added_p50_ms", "added_p99_ms", "gil_over_0_5ms",
            "gil_longest_le_s"]
    print(f"\n{args.engines} engines x {args.capacity:,} blocks; ingest lane {lane}; {machine()}")
    print_table(cols, [[r[c] if not isinstance(r[c], float) or c.endswith("_s") else round(r[c], 3)
                        for c in cols] for r in rows])
    for rate in rates:
        mine = [r for r in rows if r["rate"] == rate]
        print(f"rate {rate:,.0f}: medians added p50 {median([r['added_p50_ms'] for r in mine]):.3f} ms, "
              f"p99 {median([r['added_p99_ms'] for r in mine]):.3f} ms; gateway p99 "
              f"{median([r['gateway_p99_ms'] for r in mine]):.3f} ms")
    write_json(args.json, {"machine": machine(), "lane": lane, "rows": rows})


if __name__ == "__main__":
    main()
