"""P1 end to end over ZeroMQ: 8 publisher processes -> one ``kvevents serve`` process vs
-> Dynamo 1.6.1's ``python -m dynamo.indexer``, same trace, same run, alternating.

``dynamo.indexer`` listens on 0.0.0.0, so the whole benchmark (publishers and both
consumers) re-executes itself inside ``unshare -n`` (a network namespace whose only
interface is loopback, brought up with ``ip link set lo up``); our side runs in that
same namespace. Needs root (or user namespaces) and the bench venv.

Each run starts 8 fresh publisher processes. Each owns ``engines / 8`` engines of the trace
(benchmarks/kvtrace.py), one PUB socket per engine bound on 127.0.0.1 (unbounded send
queue: this measures the consumer), and replays its engines' batches in trace order with
vLLM framing ``[topic, seq, payload]`` as fast as it can once told to go. The consumer
follows all the engines. The clock runs from "go" until the consumer says it applied
everything, asked its own way:

* ours: ``GET /v1/engines`` shows every engine at its last seq and holding exactly the
  generator's final resident block count (so the last batch is applied too);
* Dynamo: ``GET /metrics``: ``dynamo_kvrouter_kv_cache_events_applied`` summed over
  event types and statuses equals the trace's event count (non-"ok" statuses reported).

Polls come every ``--poll`` s (50 ms: polling every 10 ms took ~20% off our server's
rate); the time reported is the midpoint between the last "not yet" and the first
"done", with half that interval as its resolution. Each publisher also reports when it
handed its last message to ZeroMQ (``perf_counter``, CLOCK_MONOTONIC, one clock for all
the processes): the table's "last publish / done" column shows how long each consumer
went on after the publishers had stopped competing for the 2 cores.

Then both are asked for the lookup prompts over HTTP and checked against the truth.

    .venv-bench/bin/python benchmarks/bench_dynamo_e2e.py --engines 16 --capacity 20000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zmq  # noqa: E402

import kvevents  # noqa: E402
from common import cpu_seconds, machine, median, print_table, rerun_in_loopback_netns, write_json  # noqa: E402
from dynamo_side import engine_name, worker_id  # noqa: E402
from kvevents.demo.fleet import free_port  # noqa: E402
from kvevents.wire.framing import pack_seq  # noqa: E402
from kvtrace import BS, TraceConfig, add_trace_args, expected_blocks, generate, load_truth, read  # noqa: E402

_APPLIED = re.compile(r'^dynamo_kvrouter_kv_cache_events_applied\{event_type="(\w+)",status="(\w+)"\} (\d+)',
                      re.M)


def _publisher(trace: str, engines: list[str], ready, go, stop) -> None:
    """Bind one PUB per engine, report ports, replay on ``go``, report when the last
    message was handed to ZeroMQ, linger until ``stop``."""
    mine = set(engines)
    records = [(engine, payload) for engine, payload in read(trace) if engine in mine]
    ctx = zmq.Context()
    socks, ports = {}, {}
    for engine in engines:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)
        ports[engine] = s.bind_to_random_port("tcp://127.0.0.1")
        socks[engine] = s
    ready.put(ports)
    go.wait(120)
    seq = dict.fromkeys(engines, 0)
    for engine, payload in records:
        socks[engine].send_multipart((b"", pack_seq(seq[engine]), payload), copy=False)
        seq[engine] += 1
    ready.put(("sent", time.perf_counter()))
    stop.wait(900)
    for s in socks.values():
        s.close(linger=0)
    ctx.term()


def _http(port: int, path: str, body: dict | None = None, timeout: float = 10) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _wait(pred, timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except (OSError, ValueError):
            pass
        time.sleep(every)
    return None


class _Ours:
    name = "ours"
    # ``-m`` puts the working directory first on sys.path: run the server from the
    # checkout this process imported, so both measure the same kvevents.
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(kvevents.__file__)))

    def __init__(self, meta: dict, truth_counts: dict[str, int]) -> None:
        self.last = {p: c["batches"] - 1 for p, c in meta["per_engine"].items()}
        self.truth = truth_counts

    def command(self, port: int, ports: dict[str, int], threads: int) -> list[str]:
        cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port)]
        for engine, p in sorted(ports.items()):
            cmd += ["--endpoint", f"{engine}=tcp://127.0.0.1:{p}"]
        return cmd

    def ready(self, port: int) -> bool:
        engines = json.loads(_http(port, "/v1/engines"))["engines"]
        return len(engines) == len(self.last) and all(p["connected"] for p in engines)

    def done(self, port: int) -> bool:
        engines = json.loads(_http(port, "/v1/engines"))["engines"]
        return all(p["last_seq"] == self.last[p["name"]]
                   and p["blocks"].get("GPU", 0) == self.truth[p["name"]] for p in engines)

    def report(self, port: int) -> dict:
        engines = json.loads(_http(port, "/v1/engines"))["engines"]
        return {"lost_batches": sum(p["lost_batches"] for p in engines),
                "malformed": sum(p["malformed"] for p in engines)}

    def lookup(self, port: int, tokens: list[int]) -> dict[str, int]:
        r = json.loads(_http(port, "/v1/lookup", {"token_ids": tokens}))
        return {p["engine"]: p["matched_tokens"] // BS for p in r["engines"] if p["matched_tokens"]}


class _Dynamo:
    name = "dynamo"
    cwd = None

    def __init__(self, meta: dict, truth_counts: dict[str, int]) -> None:
        self.events = meta["events"]
        self.engines = len(meta["per_engine"])

    def command(self, port: int, ports: dict[str, int], threads: int) -> list[str]:
        workers = ",".join(f"{worker_id(engine)}=tcp://127.0.0.1:{p}" for engine, p in sorted(ports.items()))
        return [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(BS),
                "--threads", str(threads), "--workers", workers]

    def ready(self, port: int) -> bool:
        ws = json.loads(_http(port, "/workers"))
        return len(ws) == self.engines and all(
            all(lst["status"] == "active" for lst in w["listeners"].values()) for w in ws)

    def _applied(self, port: int) -> dict[tuple[str, str], int]:
        text = _http(port, "/metrics").decode()
        return {(m[1], m[2]): int(m[3]) for m in _APPLIED.finditer(text)}

    def done(self, port: int) -> bool:
        return sum(self._applied(port).values()) >= self.events

    def report(self, port: int) -> dict:
        a = self._applied(port)
        return {"events_applied": sum(a.values()),
                "not_ok": {f"{t}/{s}": n for (t, s), n in a.items() if s != "ok" and n}}

    def lookup(self, port: int, tokens: list[int]) -> dict[str, int]:
        r = json.loads(_http(port, "/query", {"token_ids": tokens, "model_name": "default"}))
        return {engine_name(int(w)): max(d.values()) // BS for w, d in r["scores"].items() if max(d.values())}


def _until_done(side, port: int, t0: float, every: float, timeout: float) -> tuple[bool, float, float]:
    """Poll ``side.done`` every ``every`` s (each poll costs the consumer a little, so not
    too often). Completion happened between the start of the last poll that said "not
    yet" and the end of the first that said "done": returns (done, the midpoint of that
    interval from ``t0``, half its width)."""
    last_no = t0
    while True:
        start = time.perf_counter()
        try:
            done = side.done(port)
        except (OSError, ValueError):
            done = False
        end = time.perf_counter()
        if done:
            return True, ((last_no + end) / 2) - t0, (end - last_no) / 2
        if end - t0 > timeout:
            return False, end - t0, 0.0
        last_no = start
        time.sleep(every)


def run_side(side, a, paths: dict, meta: dict, groups: list[list[str]], check_prompts) -> dict:
    ready_q: mp.Queue = mp.Queue()
    go, stop = mp.Event(), mp.Event()
    procs = [mp.Process(target=_publisher, args=(paths["trace"], g, ready_q, go, stop), daemon=True)
             for g in groups]
    for p in procs:
        p.start()
    ports: dict[str, int] = {}
    for _ in procs:
        ports.update(ready_q.get(timeout=300))
    port = free_port()
    log = open(os.path.join(a.workdir, f"e2e-{side.name}.log"), "wb")
    server = subprocess.Popen(side.command(port, ports, a.dynamo_threads), stdout=log,
                              stderr=subprocess.STDOUT, cwd=side.cwd)
    out: dict = {"side": side.name}
    try:
        if not _wait(lambda: side.ready(port), 120):
            raise RuntimeError(f"{side.name} never became ready (see {log.name})")
        time.sleep(1.0)  # let the SUB subscriptions reach every publisher
        cpu0 = cpu_seconds(server.pid)
        pub0 = sum(cpu_seconds(p.pid) for p in procs)
        t0 = time.perf_counter()
        go.set()
        ok, elapsed, resolution = _until_done(side, port, t0, a.poll, a.timeout)
        # When the last publisher had sent its last message: what the consumer took
        # after it (a backlog applied alone, the publishers' CPU free) shows in the table.
        sent = [ready_q.get(timeout=60)[1] - t0 for _ in procs]
        out["publishers_done_s"] = round(max(sent), 3)
        # CPU the consumer spent (all its threads) until it was seen done: the cost per
        # event, which the shared 2-core machine's noise distorts less than wall time.
        out["consumer_cpu_s"] = round(cpu_seconds(server.pid) - cpu0, 3)
        # The publishers' share of the same 2 cores (the same for both sides): with it,
        # what the consumer's CPU can still win in wall time.
        out["publishers_cpu_s"] = round(sum(cpu_seconds(p.pid) for p in procs) - pub0, 3)
        out.update(side.report(port))
        out["completed"] = ok
        out["seconds"] = round(elapsed, 3)
        out["seconds_resolution"] = round(resolution, 3)
        out["block_events_per_s"] = round(meta["block_events"] / elapsed) if ok else 0
        wrong = 0
        for tokens, exp in check_prompts:
            wrong += side.lookup(port, tokens) != exp
        out["lookups_checked"] = len(check_prompts)
        out["lookups_wrong_vs_truth"] = wrong
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        log.close()
    print(f"  {side.name}: {out}", file=sys.stderr)
    return out


def inner(a) -> None:
    cfg = TraceConfig.from_args(a)
    paths = generate(cfg, a.workdir)
    with open(paths["meta"]) as f:
        meta = json.load(f)
    resident, prompts = load_truth(paths["truth"])
    truth_counts = {p: len(s) for p, s in resident.items()}
    check = []
    for n in sorted(prompts):
        for arr in prompts[n][:a.check_prompts]:
            check.append((arr.tolist(), expected_blocks(resident, arr)))
    engines = sorted(meta["per_engine"])
    groups = [engines[i::a.publishers] for i in range(a.publishers)]
    print(f"kvevents from {kvevents.__file__}; {cfg.engines} engines x {cfg.capacity:,}: "
          f"{meta['batches']:,} batches, {meta['events']:,} events, {meta['block_events']:,} block events",
          file=sys.stderr)
    sides = [s for s in (_Ours(meta, truth_counts), _Dynamo(meta, truth_counts))
             if s.name in a.sides.split(",")]
    runs = []
    for r in range(a.runs):
        row = {}
        for side in (sides if r % 2 == 0 else sides[::-1]):
            row[side.name] = run_side(side, a, paths, meta, groups, check)
        for name in ("ours", "dynamo"):  # a side left out shows as 0
            row.setdefault(name, {"block_events_per_s": 0, "lookups_wrong_vs_truth": None})
        row["ratio"] = (round(row["ours"]["block_events_per_s"] / row["dynamo"]["block_events_per_s"], 3)
                        if row["dynamo"]["block_events_per_s"] else None)
        runs.append(row)
    med = {s: median([r[s]["block_events_per_s"] for r in runs]) for s in ("ours", "dynamo")}
    ratio = round(med["ours"] / med["dynamo"], 3) if med["dynamo"] else None
    print(f"\n{cfg.engines} engines x {cfg.capacity:,} blocks, {a.publishers} publishers -> one consumer "
          f"(dynamo.indexer --threads {a.dynamo_threads})")
    print_table(["run", "ours block events/s", "dynamo block events/s", "ratio", "ours CPU s",
                 "dynamo CPU s", "publishers CPU s (ours/dynamo)",
                 "last publish / done s (ours; dynamo)", "ours wrong", "dynamo wrong",
                 "ours lost", "dynamo not ok"],
                [[i, f"{r['ours']['block_events_per_s']:,}", f"{r['dynamo']['block_events_per_s']:,}",
                  r["ratio"], r["ours"].get("consumer_cpu_s"), r["dynamo"].get("consumer_cpu_s"),
                  f"{r['ours'].get('publishers_cpu_s')}/{r['dynamo'].get('publishers_cpu_s')}",
                  f"{r['ours'].get('publishers_done_s')}/{r['ours'].get('seconds')}; "
                  f"{r['dynamo'].get('publishers_done_s')}/{r['dynamo'].get('seconds')}",
                  r["ours"]["lookups_wrong_vs_truth"], r["dynamo"]["lookups_wrong_vs_truth"],
                  r["ours"].get("lost_batches"), r["dynamo"].get("not_ok")] for i, r in enumerate(runs)])
    cpu = {s: median([r[s].get("consumer_cpu_s") or 0 for r in runs]) for s in ("ours", "dynamo")}
    print(f"median: ours {med['ours']:,.0f} vs dynamo {med['dynamo']:,.0f} block events/s ({ratio}x); "
          f"consumer CPU {cpu['ours']:.2f} s vs {cpu['dynamo']:.2f} s")
    write_json(a.json or f"benchmarks/results/dynamo-e2e-p{cfg.engines}-c{cfg.capacity}.json",
               {"benchmark": "P1 end to end over ZeroMQ vs dynamo.indexer", "machine": machine(),
                "kvevents": kvevents.__file__, "args": vars(a),
                "trace": meta | {"per_engine": None}, "median_block_events_per_s": med, "ratio": ratio,
                "median_consumer_cpu_s": cpu,
                "runs": runs})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(ap)
    ap.add_argument("--publishers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dynamo-threads", type=int, default=4,
                    help="dynamo.indexer --threads (its default, 4, was its faster setting here; "
                         "1 is its single-threaded KvIndexer)")
    ap.add_argument("--check-prompts", type=int, default=16, help="lookups checked per prompt length")
    ap.add_argument("--poll", type=float, default=0.05,
                    help="seconds between completion polls (10 ms polls slowed our server by ~20%%)")
    ap.add_argument("--sides", default="ours,dynamo", help="which consumers to run")
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed per consumer run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inner:
        inner(a)
        return
    # Generate (or reuse) the trace outside the namespace, then re-run inside it.
    generate(TraceConfig.from_args(a), a.workdir)
    sys.exit(rerun_in_loopback_netns(__file__, sys.argv[1:]))


if __name__ == "__main__":
    main()
