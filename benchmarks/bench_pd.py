"""Prefill/decode disaggregation: the gateway against vllm-router 0.1.17's PD mode, on
real vLLM engines on CPU, with an aggregated fleet of the same engines as the baseline.

Four stock vLLM 0.32 CPU OpenAI servers (:mod:`kvevents.demo.vllm_server`, the tiny
model and its locally trained tokenizer, block size 32, ``--blocks`` KV blocks each,
``--enable-scale-out`` for vllm-router's ``cache_aware``, KV events on wildcard endpoints:
the benchmark re-runs itself inside ``unshare -n``), engine ``i`` pinned to core ``i``
modulo the cores there are. For the disaggregated runs, ``e0`` and ``e1`` are prefill
engines and ``e2`` and ``e3`` decode engines, with vLLM's ``ExampleConnector`` over one
shared folder (:mod:`kvevents.demo.pd_engines`: ``kv_producer`` / ``kv_consumer``), in
the variant whose folders appear whole (:mod:`connector.shared_folder`: under
concurrency the stock one lets a decode engine read a folder a prefill engine is still
writing, and the decode engine dies), emptied before every run with the engines' prefix
caches. Per round, in a rotating order:

* ``ours_pd``: ``kvevents serve`` with ``role=prefill`` / ``role=decode`` endpoints
  (its defaults: the prefill hop skipped when the decode engine holds 90% of the prompt
  or lacks fewer than 256 tokens of it);
* ``ours_pd_always``: another ``kvevents serve`` that never skips the prefill hop
  (``--pd-skip-uncached-tokens 0 --pd-skip-cached-share 1``), as vllm-router never does;
* ``vllm_router_pd``: ``vllm-router --vllm-pd-disaggregation --prefill e0 --prefill e1
  --decode e2 --decode e3 --policy cache_aware`` (a fresh process per run).

Then the four engines are restarted without the transfer connector and ``ours_agg``
(``kvevents serve``, every engine ``role=both``) runs the same workload ``--rounds``
times: the aggregated baseline.

The workload is ``bench_gateway.py``'s chats (:mod:`chat_workloads`: shared system
prompts, growing conversations, long documents revisited), streamed through the
official ``openai`` client, ``--concurrency`` at a time. Per run: prefill-side hit
tokens (the prefill engines' ``vllm:prefix_cache_hits_total``; every engine's for the
aggregated fleet), the decode engines' own hits and the tokens they loaded from the
prefill side (``vllm:external_prefix_cache_hits_total``), prompt tokens computed over
the fleet (prompt tokens less local and loaded hits), TTFT p50/p90 (client side, to the
first streamed chunk with a choice), completed and failed requests, and ours' decisions
(``kvevents_gateway_pd_decisions_total``).

    .venv/bin/python benchmarks/bench_pd.py --rounds 2 --requests 125
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench_gateway import (MAX_MODEL_LEN, MODEL, Ours, VllmRouter, _tail, engine_busy,  # noqa: E402
                           metric_sum, run_workload, wait_until)
from chat_workloads import build_workload, endless_cache_hits  # noqa: E402
from common import machine, main_in_loopback_netns, median, percentile, print_table, write_json  # noqa: E402

from kvevents.demo.vllm_server import VllmFleet  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROLES = ["prefill", "prefill", "decode", "decode"]
SETUPS = ("ours_pd", "ours_pd_always", "vllm_router_pd")
#: ours_pd_always: every request takes both hops, as vllm-router's do (no skip)
ALWAYS = ["--pd-skip-uncached-tokens", "0", "--pd-skip-cached-share", "1"]
COUNTERS = {"hits": "vllm:prefix_cache_hits_total", "external": "vllm:external_prefix_cache_hits_total",
            "prompt_tokens": "vllm:prompt_tokens_total", "success": "vllm:request_success_total"}


class Fleet(VllmFleet):
    """Four vLLM servers, P/D (``folder`` the shared KV folder) or aggregated (None),
    their logs in ``log_dir``."""

    def __init__(self, model_dir: Path, events: list[tuple[int, int]], log_dir: Path, blocks: int,
                 folder: Path | None) -> None:
        from kvevents.demo.pd_engines import transfer_args

        log_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(model_dir, [(f"tcp://*:{live}", f"tcp://*:{replay}") for live, replay in events],
                         log_dir=log_dir, served_model_name=MODEL, num_gpu_blocks=blocks,
                         max_model_len=MAX_MODEL_LEN, env=dict(os.environ, PYTHONHASHSEED="0"),
                         extra_args=["--enable-scale-out"])
        for server, role in zip(self.servers, ROLES):
            if folder is not None:
                server.extra_args += transfer_args(role, folder, atomic=True)
        self.folder = folder

    def reset(self, ours: list[Ours]) -> None:
        """Empty caches: the engines' prefix caches (published as AllBlocksCleared, which
        vLLM 0.32 sends at its next step: one short request each), the shared folder."""
        urls = [s.url for s in self.servers]
        for u in urls:
            wait_until(lambda u=u: engine_busy(u) == 0, 120, what=f"engine {u} to be idle")
        for s in self.servers:
            wait_until(s.reset_prefix_cache, 30, interval=0.2, what=f"engine {s.url} to reset")
        for u in urls:
            httpx.post(u + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir()
        for o in ours:  # (two gateways follow four busy engines: more than bench_gateway's 30 s)
            o.wait_index_empty(90)

    def counters(self) -> list[dict[str, float]]:
        out = []
        for s in self.servers:
            text = httpx.get(s.url + "/metrics", timeout=10).text
            out.append({k: metric_sum(text, name) for k, name in COUNTERS.items()})
        return out


class VllmRouterPD(VllmRouter):
    """A fresh ``vllm-router`` in vLLM's PD mode over the fleet's two pools."""

    def __init__(self, fleet: Fleet, run_dir: Path, tag: str, policy: str) -> None:
        super().__init__(policy, fleet, [], run_dir, f"pd-{tag}")
        pools = [x for s, role in zip(fleet.servers, ROLES) for x in (f"--{role}", s.url)]
        at = self.cmd.index("--worker-urls")
        self.cmd[at:at + 1 + len(fleet.servers)] = ["--vllm-pd-disaggregation", *pools]


def one_run(setup: str, rnd: int, fleet: Fleet, ours: dict[str, Ours], reqs, a, run_dir: Path) -> dict:
    row: dict = {"round": rnd, "setup": setup, "requests": len(reqs)}
    vr, mine = None, ours.get(setup)
    try:
        fleet.reset(list(ours.values()))
        if mine is not None:
            base, gw_before = mine.url, mine.metrics()
        else:
            vr = VllmRouterPD(fleet, run_dir, f"r{rnd}", a.router_policy)
            vr.start()
            base = vr.url
        before = fleet.counters()
        t0 = time.perf_counter()
        outcomes = asyncio.run(run_workload(base, reqs, a.concurrency, a.request_timeout))
        row["wall_s"] = time.perf_counter() - t0
        for s in fleet.servers:
            wait_until(lambda u=s.url: engine_busy(u) == 0, 60, what=f"engine {s.url} to finish")
        time.sleep(0.5)
        delta = [{k: b[k] - x[k] for k in b} for x, b in zip(before, fleet.counters())]
        ok = [o for o in outcomes if o.failed is None]
        failures: dict[str, int] = {}
        for o in outcomes:
            if o.failed:
                failures[o.failed] = failures.get(o.failed, 0) + 1
        prefill = [d for d, role in zip(delta, ROLES) if role == "prefill" or setup == "ours_agg"]
        decode = [d for d, role in zip(delta, ROLES) if role == "decode" and setup != "ours_agg"]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        row.update({
            "completed": len(ok), "failures": sum(failures.values()), "failure_reasons": failures,
            "prefill_hit_tokens": int(sum(d["hits"] for d in prefill)),
            "decode_hit_tokens": int(sum(d["hits"] for d in decode)),
            "loaded_tokens": int(sum(d["external"] for d in delta)),
            "computed_tokens": int(sum(d["prompt_tokens"] - d["hits"] - d["external"] for d in delta)),
            "engine_requests": [int(d["success"]) for d in delta],
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        })
        if mine is not None:
            text = mine.metrics()
            row["decisions"] = {r: int(metric_sum(text, "kvevents_gateway_pd_decisions_total", reason=r)
                                       - metric_sum(gw_before, "kvevents_gateway_pd_decisions_total", reason=r))
                                for r in ("disaggregated", "decode_cached", "short_uncached", "no_prefill",
                                          "prefill_failed")}
        if row["failures"]:
            row["invalid"] = f"{row['failures']} failed requests"
    except Exception as exc:  # noqa: BLE001 (a router that does not work is reported, not fatal)
        row["error"] = f"{type(exc).__name__}: {exc}"
        if vr is not None:
            row["error"] += "\n" + _tail(vr.log, 1500)
    finally:
        if vr is not None:
            vr.stop()
    return row


HEADERS = ["round", "setup", "completed", "prefill-side hits", "decode hits", "loaded", "computed",
           "TTFT p50 ms", "TTFT p90 ms", "requests per engine", "decisions"]


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _row(r: dict) -> list:
    if "error" in r:
        return [r["round"], r["setup"], "error", r["error"].splitlines()[0][:60], *[""] * 7]
    return [r["round"], r["setup"], r["completed"], f"{r['prefill_hit_tokens']:,}", f"{r['decode_hit_tokens']:,}",
            f"{r['loaded_tokens']:,}", f"{r['computed_tokens']:,}", _ms(r["ttft_p50_s"]), _ms(r["ttft_p90_s"]),
            "/".join(map(str, r["engine_requests"])),
            " ".join(f"{k}={v}" for k, v in (r.get("decisions") or {}).items() if v)]


def inner(a) -> int:
    from kvevents.demo.fleet import free_port
    from kvevents.demo.tiny_model import make_tiny_model

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(workdir / f"model-{a.model_size}", tokenizer=True, size=a.model_size)
    reqs = build_workload(a.requests, model_dir, a.seed)
    info = machine()
    info["load_average"] = os.getloadavg()
    print(f"machine: {info['cpu']}, nproc {info['cores']}, Python {info['python']}, load average "
          + " ".join(f"{x:.2f}" for x in info["load_average"]))
    print(f"command: {a.command}")
    tokens = [r.prompt_tokens for r in reqs]
    print(f"workload: {len(reqs)} chat requests, {sum(tokens):,} prompt tokens (p50 {percentile(tokens, 50)}, "
          f"max {max(tokens)}; one engine with an endless cache would hit {endless_cache_hits(reqs, model_dir):,}), "
          f"concurrency {a.concurrency}; 4 engines x {a.blocks} blocks x 32 tokens, model {a.model_size}")
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    events = [(free_port(), free_port()) for _ in ROLES]
    rows: list[dict] = []
    wanted = [s.strip() for s in a.setups.split(",") if s.strip()]
    for folder in (run_dir / "kv", None):  # the P/D fleet, then the aggregated one
        setups = [s for s in SETUPS if s in wanted] if folder else [s for s in ("ours_agg",) if s in wanted]
        if not setups:
            continue
        if folder is not None:
            folder.mkdir()
        fleet = Fleet(model_dir, events, run_dir / ("pd" if folder else "agg"), a.blocks, folder)
        ours: dict[str, Ours] = {}
        try:
            t0 = time.monotonic()
            fleet.start().wait_ready(a.startup_timeout)
            print(f"{'P/D' if folder else 'aggregated'} engines ready in {time.monotonic() - t0:.0f} s; logs in {run_dir}")
            for setup in (s for s in setups if s.startswith("ours")):
                ours[setup] = Ours(fleet, events, model_dir, run_dir, f"-{setup}", roles=ROLES if folder else None,
                                   extra=shlex.split(a.ours_args) + (ALWAYS if setup == "ours_pd_always" else []))
                ours[setup].start()
            for rnd in range(a.rounds):
                k = rnd % len(setups)
                for setup in setups[k:] + setups[:k]:
                    rows.append(one_run(setup, rnd, fleet, ours, reqs, a, run_dir))
                    print_table(HEADERS, [_row(rows[-1])])
                    sys.stdout.flush()
        finally:
            for o in ours.values():
                o.stop()
            fleet.stop()
    print()
    print("all runs:")
    print_table(HEADERS, [_row(r) for r in rows])
    summary = []
    for setup in (s for s in (*SETUPS, "ours_agg") if s in wanted):
        good = [r for r in rows if r["setup"] == setup and "error" not in r and not r.get("invalid")]
        summary.append({"setup": setup, "runs": len(good), **({k: median([r[k] for r in good]) for k in (
            "prefill_hit_tokens", "computed_tokens", "ttft_p50_s", "ttft_p90_s", "completed")} if good else {})})
    print()
    print(f"medians over valid runs ({a.rounds} round(s)):")
    print_table(["setup", "runs", "prefill-side hits", "computed", "TTFT p50 ms", "TTFT p90 ms", "completed"],
                [[s["setup"], s["runs"], *(["-"] * 5 if not s["runs"] else [
                    f"{s['prefill_hit_tokens']:,.0f}", f"{s['computed_tokens']:,.0f}", _ms(s["ttft_p50_s"]),
                    _ms(s["ttft_p90_s"]), f"{s['completed']:.0f}"])] for s in summary])
    bad = [r for r in rows if "error" in r or r.get("invalid")]
    for r in bad:
        print(f"\nround {r['round']} {r['setup']}: {r.get('error') or r.get('invalid')}")
    if a.json:
        write_json(a.json, {"machine": info, "command": a.command,
                            "config": {k: v for k, v in vars(a).items() if k != "inner"},
                            "runs": rows, "summary": summary})
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=125)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=48, help="KV blocks per engine (x 32 tokens)")
    ap.add_argument("--model-size", default="small", help="kvevents.demo.tiny_model size")
    ap.add_argument("--setups", default=",".join((*SETUPS, "ours_agg")),
                    help="comma-separated subset of " + ", ".join((*SETUPS, "ours_agg")))
    ap.add_argument("--router-policy", default="cache_aware", help="vllm-router's --policy in PD mode")
    ap.add_argument("--ours-args", default="", help="more `kvevents serve` flags for ours")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--workdir", default="/tmp/kvevents-bench-pd")
    ap.add_argument("--json", default=None)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--command", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    main_in_loopback_netns(__file__, a, inner)


if __name__ == "__main__":
    main()
