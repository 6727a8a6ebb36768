"""Arguments of ``kvevents demo`` and ``kvevents loadgen``, and their checks.

Standard library only: ``kvevents --help`` builds these parsers with the base install,
before anything that needs the ``demo`` extra (httpx, torch) is imported. The checks
return one line per problem (the CLI prints them and exits 2) instead of raising deep
inside the run.
"""

from __future__ import annotations

import argparse
import re

from kvevents.defaults import DEFAULT_PORT

POLICIES = ["kv", "round_robin", "least_loaded"]  # the router loop's (demo and loadgen)
# The demo's: "gateway" sends OpenAI requests through the aggregator's gateway, which
# routes them (simulated engines only); the others route in the demo, over engine RPC.
DEMO_POLICIES = ["gateway", *POLICIES]


ENGINES = ["sim", "vllm"]
# Defaults that differ with --engine: the simulated engine, then a real vLLM CPU engine
# (a tiny model: small prompts, few requests, a few dozen 32-token blocks).
ENGINE_DEFAULTS = {
    "sim": {"requests": 240, "cpu_blocks": 4096, "offloaded_block_size": 64, "policy": "gateway"},
    # No gateway in front of in-process vLLM engines yet (they take requests over RPC
    # only); it comes with a `vllm serve` fleet.
    "vllm": {"requests": 40, "cpu_blocks": 256, "offloaded_block_size": 32, "gpu_blocks": 20,
             "policy": "kv"},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=4, help="engine processes to start (>= 1)")
    p.add_argument("--engine", choices=ENGINES, default="sim",
                   help="sim: the simulated paged-KV engine (default); vllm: real vLLM CPU engines "
                        "with our connector, a tiny local model (needs the vllm extra; slow to start)")
    p.add_argument("--duration", type=float, default=40.0,
                   help="wall-clock seconds over which the workload's arrivals are spread")
    p.add_argument("--policy", choices=DEMO_POLICIES, default=None,
                   help="gateway (default with --engine sim): send each request as an OpenAI "
                        "client to the aggregator's gateway (POST /v1/completions), which routes "
                        "it; kv (default with --engine vllm): the demo routes through the "
                        "aggregator's /v1/route and submits over engine RPC; round_robin, "
                        "least_loaded: the demo routes locally, over engine RPC")
    p.add_argument("--clients", type=int, default=64,
                   help="with --policy gateway: OpenAI requests in flight at most")
    p.add_argument("--no-cpu-tier", action="store_true", help="engines without the CPU tier")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="aggregator HTTP port (live page at /)")
    p.add_argument("--summary-json", default=None, metavar="PATH",
                   help="write the summary here (default: not written)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in workload")
    p.add_argument("--requests", type=int, default=None,
                   help="built-in workload size (default 240; 40 with --engine vllm)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="replay a Mooncake-format JSONL trace (default: the built-in workload)")
    p.add_argument("--max-requests", type=int, default=300, help="with --trace: first N requests")
    p.add_argument("--time-scale", type=float, default=None,
                   help="with --trace: simulated seconds per wall second (default: fit --duration)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="GPU KV blocks per engine, 16 tokens each (default 1024, small enough that "
                        "the CPU tier matters; 8192 with --trace, to fit its longest prompt; "
                        "with --engine vllm: 20 blocks of 32 tokens, so prefixes move to the CPU tier)")
    p.add_argument("--cpu-blocks", type=int, default=None,
                   help="CPU tier offloaded blocks per engine (default 4096; with --engine vllm: "
                        "256 engine blocks)")
    p.add_argument("--offloaded-block-size", type=int, default=None,
                   help="tokens per offloaded block (default 64; 32 with --engine vllm)")
    p.add_argument("--prometheus-targets", default=None, metavar="PATH",
                   help="write a Prometheus file_sd JSON of the aggregator's and engines' "
                        "/metrics, to point a Prometheus at the running demo (default: not written)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("--log-dir", default=None, help="child process logs (default: a temp dir)")


def _positive(args: argparse.Namespace, names: list[str]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            out.append(f"{flag} {value:g}: must be > 0, e.g. {flag} 1")
    return out


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fills the defaults that depend on ``--engine`` (those left at None)."""
    for name, value in ENGINE_DEFAULTS[getattr(args, "engine", "sim")].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def check_arguments(args: argparse.Namespace) -> list[str]:
    """Problems with ``kvevents demo``'s arguments, one line each (empty: fine).

    Fills the ``--engine``-dependent defaults first."""
    resolve_defaults(args)
    out = _positive(args, ["engines", "duration", "requests", "max_requests", "time_scale",
                           "gpu_blocks", "offloaded_block_size", "clients"])
    if args.cpu_blocks < 0:
        out.append(f"--cpu-blocks {args.cpu_blocks}: must be >= 0 (0: no CPU tier)")
    if not 0 < args.port < 65536:
        out.append(f"--port {args.port}: must be 1-65535")
    if args.engine == "vllm":
        if args.policy == "gateway":
            out.append("--policy gateway: not with --engine vllm yet (its in-process engines "
                       "take requests over RPC only); use --policy kv, round_robin or least_loaded")
        if args.trace:
            out.append("--trace: not with --engine vllm (its tiny model takes 512-token prompts; "
                       "the built-in workload is scaled to it)")
        if args.offloaded_block_size % 32:
            out.append(f"--offloaded-block-size {args.offloaded_block_size}: with --engine vllm, "
                       "a multiple of the engine's 32-token blocks")
        if args.no_cpu_tier or args.cpu_blocks == 0:
            out.append("--engine vllm runs our connector: its CPU tier cannot be off")
    return out


_ENGINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._:-]{0,127})=(?P<endpoint>tcp://[^\s,]+:\d+)$")


def add_loadgen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--aggregator", default=f"http://127.0.0.1:{DEFAULT_PORT}", metavar="URL",
                   help="the aggregator's base URL (its /v1/route picks the engine)")
    p.add_argument("--engine", action="append", required=True, metavar="NAME=tcp://HOST:PORT",
                   help="an engine's request (RPC) endpoint, named as the aggregator knows it "
                        "(repeatable)")
    p.add_argument("--policy", choices=POLICIES, default="kv", help="how each request is routed")
    p.add_argument("--requests", type=int, default=120, help="requests per round")
    p.add_argument("--duration", type=float, default=60.0,
                   help="wall-clock seconds over which one round's arrivals are spread")
    p.add_argument("--rounds", type=int, default=0, help="rounds to run; 0 runs until stopped")
    p.add_argument("--seed", type=int, default=0, help="seed of the first round's workload")
    p.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for the aggregator and the engines to answer")


def check_loadgen_arguments(args: argparse.Namespace) -> list[str]:
    """Problems with ``kvevents loadgen``'s arguments, one line each (empty: fine)."""
    out = _positive(args, ["requests", "duration", "ready_timeout"])
    if args.rounds < 0:
        out.append(f"--rounds {args.rounds}: must be >= 0 (0: until stopped)")
    if not re.match(r"^https?://[^/\s]+", args.aggregator):
        out.append(f"--aggregator {args.aggregator!r}: expected http://HOST:PORT")
    names = []
    for spec in args.engine:
        m = _ENGINE.match(spec)
        if m is None:
            out.append(f"--engine {spec!r}: expected NAME=tcp://HOST:PORT, e.g. engine-0=tcp://engine-0:5560")
        else:
            names.append(m.group("name"))
    if len(names) != len(set(names)):
        out.append(f"--engine: names must be unique, got {names}")
    return out


def parse_engine(spec: str) -> tuple[str, str]:
    """``NAME=tcp://HOST:PORT`` -> (name, endpoint); checked by :func:`check_loadgen_arguments`."""
    m = _ENGINE.match(spec)
    if m is None:
        raise ValueError(f"expected NAME=tcp://HOST:PORT, got {spec!r}")
    return m.group("name"), m.group("endpoint")
