"""P3: ``POST /v1/lookup`` latency over HTTP, one keep-alive client.

A real ``kvevents serve`` process (uvicorn) follows 8 publishers that replay a recorded
workload (benchmarks/workload.py); once every batch is applied, one client sends
2,048-token prompts on a keep-alive connection and times each request end to end
(serialisation, HTTP, validation, index lookup, response).

    .venv/bin/python benchmarks/bench_http.py [--capacity 20000] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import zmq

from common import machine, median, percentile, print_table, write_json
from kvevents.transport import pack_seq
from workload import Workload, read, write


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", default="benchmarks/results/http.json")
    args = ap.parse_args()
    w = Workload(pods=args.pods, capacity=args.capacity)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "workload.bin")
    write(w, path)
    records = list(read(path))
    pods = sorted({p for p, _ in records})
    ctx = zmq.Context()
    socks, ports = {}, {}
    for pod in pods:
        ports[pod] = _port()
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)
        s.bind(f"tcp://127.0.0.1:{ports[pod]}")
        socks[pod] = s
    http_port = _port()
    cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(http_port)]
    for pod in pods:
        cmd += ["--endpoint", f"{pod}=tcp://127.0.0.1:{ports[pod]}"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{http_port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(200):
                try:
                    pods_now = client.get("/v1/pods").json()["pods"]
                    if all(p["connected"] for p in pods_now) and len(pods_now) == len(pods):
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            time.sleep(0.5)
            seqs = {pod: 0 for pod in pods}
            for pod, payload in records:
                socks[pod].send_multipart((b"", pack_seq(seqs[pod]), payload))
                seqs[pod] += 1
            want = {pod: n - 1 for pod, n in seqs.items()}
            for _ in range(600):
                got = {p["name"]: p["last_seq"] for p in client.get("/v1/pods").json()["pods"]}
                if got == want:
                    break
                time.sleep(0.1)
            entries = sum(sum(p["blocks"].values()) for p in client.get("/v1/pods").json()["pods"])
            prompts = w.prompts(args.tokens)
            bodies = [json.dumps({"token_ids": p}).encode() for p in prompts]
            headers = {"content-type": "application/json"}
            for b in bodies[:50]:  # warm-up
                client.post("/v1/lookup", content=b, headers=headers)
            lat = []
            matched = []
            for i in range(args.requests):
                body = bodies[i % len(bodies)]
                t = time.perf_counter()
                r = client.post("/v1/lookup", content=body, headers=headers)
                lat.append((time.perf_counter() - t) * 1e6)
                assert r.status_code == 200, r.text
                res = r.json()
                matched.append(res["pods"][0]["matched_tokens"] if res["pods"] else 0)
    finally:
        server.terminate()
        server.wait(10)
        for s in socks.values():
            s.close(0)
    row = {"pods": len(pods), "resident_entries": entries, "prompt_tokens": args.tokens,
           "requests": args.requests, "p50_us": round(median(lat), 1),
           "p99_us": round(percentile(lat, 99), 1), "max_us": round(max(lat), 1),
           "mean_best_match_tokens": round(sum(matched) / len(matched), 1)}
    print_table(list(row), [list(row.values())])
    print(f"p99 {row['p99_us'] / 1000:.2f} ms (target <= 2 ms)")
    write_json(args.json, {"benchmark": "P3 lookup over HTTP", "machine": machine(), "args": vars(args),
                           "result": row})


if __name__ == "__main__":
    main()
