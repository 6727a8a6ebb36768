"""The demo's router loop over engine RPC, live progress, quiesce, exactness check and
summary.

This is the demo's mode for ``--policy kv|round_robin|least_loaded`` (and for
``--engine vllm``, whose in-process engines take requests over RPC only; a ``vllm
serve`` fleet behind the gateway is separate work) and ``kvevents loadgen``'s loop. The
default with simulated engines, ``--policy gateway``, sends OpenAI requests through the
aggregator's gateway instead (:mod:`kvevents.demo.openai_client`, a subclass that keeps
this module's end of the run).

Routing: every request is routed at its arrival by the chosen policy. ``kv`` asks the
aggregator's ``POST /v1/route`` (over HTTP, as a production router would) with each
engine's load; ``round_robin`` and ``least_loaded`` decide locally. Load is tracked by
the router in simulated time: an engine's load at time A is the number of requests
routed to it that arrived by A and had not finished by A (finish times come back with
each completion; requests still in flight count).

At the end the demo drains every engine (all requests done, all copies landed, all
events published), waits until the aggregator has applied each engine's last batch,
and compares the aggregator's view of every engine (``GET /v1/engines/{name}/blocks``) with
that engine's true cache contents, tier by tier.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import zmq

from kvevents.demo.fleet import EngineClient, Fleet
from kvevents.demo.workload import DemoRequest
from kvevents.routing.policies import Candidate, EngineLoad, LeastLoadedPolicy, RoundRobinPolicy


@dataclass
class Outcome:
    engine: str
    arrival: float
    ttft: float = 0.0
    prompt_tokens: int = 0
    gpu_hit: int = 0
    cpu_hit: int = 0
    computed: int = 0
    finish: float | None = None
    rejected: str | None = None  # the engine refused it (e.g. longer than its KV cache)


@dataclass
class RunState:
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    inflight: dict[str, deque] = field(default_factory=dict)  # engine -> request ids
    done: int = 0
    route_errors: int = 0


class Driver:
    def __init__(self, fleet: Fleet, requests: list[DemoRequest], policy: str,
                 wall_seconds: float, progress: bool = True) -> None:
        self.fleet = fleet
        self.requests = requests
        self.policy = policy
        self.state = RunState(inflight={e.name: deque() for e in fleet.engines})
        self.by_name: dict[str, EngineClient] = {e.name: e for e in fleet.engines}
        last = requests[-1].arrival if requests else 1.0
        self.time_scale = max(last, 1e-6) / max(wall_seconds, 1e-6)  # sim s per wall s
        self.http = httpx.Client(base_url=fleet.url, timeout=30)
        self.local = {"round_robin": RoundRobinPolicy(), "least_loaded": LeastLoadedPolicy()}
        self.progress = progress
        self._poller = zmq.Poller()
        for e in fleet.engines:
            self._poller.register(e.sock, zmq.POLLIN)
        self._last_progress = 0.0
        self._last_batches = (time.monotonic(), 0)
        self.compared_blocks: dict[str, dict[str, int]] = {}  # engine -> tier -> true blocks

    # -- routing -----------------------------------------------------------------------

    def load_at(self, engine: str, arrival: float) -> int:
        q = self.state.inflight[engine]
        outs = self.state.outcomes
        # Arrivals only grow, so a request finished before this arrival never counts again.
        while q and outs[q[0]].finish is not None and outs[q[0]].finish <= arrival:
            q.popleft()
        return sum(1 for rid in q if outs[rid].finish is None or outs[rid].finish > arrival)

    def route(self, req: DemoRequest) -> str:
        candidates = [Candidate(e.name, EngineLoad(waiting=self.load_at(e.name, req.arrival)))
                      for e in self.fleet.engines]
        if self.policy != "kv":
            return self.local[self.policy].choose(req.token_ids, None, candidates).engine
        body = {"token_ids": req.token_ids, "candidates": [
            {"engine": c.engine, "load": {"waiting": c.load.waiting}} for c in candidates]}
        r = self.http.post("/v1/route", content=json.dumps(body),
                           headers={"content-type": "application/json"})
        if r.status_code != 200:
            self.state.route_errors += 1
            return self.local["least_loaded"].choose(req.token_ids, None, candidates).engine
        return r.json()["engine"]

    def dispatch(self, req: DemoRequest) -> None:
        engine = self.route(req)
        self.state.outcomes[req.id] = Outcome(engine, req.arrival)
        self.state.inflight[engine].append(req.id)
        self.by_name[engine].send({"op": "submit", "id": req.id, "token_ids": req.token_ids,
                                   "max_new_tokens": req.max_new_tokens, "arrival": req.arrival,
                                   # a real engine reports finish in wall time scaled by this
                                   "time_scale": self.time_scale})

    def on_message(self, engine: EngineClient, msg: dict[str, Any]) -> None:
        o = self.state.outcomes.get(msg.get("id"))  # type: ignore[arg-type]
        if o is None or o.finish is not None:
            return
        if msg.get("op") == "error":
            o.rejected, o.finish = str(msg.get("error")), o.arrival
            self.state.done += 1
            return
        if msg.get("op") != "done":
            return
        o.ttft, o.prompt_tokens = msg["ttft"], msg["prompt_tokens"]
        o.gpu_hit, o.cpu_hit, o.computed = msg["gpu_hit_tokens"], msg["cpu_hit_tokens"], msg["computed_tokens"]
        o.finish = msg["finish"]
        self.state.done += 1

    def poll(self, timeout_ms: int) -> None:
        ready = dict(self._poller.poll(timeout_ms))
        for e in self.fleet.engines:
            if e.sock in ready:
                while True:
                    msg = e.recv(0)
                    if msg is None:
                        break
                    self.on_message(e, msg)

    # -- the run -----------------------------------------------------------------------

    def run(self) -> float:
        pending = deque(self.requests)
        t0 = time.monotonic()
        next_alive_check = t0 + 2.0
        total = len(self.requests)
        while pending or self.state.done < total:
            now = time.monotonic()
            while pending and pending[0].arrival / self.time_scale <= now - t0:
                self.dispatch(pending.popleft())
            wait = 50
            if pending:
                wait = int(max(0.0, min(0.05, pending[0].arrival / self.time_scale - (now - t0))) * 1000)
            self.poll(wait)
            self.show_progress(total, force=False)
            if now > next_alive_check:  # a crashed engine must not hang the run
                self.fleet.check_alive()
                next_alive_check = now + 2.0
        self.show_progress(total, force=True)
        if self.progress:
            print(file=sys.stderr)
        return time.monotonic() - t0

    def show_progress(self, total: int, force: bool) -> None:
        if not self.progress_due(force):
            return
        outs = [o for o in self.state.outcomes.values() if o.finish is not None]
        prompt = sum(o.prompt_tokens for o in outs) or 1
        gpu = sum(o.gpu_hit for o in outs) / prompt
        cpu = sum(o.cpu_hit for o in outs) / prompt
        try:
            engines = self.http.get("/v1/engines", timeout=2).json()["engines"]
        except (httpx.HTTPError, ValueError):
            engines = []
        self.print_progress(self.state.done, total, f"hit GPU {gpu:5.1%} CPU {cpu:5.1%}", engines, force)

    def progress_due(self, force: bool) -> bool:
        """Whether to show the progress line now (at most every 0.5 s unless forced)."""
        now = time.monotonic()
        if not self.progress or (not force and now - self._last_progress < 0.5):
            return False
        self._last_progress = now
        return True

    def print_progress(self, done: int, total: int, hits: str, engines: list[dict],
                       force: bool) -> None:
        """One progress line: requests done, ``hits``, and the aggregator's batch rate and
        lag from its ``GET /v1/engines`` answer ``engines``."""
        now = time.monotonic()
        batches = sum(p["batches"] for p in engines)
        t_prev, b_prev = self._last_batches
        rate = (batches - b_prev) / max(now - t_prev, 1e-6)
        self._last_batches = (now, batches)
        lag = max((p["lag_seconds"] or 0.0) for p in engines) if engines else 0.0
        width = 24
        filled = int(width * done / max(total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests"
                f" | {hits} | {rate:6.0f} batches/s"
                f" | last batch {lag * 1000:6.0f} ms ago")
        if sys.stderr.isatty():
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif force or int(now) % 5 == 0:
            print(line, file=sys.stderr, flush=True)

    # -- the end ---------------------------------------------------------------------------

    def quiesce(self, timeout_s: float = 60) -> dict[str, dict]:
        drained = {}
        for e in self.fleet.engines:
            drained[e.name] = e.call({"op": "drain"}, "drained", timeout_s, on_other=self.on_message)
        want = {name: d["last_seq"] for name, d in drained.items()}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            engines = {p["name"]: p["last_seq"] for p in self.http.get("/v1/engines").json()["engines"]}
            if all(want[n] < 0 or engines.get(n) == want[n] for n in want):
                break
            time.sleep(0.1)
        return drained

    def index_mismatches(self) -> dict[str, dict[str, int]]:
        """Per engine and tier, blocks in one view but not the other."""
        out = {}
        for e in self.fleet.engines:
            truth = e.call({"op": "contents"}, "contents", 60, on_other=self.on_message)["tiers"]
            seen = self.http.get(f"/v1/engines/{e.name}/blocks").json()["tiers"]
            per = {}
            for tier in set(truth) | set(seen):
                a, b = set(truth.get(tier, [])), set(seen.get(tier, []))
                per[tier] = len(a ^ b)
                # What was compared: an empty tier on both sides would match trivially.
                self.compared_blocks.setdefault(e.name, {})[tier] = len(a)
            out[e.name] = per
        return out

    def summary(self, drained: dict[str, dict], mismatches: dict[str, dict[str, int]],
                wall: float, cpu_tier: bool) -> dict[str, Any]:
        rejected = [o for o in self.state.outcomes.values() if o.rejected]
        outs = [o for o in self.state.outcomes.values() if not o.rejected]
        ttft = np.array([o.ttft for o in outs if o.finish is not None] or [0.0])
        per_engine = {e.name: 0 for e in self.fleet.engines}
        for o in outs:
            per_engine[o.engine] += 1
        counts = list(per_engine.values())
        fleet = self.fleet_summary(drained, mismatches, wall, cpu_tier)
        return {
            **{k: fleet.pop(k) for k in ("engines", "policy", "cpu_tier")},
            "requests": len(outs),
            "failed_requests": 0,  # over RPC a request is done or rejected, never lost
            "rejected_requests": len(rejected),
            "prompt_tokens": sum(o.prompt_tokens for o in outs),
            "hit_tokens": {"GPU": sum(o.gpu_hit for o in outs), "CPU": sum(o.cpu_hit for o in outs)},
            "hit_tokens_source": "engine replies",
            "computed_prefill_tokens": sum(o.computed for o in outs),
            "ttft_seconds": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))},
            "requests_per_engine": per_engine,
            "load_balance_max_over_min": max(counts) / max(min(counts), 1),
            "route_errors": self.state.route_errors,
            **fleet,
        }

    def fleet_summary(self, drained: dict[str, dict], mismatches: dict[str, dict[str, int]],
                      wall: float, cpu_tier: bool) -> dict[str, Any]:
        """The summary's parts that do not depend on how requests were sent: offload,
        byte checks and events (from the drain), the index comparison, wall time."""
        stored_b = sum(d["offload"].get("stored_bytes", 0) for d in drained.values())
        loaded_b = sum(d["offload"].get("loaded_bytes", 0) for d in drained.values())
        stored_s = sum(d["offload"].get("stored_seconds", 0.0) for d in drained.values())
        loaded_s = sum(d["offload"].get("loaded_seconds", 0.0) for d in drained.values())
        engines = self.http.get("/v1/engines").json()["engines"]
        return {
            "engines": len(self.fleet.engines),
            "policy": self.policy,
            "cpu_tier": cpu_tier,
            "offload": {
                "stored_bytes": stored_b, "loaded_bytes": loaded_b,
                "store_gbps": stored_b / stored_s / 1e9 if stored_s else 0.0,
                "load_gbps": loaded_b / loaded_s / 1e9 if loaded_s else 0.0,
            },
            "kv_mismatches": sum(d["kv_mismatches"] for d in drained.values()),
            "verified_blocks": sum(d["verified_blocks"] for d in drained.values()),
            "events": {
                "published": sum(d["published"] for d in drained.values()),
                "dropped_at_publish": sum(d["dropped"] for d in drained.values()),
                "applied": sum(p["batches"] for p in engines),
                "gaps": sum(p["gaps"] for p in engines),
                "replayed": sum(p["replayed_batches"] for p in engines),
                "lost": sum(p["lost_batches"] for p in engines),
            },
            "index_mismatches": sum(sum(v.values()) for v in mismatches.values()),
            "index_mismatches_by_engine": mismatches,
            "index_blocks_compared_by_engine": self.compared_blocks,
            "wall_seconds": round(wall, 2),
        }

    def close(self) -> None:
        self.http.close()
