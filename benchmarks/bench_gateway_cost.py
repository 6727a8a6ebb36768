"""What the gateway costs per request, with 1 and with N workers, beside vllm-router:
``kvevents serve`` and ``vllm-router`` between a fast load generator and fast fake OpenAI
engines (benchmarks/fake_openai.py).

Two fake engines (one process each: raw asyncio + httptools on uvloop; vLLM-shaped SSE,
``--chunks`` chunks of 3 tokens, ``/metrics`` gauges, a ZeroMQ publisher with replay
that publishes nothing, so the index stays empty and every decision is by load;
``POST /v1/chat/completions/render`` answered as vLLM 0.32 does,
the chat tokenized with the same tokenizer) and, per side and round, a fresh router in
its own session: ``kvevents serve --workers W`` (``--tokenizer`` the demo's tiny
tokenizer: every chat is rendered and tokenized), or vllm-router 0.1.17 (the ``bench``
extra, started as bench_gateway.py starts it) with each policy of ``--vllm-router``:
``round_robin``, and ``cache_aware``, which asks an engine's render endpoint for every
chat's token ids before it routes (a run in which vllm-router counts a render it could
not use, ``vllm_router_kv_routing_inputs_total{result!="render"}``, fails). Workload:
``--prompts`` chat bodies, one of 8 shared system prompts (~360 tokens) and a unique
user turn (~280 tokens), streamed with ``stream_options.include_usage``. Phases, in
this order, on the same server, after 200 requests of warm-up:

* ``idle``: ``--idle-s`` seconds without requests: the server's
  CPU in cores (engine polls, health checks, readiness, ingest loops);
* ``cost``: ``--requests`` streamed chats at 16 in flight, the engines pacing one chunk
  per 2 ms (decode steps): the server's CPU per request, as utime + stime of every
  process of its session (supervisor and workers, every thread; vllm-router's launcher
  and its Rust threads) from ``/proc``;
* ``rate``: ``--requests`` streamed chats at ``--concurrency`` (32) in flight, engines
  not pacing: requests/s (on a 2-core box the load generator and the engines share the
  cores with the server: the figure is the box's, said with the load generator's and
  the engines' own CPU, and the cores the server kept busy: about 1.0 with one worker
  means that worker was the limit);
* ``added``: ``--latency-requests`` one-chunk non-streamed chats, one at a time, each
  sent through the server and straight to an engine by one probe process (which goes
  first alternates), after a few untimed: p50/p99 of each, and the differences; twice:
  ``added_new``, every chat new (one of the 8 system prompts and a user turn not seen
  before, as in the other phases), and ``added``, the same 50 chats again and again, all
  sent once before the timing starts (a conversation the gateway has seen: retries,
  regenerations).

``--kv-events`` measures what the engines' events cost: the engines tokenize every chat
and hash its blocks (a prefix-caching engine's work whether or not it publishes), and a
second pair of engines does the same and publishes the blocks (``BlockStored``, and
``BlockRemoved`` past its capacity), so the index fills and every worker's ingest runs;
each of our sides runs against both pairs (``ours, W worker(s), KV events``: the
publishing pair; a run whose server applied no block event fails), vllm-router against
the quiet pair, and the ratio of our CPU per request with events to without is
reported.

Every answer is checked byte for byte against what the engine sent (mismatches are
reported, and fail the run). Sides alternate in rotating order over ``--rounds``;
medians [min-max] are reported.

The engines' CPU (render included) and the load generator's are reported per request
beside the server's, and the ratios of our CPU per request to each vllm-router policy's.

    .venv/bin/pip install -e '.[bench]'   # vllm-router==0.1.17
    .venv/bin/python benchmarks/bench_gateway_cost.py [--workers 1,2] \
        [--vllm-router round_robin,cache_aware] [--rounds 3] [--requests 2000]

``--vllm-router none`` compares our gateway with itself only (no vllm-router needed);
``--other-root CHECKOUT`` adds another checkout's ``kvevents serve`` (one worker) as a side
of the same run (before and after a change, on the same engines and rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from common import machine, median, percentile, print_table, write_json  # noqa: E402
from kvevents.demo.fleet import free_port  # noqa: E402

FAKE = str(HERE / "fake_openai.py")


def session_cpu(sid: int) -> float:
    """utime + stime of every live process of session ``sid`` (all threads)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def pid_cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bodies(path: Path, tokenizer_dir: Path, n: int, seed: int, step_ms: float,
           stream: bool, chunks: int) -> int:
    """``n`` chat bodies, one a line: one of 8 shared system prompts, a unique user turn.
    Returns the first prompt's token count."""
    from kvevents.text import TextTokenizer

    tok = TextTokenizer("m", tokenizer_dir)
    rng = random.Random(seed)
    vocab = [w for w in open(ROOT / "README.md").read().split() if w.isalpha()]
    systems = [" ".join(rng.choice(vocab) for _ in range(115)) for _ in range(8)]
    lines = []
    for i in range(n):
        user = f"request {i}: " + " ".join(rng.choice(vocab) for _ in range(85))
        doc = {"model": "m", "messages": [{"role": "system", "content": systems[i % 8]},
                                          {"role": "user", "content": user}],
               "max_tokens": chunks * 3, "stream": stream}
        if stream:
            doc["stream_options"] = {"include_usage": True}
        if step_ms:
            doc["bench_step_ms"] = step_ms
        lines.append(json.dumps(doc, separators=(",", ":")))
    path.write_text("\n".join(lines) + "\n")
    from kvevents.text.chat import ChatMessage
    first = json.loads(lines[0])["messages"]
    return len(tok.encode_chat([ChatMessage(**m) for m in first]))


def load(port: int, body_file: Path, requests: int, concurrency: int, chunks: int) -> dict:
    out = subprocess.run([sys.executable, FAKE, "load", "--port", str(port), "--bodies",
                          str(body_file), "--requests", str(requests), "--concurrency",
                          str(concurrency), "--chunks", str(chunks)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout)


def start_server(workers: int, engines: list[dict], tok_dir: Path, log: Path, root: Path = ROOT) -> tuple:
    port = free_port()
    args = [sys.executable, "-m", "kvevents.cli", "serve", "--port", str(port), "--workers",
            str(workers), "--tokenizer", f"m={tok_dir}", "--log-level", "warning"]
    for i, e in enumerate(engines):
        args += ["--endpoint", f"e{i}=tcp://127.0.0.1:{e['zmq']},replay=tcp://127.0.0.1:{e['replay']},"
                               f"model=m,http=http://127.0.0.1:{e['port']}"]
    proc = subprocess.Popen(args, cwd=root, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with httpx.Client(timeout=2) as c:
                if c.get(url + "/readyz").status_code == 200:
                    return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"kvevents serve did not become ready; see {log}")


def vllm_router_exe() -> str:
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if exe is None:
        raise SystemExit("vllm-router is not installed: .venv/bin/pip install -e '.[bench]' "
                         "(vllm-router==0.1.17), or pass --vllm-router none")
    return exe


def start_vllm_router(policy: str, engines: list[dict], log: Path) -> tuple:
    """A fresh vllm-router with ``policy`` in its own session, the flags bench_gateway.py
    gives it; returns (process, port, metrics port) once ``/health`` and ``/v1/models``
    answer."""
    port, metrics_port = free_port(), free_port()
    cmd = [vllm_router_exe(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
           *[f"http://127.0.0.1:{e['port']}" for e in engines], "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--worker-startup-check-interval", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router {policy} exited (rc={proc.returncode}); see {log}")
        try:
            with httpx.Client(timeout=2) as c:
                if c.get(url + "/health").status_code == 200 and c.get(url + "/v1/models").status_code == 200:
                    return proc, port, metrics_port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"vllm-router {policy} did not become ready; see {log}")


def kv_inputs(metrics_port: int) -> dict[str, float]:
    """vllm-router's ``vllm_router_kv_routing_inputs_total`` by result (render, render_unavailable...)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^vllm_router_kv_routing_inputs_total\{[^}]*result="([^"]+)"[^}]*\} (\S+)$',
                         text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def block_events_applied(port: int) -> float:
    """Our server's ``kvevents_block_events_applied_total`` (every worker's, summed)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(
        r"^kvevents_block_events_applied_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the router's whole session (vllm-router's launcher and its children too)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_side(side: str, engines: list[dict], files: dict, tok_dir: Path, log: Path,
             args: argparse.Namespace) -> dict:
    """One fresh router (``ours:W``, ``ours+kv:W``, ``other:W``: ``--other-root``'s
    ``kvevents serve``, or ``vllm-router:POLICY``) through every phase, against ``engines``."""
    kind, arg = side.split(":")
    metrics_port = None
    if kind == "other":
        proc, port = start_server(int(arg), engines, tok_dir, log, Path(args.other_root))
    elif kind.startswith("ours"):
        proc, port = start_server(int(arg), engines, tok_dir, log)
    else:
        proc, port, metrics_port = start_vllm_router(arg, engines, log)
    try:
        load(port, files["cost"], 200, 16, args.chunks)  # warm-up: connections, caches
        cpu0 = session_cpu(proc.pid)
        time.sleep(args.idle_s)
        out: dict = {"side": side,
                     "idle_cores": (session_cpu(proc.pid) - cpu0) / args.idle_s}
        for phase, conc in (("cost", 16), ("rate", args.concurrency)):
            eng0 = [pid_cpu(e["proc"].pid) for e in engines]
            cpu0 = session_cpu(proc.pid)
            got = load(port, files[phase], args.requests, conc, args.chunks)
            cpu = session_cpu(proc.pid) - cpu0
            if got["mismatches"]:
                raise RuntimeError(f"{phase}: {got['mismatches']} answers differ from the engine's")
            out[phase] = {"server_cpu_ms_per_request": cpu / args.requests * 1e3,
                          "requests_per_s": args.requests / got["wall_s"],
                          "loadgen_cpu_ms_per_request": got["cpu_s"] / args.requests * 1e3,
                          "engines_cpu_ms_per_request": sum(
                              pid_cpu(e["proc"].pid) - c for e, c in zip(engines, eng0)) / args.requests * 1e3,
                          "latency_p50_ms": median(got["latencies"]) * 1e3}
        out["added_new"] = added_latency(port, engines[0]["port"], *files["added_new"])
        out["added"] = added_latency(port, engines[0]["port"], *files["added"])
        if kind == "ours+kv":
            # The engines' events reached the index (a run where they did not is not one
            # with KV events flowing).
            out["block_events_applied"] = block_events_applied(port)
            if out["block_events_applied"] <= 0:
                raise RuntimeError("--kv-events: the server applied no block events")
        if metrics_port is not None:
            inputs = kv_inputs(metrics_port)
            out["vllm_router_kv_routing_inputs"] = inputs
            if arg == "cache_aware" and (set(inputs) - {"render"} or
                                         inputs.get("render", 0) < 2 * args.requests):
                raise RuntimeError(f"cache_aware did not tokenize every chat through the "
                                   f"engines' render endpoint: {inputs}")
        return out
    finally:
        stop(proc)


def added_latency(port: int, engine_port: int, body_file: Path, warmup: int) -> dict:
    """Non-streamed chats one at a time, each through the server and straight to the
    engine (one probe process; see ``fake_openai.py probe``), after ``warmup`` untimed."""
    out = subprocess.run([sys.executable, FAKE, "probe", "--port", str(port), "--direct-port",
                          str(engine_port), "--bodies", str(body_file), "--warmup", str(warmup),
                          "--chunks", "1"], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    got = json.loads(out.stdout)
    if got["mismatches"]:
        raise RuntimeError(f"added latency: {got['mismatches']} answers differ from the engine's")
    via, direct = got["via"], got["direct"]
    return {"via_p50_ms": median(via) * 1e3, "via_p99_ms": percentile(via, 99) * 1e3,
            "direct_p50_ms": median(direct) * 1e3, "direct_p99_ms": percentile(direct, 99) * 1e3,
            "added_p50_ms": (median(via) - median(direct)) * 1e3,
            "added_p99_ms": (percentile(via, 99) - percentile(direct, 99)) * 1e3}


#: Chats sent through the server and to the engine before the timed ones: the probe
#: process's own first requests (its connections, its cold caches) are not the server's.
LATENCY_WARMUP = 10


def latency_files(tmp: Path, tok_dir: Path, requests: int) -> dict[str, tuple[Path, int]]:
    """Body files of one-chunk chats and their untimed lead-in: ``added_new``,
    ``requests`` chats none of which the server has seen (after LATENCY_WARMUP others);
    ``added``, 50 chats sent once untimed, then again and again (a conversation the
    server has seen: a retry, a regeneration)."""
    every = tmp / "added_all.jsonl"
    bodies(every, tok_dir, 50 + LATENCY_WARMUP + requests, 3, 0.0, False, 1)
    lines = every.read_text().splitlines()
    seen, new = tmp / "added_seen.jsonl", tmp / "added_new.jsonl"
    seen.write_text("\n".join(lines[:50] * (1 + -(-requests // 50))) + "\n")
    new.write_text("\n".join(lines[50:]) + "\n")
    return {"added": (seen, 50), "added_new": (new, LATENCY_WARMUP)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2", help="worker counts to compare, comma-separated")
    ap.add_argument("--vllm-router", default="round_robin,cache_aware",
                    help="vllm-router policies beside ours, comma-separated ('none': ours only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--latency-requests", type=int, default=1000)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measured")
    ap.add_argument("--kv-events", action="store_true",
                    help="ours also against engines that publish each prompt's blocks (the "
                         "index fills, ingest runs), beside the same engines not publishing")
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--other-root", default="", metavar="CHECKOUT",
                    help="also run another checkout's kvevents serve (one worker) as a side of "
                         "the same run: a before/after comparison on the same engines and rounds")
    ap.add_argument("--out", default="benchmarks/results/gateway_cost.json")
    args = ap.parse_args()
    sides = [f"ours:{int(w)}" for w in args.workers.split(",")]
    if args.kv_events:
        sides = [x for w in args.workers.split(",") for x in (f"ours:{int(w)}", f"ours+kv:{int(w)}")]
    policies = [p for p in args.vllm_router.split(",") if p and p != "none"]
    unknown = set(policies) - {"round_robin", "cache_aware", "random", "power_of_two"}
    if unknown:
        raise SystemExit(f"--vllm-router: unknown policies {sorted(unknown)}")
    if policies:
        vllm_router_exe()
    if args.other_root:
        sides.append("other:1")
    sides += [f"vllm-router:{p}" for p in policies]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from kvevents.demo.tiny_model import make_tiny_tokenizer
        tok_dir = make_tiny_tokenizer(tmp / "tok")
        files: dict = {"cost": tmp / "cost.jsonl", "rate": tmp / "rate.jsonl"}
        tokens = bodies(files["cost"], tok_dir, args.prompts, 1, 2.0, True, args.chunks)
        bodies(files["rate"], tok_dir, args.prompts, 2, 0.0, True, args.chunks)
        files.update(latency_files(tmp, tok_dir, args.latency_requests))
        # With --kv-events two pairs of engines do the same work (each chat tokenized and
        # its blocks hashed, as a prefix-caching engine does either way); one publishes
        # the blocks, the other nothing: the sides differ only in events flowing.
        pairs = {"quiet": ["--no-publish", "--tokenizer"] if args.kv_events else ["--render-tokenizer"]}
        if args.kv_events:
            pairs["kv"] = ["--tokenizer"]
        by_pair: dict[str, list[dict]] = {}
        for pair, flags in pairs.items():
            by_pair[pair] = []
            for _ in range(2):
                e = {"port": free_port(), "zmq": free_port(), "replay": free_port()}
                e["proc"] = subprocess.Popen(
                    [sys.executable, FAKE, "engine", "--port", str(e["port"]), "--zmq-port", str(e["zmq"]),
                     "--replay-port", str(e["replay"]), "--chunks", str(args.chunks), *flags, str(tok_dir)],
                    cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
                assert e["proc"].stdout.readline().strip() == "ready"
                by_pair[pair].append(e)
        engines = [e for pair in by_pair.values() for e in pair]
        results: dict[str, list[dict]] = {s: [] for s in sides}
        try:
            for r in range(args.rounds):
                order = sides[r % len(sides):] + sides[:r % len(sides)]
                for side in order:
                    pair = by_pair["kv" if side.startswith("ours+kv:") else "quiet"]
                    got = run_side(side, pair, files, tok_dir, tmp / "serve.log", args)
                    results[side].append(got)
                    print(f"round {r + 1}, {label(side)}: {got['rate']['requests_per_s']:.0f} req/s, "
                          f"{got['cost']['server_cpu_ms_per_request']:.2f} ms CPU/request", flush=True)
        finally:
            for e in engines:
                e["proc"].terminate()
                e["proc"].wait(10)
    report(args, sides, results, tokens)


def label(side: str) -> str:
    kind, arg = side.split(":")
    if kind == "ours+kv":
        return f"ours, {arg} worker(s), KV events"
    if kind == "other":
        return f"ours at --other-root, {arg} worker(s)"
    return f"ours, {arg} worker(s)" if kind == "ours" else f"vllm-router {arg}"


def _mr(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def report(args: argparse.Namespace, sides: list[str], results: dict, tokens: int) -> None:
    rows = []
    for side in sides:
        rs = results[side]
        rows.append([label(side),
                     _mr([x["cost"]["server_cpu_ms_per_request"] for x in rs]),
                     _mr([x["rate"]["requests_per_s"] for x in rs], "{:.0f}"),
                     _mr([x["rate"]["server_cpu_ms_per_request"] for x in rs]),
                     _mr([x["rate"]["server_cpu_ms_per_request"] * x["rate"]["requests_per_s"] / 1e3
                          for x in rs]),
                     _mr([x["added_new"]["added_p50_ms"] for x in rs]),
                     _mr([x["added_new"]["added_p99_ms"] for x in rs]),
                     _mr([x["added"]["added_p50_ms"] for x in rs]),
                     _mr([x["added"]["added_p99_ms"] for x in rs]),
                     _mr([x["rate"]["loadgen_cpu_ms_per_request"] for x in rs]),
                     _mr([x["rate"]["engines_cpu_ms_per_request"] for x in rs]),
                     _mr([x["idle_cores"] for x in rs], "{:.3f}")])
    engines = ("engines tokenizing and hashing every prompt, publishing its blocks only for the "
               "KV-events rows" if args.kv_events else "engines not publishing KV events")
    print(f"\n{args.requests} streamed chats of ~{tokens} prompt tokens, {args.chunks} chunks each, "
          f"{engines}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; medians [ranges] of "
          f"{args.rounds} rounds")
    print_table(["server", "CPU ms/req (16 in flight, paced)", f"req/s ({args.concurrency} in flight)",
                 "CPU ms/req (rate)", "server cores busy (rate)", "added p50 ms (new)", "added p99 ms (new)",
                 "added p50 ms (seen)", "added p99 ms (seen)", "loadgen CPU ms/req",
                 "engines CPU ms/req", "idle cores"], rows)
    ratios = {}
    for kv in (s for s in sides if s.startswith("ours+kv:")):
        quiet = kv.replace("ours+kv:", "ours:")
        for phase in ("cost", "rate"):
            ratios[f"{kv}/{quiet}/{phase}"] = (
                median([x[phase]["server_cpu_ms_per_request"] for x in results[kv]])
                / median([x[phase]["server_cpu_ms_per_request"] for x in results[quiet]]))
        print(f"CPU per request, {label(kv)} / without: {ratios[f'{kv}/{quiet}/cost']:.2f} (paced), "
              f"{ratios[f'{kv}/{quiet}/rate']:.2f} (rate)")
    for ours in (s for s in sides if s.startswith(("ours:", "other:"))):
        for peer in (s for s in sides if s.startswith("vllm-router:")):
            for phase in ("cost", "rate"):
                key = f"{ours}/{peer}/{phase}"
                ratios[key] = (median([x[phase]["server_cpu_ms_per_request"] for x in results[ours]])
                               / median([x[phase]["server_cpu_ms_per_request"] for x in results[peer]]))
            print(f"CPU per request, {label(ours)} / {label(peer)}: "
                  f"{ratios[f'{ours}/{peer}/cost']:.2f} (paced), {ratios[f'{ours}/{peer}/rate']:.2f} (rate)")
    write_json(args.out, {"machine": machine(), "command": " ".join(sys.argv),
                          "kv_events": args.kv_events,
                          "load_average": os.getloadavg(), "prompt_tokens": tokens,
                          "cpu_per_request_ratios": ratios,
                          "results": {s: results[s] for s in sides}})


if __name__ == "__main__":
    main()
