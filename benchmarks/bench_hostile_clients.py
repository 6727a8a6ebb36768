"""Hostile clients against ``kvevents serve`` in front of fake engines: attacks, each
on a fresh gateway process, with well-behaved requests probing alongside.

The engines: one process (``tests/hostile_engine.py``) serving two fake OpenAI engines
(vLLM-shaped SSE, a chunk every 2 ms), counting the answers they are streaming now and
their peak. The gateway: ``kvevents serve`` with a local tokenizer (the tests' byte-level
BPE, ``tests/text_tokenizer.py``), run from ``--root`` (another checkout: the code before
a change, with the same flags). Figures from ``/proc``: the gateway's open files, RSS and
CPU seconds (utime + stime).

* ``storm``: 2,000 streamed chats, 64 at a time, each client leaving at a random moment
  (right after sending, after the first chunk, mid-stream; FIN or RST): engine streams
  still open 1 s and 20 s after the last client left, files and RSS before/after;
* ``capacity``: ``--max-inflight 64``, 500 clients each sending streamed chats one after
  another for 10 s, the body with the head, then 100 ms after it: the engines' peak of
  streams at once, answers 200 / 503;
* ``malformed``: invalid UTF-8 in a message, JSON nested 10,000 deep (under an unknown
  field, in a message), a 7.9 MB chat body, a declared 100 MB body (does the connection
  close after the 413?), a client leaving mid-upload: status, seconds, RSS growth;
* ``long_prompt``: 10 chats of 2,000,000 characters at once, under ``max_prompt_chars``
  but beyond the engines' context (``--max-model-len``, in their ``/v1/models``; 0: not
  given, the gateway then tokenizes them): statuses, seconds, RSS growth at peak and after;
* ``slowloris``: 1,000 connections trickling a head one byte every 3 s and 200 trickling a
  1 MB body, for 20 s, then silent (sockets kept): files over time until back to the
  start (at most 65 s), probes' p50/p99;
* ``slow_readers``: 100 clients asking for 23 MB answers, half reading 1 KB/s, half
  nothing, for 10 s, then leaving: RSS growth at peak and 10 s after, engines paused;
* ``cardinality``: 10,008 requests naming random models, adapters, salts, sessions,
  headers, paths and engines, to every endpoint that takes a name
  (``hostile_support.named_requests``), 16 at a time, to a gateway run with
  ``--auth-token`` as deployed: the series on ``/metrics`` and the RSS before and after, after one round of each first (the fixed series born); with
  ``--vllm-router``, the same attack on vllm-router 0.1.17 (``cache_aware``, its
  Prometheus port, the RSS of its whole session) in front of the same engines;
* ``baseline`` (not an attack: what the guards cost well-behaved clients): 3 rounds of
  2,000 streamed chats (64 chunks each), 16 in flight on kept-alive connections, every
  answer's payload checked byte for byte: the gateway's CPU milliseconds per request.

    .venv/bin/python benchmarks/bench_hostile_clients.py [--attacks storm,capacity,...]
        [--root /path/to/other/checkout] [--json benchmarks/results/hostile_clients.json]
        [--vllm-router cache_aware]   # the cardinality attack on vllm-router too ('.[bench]')
        [--max-model-len 32768]       # the engines' context (0: not in their /v1/models)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import httpx  # noqa: E402

from common import machine, percentile, write_json  # noqa: E402
from hostile_support import GatewayProcess, chat_body, named_requests, raw_request, series_count  # noqa: E402
from support import free_port  # noqa: E402
from text_tokenizer import build_bytelevel  # noqa: E402

ATTACKS = ("storm", "capacity", "malformed", "long_prompt", "slowloris", "slow_readers", "cardinality",
           "baseline")


class Engines:
    """The fake engines' process (two ports, counted together)."""

    def __init__(self, max_model_len: int = 0) -> None:
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        cmd = [sys.executable, str(HERE.parent / "tests" / "hostile_engine.py")]
        for p in self.ports:
            cmd += ["--port", str(p)]
        if max_model_len:  # in their /v1/models, as vLLM gives it
            cmd += ["--max-model-len", str(max_model_len)]
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                self.stats()
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the fake engines did not start")

    def stats(self, reset: bool = False) -> dict:
        return httpx.get(self.urls[0] + ("/stats/reset" if reset else "/stats"), timeout=5).json()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# -- clients ---------------------------------------------------------------------------------

async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)


def _leave(writer: asyncio.StreamWriter, rst: bool) -> None:
    if rst:  # SO_LINGER 0: the close is an RST, as a crashed client's
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


async def _probe(port: int, out: list[float], errors: list, stop: asyncio.Event) -> None:
    """A well-behaved non-streamed chat every 100 ms, each on a new connection."""
    body = raw_request(port, chat_body(False, 2), headers="connection: close\r\n")
    while not stop.is_set():
        t = time.perf_counter()
        try:
            reader, writer = await _open(port)
            writer.write(body)
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            if not answer.startswith(b"HTTP/1.1 200"):
                errors.append(answer[:40].decode("latin-1"))
            out.append(time.perf_counter() - t)
        except (OSError, asyncio.TimeoutError) as exc:
            errors.append(type(exc).__name__)
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


def _probes(lat: list[float], errors: list) -> dict:
    return {"probes": len(lat) + len(errors), "probe_errors": len(errors),
            "probe_p50_ms": round(percentile([x * 1000 for x in lat], 50), 2) if lat else None,
            "probe_p99_ms": round(percentile([x * 1000 for x in lat], 99), 2) if lat else None}


# -- attacks ---------------------------------------------------------------------------------

async def storm(g: GatewayProcess, eng: Engines, n: int = 2000, conc: int = 64) -> dict:
    rng = random.Random(7)
    # 3 MB answers: larger than what the gateway buffers, so a stream it leaks stays
    # open on the engine (paused), as a real long answer would.
    body = raw_request(g.port, chat_body(True, 3000, fake_chunk_bytes=1024))
    sem = asyncio.Semaphore(conc)
    moments = {"sent": 0, "first chunk": 0, "mid-stream": 0}

    async def one(i: int) -> None:
        async with sem:
            moment = rng.choice(list(moments))
            rst = rng.random() < 0.5
            moments[moment] += 1
            reader, writer = await _open(g.port)
            writer.write(body)
            if moment != "sent":
                want = 1 if moment == "first chunk" else rng.randint(2, 200)
                seen = 0
                while seen < want:
                    got = await reader.read(65536)
                    if not got:
                        break
                    seen += got.count(b"data: ")
            _leave(writer, rst)

    await asyncio.gather(*(one(i) for i in range(n)))
    left = time.monotonic()
    out = {"clients": n, "moments": moments}
    for at in (0.1, 1.0, 5.0, 20.0):
        await asyncio.sleep(max(0.0, left + at - time.monotonic()))
        out[f"engine_streams_open_{at:g}s"] = eng.stats()["open"]
    return out


async def capacity(g: GatewayProcess, eng: Engines, clients: int = 500, secs: float = 10) -> dict:
    body = chat_body(True, 64)
    out = {}
    for late in (False, True):
        eng.stats(reset=True)
        counts: dict[int, int] = {}
        until = time.monotonic() + secs
        request = raw_request(g.port, body)

        async def client() -> None:
            while time.monotonic() < until:
                try:
                    reader, writer = await _open(g.port)
                    if late:
                        writer.write(request[:-len(body)])
                        await asyncio.sleep(0.1)
                        writer.write(body)
                    else:
                        writer.write(request)
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                    status = int(head.split(b" ", 2)[1])
                    if status == 200:
                        await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 30)
                    writer.close()
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
                    status = 0
                counts[status] = counts.get(status, 0) + 1
                if status != 200:
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(client() for _ in range(clients)))
        key = "body_late" if late else "body_early"
        out[key] = {"engine_peak_streams": eng.stats()["peak"],
                    "answers": {str(k): v for k, v in sorted(counts.items())}}
    return out


async def _send_body(port: int, body: bytes, timeout: float = 60) -> tuple[int, float]:
    t = time.perf_counter()
    reader, writer = await _open(port)
    writer.write(raw_request(port, body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    writer.close()
    return int(head.split(b" ", 2)[1]), time.perf_counter() - t


async def long_prompt(g: GatewayProcess, eng: Engines, n: int = 10, chars: int = 2_000_000) -> dict:
    """``n`` chats of ``chars`` characters at once (under ``max_prompt_chars``, beyond
    what the engines' ``max_model_len`` can take): statuses, seconds, RSS growth."""
    words = b"The cache holds key and value tensors for every token the model has seen. "
    body = (b'{"model":"fake","stream":true,"messages":[{"role":"user","content":"'
            + (words * (chars // len(words) + 1))[:chars] + b'"}]}')
    rss0 = peak = g.rss_mb()
    tasks = [asyncio.ensure_future(_send_body(g.port, body)) for _ in range(n)]
    while not all(t.done() for t in tasks):
        peak = max(peak, g.rss_mb())
        await asyncio.sleep(0.02)
    got = []
    for t in tasks:
        try:
            got.append(t.result())
        except (OSError, asyncio.TimeoutError) as exc:
            got.append((type(exc).__name__, None))
    statuses: dict[str, int] = {}
    for status, _ in got:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    secs = [s for _, s in got if s is not None]
    return {"long prompt": {"requests_at_once": n, "characters": chars, "statuses": statuses,
                            "max_seconds": round(max(secs), 3) if secs else None,
                            "rss_growth_peak_mb": round(peak - rss0, 1),
                            "rss_growth_after_mb": round(g.rss_mb() - rss0, 1)}}


async def malformed(g: GatewayProcess, eng: Engines) -> dict:
    deep = b"[" * 10_000 + b"]" * 10_000
    words = b"The cache holds key and value tensors for every token the model has seen. "

    def msg(content: bytes) -> bytes:
        return b'{"model":"fake","stream":true,"messages":[{"role":"user","content":' + content + b"}]}"

    bodies = {"invalid UTF-8": msg(b'"caf\xc3 \xff\xfe"'),
              "nested 10,000 deep, unknown field": b'{"model":"fake","x":' + deep + b',"messages":[]}',
              "nested 10,000 deep, in a message": msg(deep),
              "7.9 MB chat body": msg(b'"' + words * (7_900_000 // len(words)) + b'"')}
    out = {}
    for what, body in bodies.items():
        rss0, peak = g.rss_mb(), g.rss_mb()
        task = asyncio.ensure_future(_send_body(g.port, body))
        while not task.done():
            peak = max(peak, g.rss_mb())
            await asyncio.sleep(0.05)
        try:
            status, secs = task.result()
        except (OSError, asyncio.TimeoutError) as exc:
            status, secs = type(exc).__name__, None
        out[what] = {"status": status, "seconds": None if secs is None else round(secs, 3),
                     "rss_growth_peak_mb": round(peak - rss0, 1),
                     "rss_growth_after_mb": round(g.rss_mb() - rss0, 1)}
    # A declared 100 MB body: the 413, then is the connection closed, or read on?
    reader, writer = await _open(g.port)
    t = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 104857600\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    first = time.perf_counter() - t
    pushed, closed_after = 0, None
    chunk = b"x" * (1 << 20)
    try:
        while pushed < 100 << 20 and time.perf_counter() - t < 10:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 5)
            pushed += len(chunk)
            if reader.at_eof() or writer.transport.is_closing():
                break
        closed_after = round(time.perf_counter() - t, 3)
    except (OSError, asyncio.TimeoutError):
        closed_after = round(time.perf_counter() - t, 3)
    writer.transport.abort()
    out["declared 100 MB body"] = {"status": int(head.split(b" ", 2)[1]), "seconds": round(first, 3),
                                   "connection_close_header": b"connection: close" in head.lower(),
                                   "bytes_the_gateway_took_mb": round(pushed / 2**20, 1),
                                   "gave_up_after_s": closed_after}
    # A client that leaves mid-upload.
    before = g.metric("kvevents_gateway_requests_total", status="499")
    body = chat_body(False)
    reader, writer = await _open(g.port)
    writer.write(raw_request(g.port, body)[:-len(body) // 2])
    await asyncio.sleep(0.2)
    writer.close()
    await asyncio.sleep(1)
    out["left mid-upload"] = {"counted_499": g.metric("kvevents_gateway_requests_total", status="499") - before,
                              "asgi_exception_in_log": "Exception in ASGI application" in g.log_text()}
    return out


async def slowloris(g: GatewayProcess, eng: Engines, heads: int = 1000, bodies: int = 200,
                    active_s: float = 20, watch_s: float = 65) -> dict:
    fds0 = g.fds()
    conns = []
    for i in range(heads + bodies):
        try:
            conns.append(await _open(g.port))
        except OSError:
            break
        if i >= heads:
            conns[-1][1].write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                               b"application/json\r\ncontent-length: 1048576\r\n\r\n{")
    head_bytes = raw_request(g.port, chat_body(False))
    stop, lat, errors = asyncio.Event(), [], []
    probe = asyncio.ensure_future(_probe(g.port, lat, errors, stop))
    t0 = time.monotonic()
    peak_fds, sent = g.fds(), 0
    while time.monotonic() - t0 < active_s:  # one byte per connection every 3 s
        for i, (_, w) in enumerate(conns):
            if not w.transport.is_closing():
                w.write(head_bytes[sent:sent + 1] if i < heads else b" ")
        sent += 1
        peak_fds = max(peak_fds, g.fds())
        await asyncio.sleep(3)
    silent = time.monotonic()  # the attacker goes silent, its sockets kept
    back = None
    series = []
    while time.monotonic() - silent < watch_s:
        n = g.fds()
        series.append((round(time.monotonic() - silent, 1), n))
        if n <= fds0 + 4 and back is None:
            back = round(time.monotonic() - silent, 1)
            break
        await asyncio.sleep(1)
    stop.set()
    await probe
    for _, w in conns:
        w.transport.abort()
    return {"connections": len(conns), "fds_start": fds0, "fds_peak": peak_fds,
            "fds_back_after_silent_s": back, "fds_end": g.fds(), "fds_series": series[::5],
            **_probes(lat, errors)}


async def slow_readers(g: GatewayProcess, eng: Engines, n: int = 100, secs: float = 10) -> dict:
    body = raw_request(g.port, chat_body(True, 6000, fake_chunk_bytes=4096, fake_interval_ms=0))
    rss0 = g.rss_mb()
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", g.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        s.sendall(body)
        socks.append(s)
    peak, t0 = rss0, time.monotonic()
    while time.monotonic() - t0 < secs:
        for s in socks[::2]:  # half read 1 KB a second, half nothing
            try:
                s.recv(1024)
            except BlockingIOError:
                pass
        peak = max(peak, g.rss_mb())
        await asyncio.sleep(1)
    streaming = eng.stats()
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    await asyncio.sleep(10)
    return {"clients": n, "answer_mb": round(6000 * 4096 / 2**20), "rss_start_mb": round(rss0, 1),
            "rss_growth_peak_mb": round(peak - rss0, 1), "rss_growth_10s_after_mb": round(g.rss_mb() - rss0, 1),
            "engine_streams_open_while_reading": streaming["open"],
            "engine_streams_finished": streaming["finished"], "engine_streams_open_after": eng.stats()["open"]}


def session_rss_mb(sid: int) -> float:
    """The RSS of every process in session ``sid`` (a router's launcher and its workers)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                    continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue  # gone meanwhile, or a kernel thread
    return total / 1024


async def _named_rounds(url: str, rounds: int, conc: int = 16) -> dict:
    """``rounds`` rounds of :func:`named_requests` against ``url``: answers by status."""
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def worker(w: int) -> None:
            for k in range(w, rounds, conc):
                for _, method, path, body, headers in named_requests(k):
                    try:
                        code = str((await client.request(method, path, json=body, headers=headers)).status_code)
                    except httpx.HTTPError as exc:
                        code = type(exc).__name__
                    statuses[code] = statuses.get(code, 0) + 1
        await asyncio.gather(*(worker(w) for w in range(conc)))
    return statuses


def cardinality_attack(url: str, metrics_url: str, rss) -> dict:
    """The attack on one router: series and RSS after a first round of each request
    (every fixed series born), then after 10,008 more."""
    asyncio.run(_named_rounds(url, 32))
    time.sleep(1)
    series0, rss0 = series_count(httpx.get(metrics_url, timeout=30).text), rss()
    t = time.perf_counter()
    rounds = 10_000 // len(named_requests(0)) + 1
    statuses = asyncio.run(_named_rounds(url, rounds))
    seconds = time.perf_counter() - t
    time.sleep(1)
    text = httpx.get(metrics_url, timeout=30).text
    return {"requests": rounds * len(named_requests(0)), "seconds": round(seconds, 1),
            "statuses": statuses, "series": [series0, series_count(text)],
            "metrics_bytes_after": len(text), "rss_mb": [round(rss0, 1), round(rss(), 1)]}


def cardinality_vllm_router(policy: str) -> dict:
    """The cardinality attack on vllm-router (``policy``) in front of fresh fake engines."""
    from bench_gateway_cost import start_vllm_router, stop

    eng = Engines()
    log = Path(tempfile.mkdtemp(prefix="kvevents-vllm-router-")) / "router.log"
    try:
        proc, port, metrics_port = start_vllm_router(policy, [{"port": p} for p in eng.ports], log)
        try:
            got = cardinality_attack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics",
                                     lambda: session_rss_mb(proc.pid))
        finally:
            stop(proc)
    finally:
        eng.close()
    return {"attack": "cardinality", "router": f"vllm-router {policy}", **got}


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, rest = out + rest[:n], rest[n + 2:]


async def cardinality(g: GatewayProcess, eng: Engines) -> dict:
    # (synchronous inside: its own event loops, in a thread off this one)
    got = await asyncio.to_thread(cardinality_attack, g.url, g.url + "/metrics", g.rss_mb)
    return {"router": "kvevents serve", **got}


async def baseline(g: GatewayProcess, eng: Engines, n: int = 2000, conc: int = 16) -> dict:
    chunk = b"data: " + json.dumps({"id": "cmpl-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": "abc"}}]}).encode() + b"\n\n"
    want = chunk * 64 + (b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":10,'
                         b'"completion_tokens":64,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
                         b"data: [DONE]\n\n")
    request = raw_request(g.port, chat_body(True, 64))
    rounds, wrong = [], 0

    async def client(k: int) -> None:
        nonlocal wrong
        reader, writer = await _open(g.port)
        for _ in range(k):
            writer.write(request)
            await reader.readuntil(b"\r\n\r\n")
            wrong += _dechunk(await reader.readuntil(b"\r\n0\r\n\r\n")) != want
        writer.close()

    for _ in range(3):
        cpu = g.cpu_s()
        await asyncio.gather(*(client(n // conc) for _ in range(conc)))
        rounds.append(round((g.cpu_s() - cpu) / n * 1000, 2))
    return {"requests_per_round": n, "gateway_cpu_ms_per_request": rounds,
            "median_ms": sorted(rounds)[1], "answers_not_byte_exact": wrong}


def run(attack: str, root: str, tokenizer: str, max_model_len: int = 32768) -> dict:
    eng = Engines(max_model_len)
    extra = {"capacity": ["--max-inflight", "64"],  # (engines added or removed only with the token,
             "cardinality": ["--auth-token", "bench-token"]}.get(attack, [])  # as deployed)
    try:
        with GatewayProcess(eng.urls, "--tokenizer", f"fake={tokenizer}", *extra, root=root) as g:
            fds0, rss0, cpu0 = g.fds(), g.rss_mb(), g.cpu_s()
            stop, lat, errors = asyncio.Event(), [], []

            async def main() -> dict:
                if attack == "baseline":  # its own clients only: their CPU per request
                    return await baseline(g, eng)
                probe = asyncio.ensure_future(_probe(g.port, lat, errors, stop))
                try:
                    return await globals()[attack](g, eng)
                finally:
                    stop.set()
                    await probe

            got = asyncio.run(main())
            time.sleep(1)
            return {"attack": attack, **got, "gateway_fds": [fds0, g.fds()],
                    "gateway_rss_mb": [round(rss0, 1), round(g.rss_mb(), 1)],
                    "gateway_cpu_s": round(g.cpu_s() - cpu0, 2),
                    **({} if attack in ("slowloris", "baseline") else _probes(lat, errors))}
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--root", default=str(HERE.parent), help="checkout whose kvevents serve runs")
    ap.add_argument("--json", default="benchmarks/results/hostile_clients.json")
    ap.add_argument("--max-model-len", type=int, default=32768,
                    help="the engines' context in their /v1/models (0: not given, as before "
                         "the gateway read it)")
    ap.add_argument("--vllm-router", default="", metavar="POLICY",
                    help="also run the cardinality attack on vllm-router 0.1.17 with this policy")
    a = ap.parse_args()
    tok = build_bytelevel(Path(tempfile.mkdtemp(prefix="kvevents-tok-")))
    results = []
    for attack in a.attacks.split(","):
        r = run(attack, a.root, str(tok), a.max_model_len)
        print(json.dumps(r), flush=True)
        results.append(r)
        if attack == "cardinality" and a.vllm_router:
            r = cardinality_vllm_router(a.vllm_router)
            print(json.dumps(r), flush=True)
            results.append(r)
    write_json(a.json, {"benchmark": "hostile clients against kvevents serve", "machine": machine(),
                        "root": a.root, "args": vars(a), "results": results})


if __name__ == "__main__":
    main()
