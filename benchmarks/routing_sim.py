"""The gateway benchmark in a model: policy weights and replica counts compared in seconds.

``bench_gateway.py`` takes 8 minutes for 5 rounds of one configuration on real vLLM
engines, and its rounds swing (requests per engine 1.02-1.78 max/min for one
configuration), so it cannot sweep weights. This replays the same workload (the same
seed, tokenizer and chat template: ``routing_bound.workload``) through a discrete-event
model of the fleet and our gateway's own routing code:

* engines: each serves one request at a time, first come first served (the benchmark's
  engines hold 1,536 tokens of KV against ~900-token prompts: about one at a time), for
  ``base + per_token * uncached prompt tokens + per_output * max_tokens`` seconds, times
  a random ``1 + jitter * U(0, 1)``; caches as ``routing_bound.Caches`` (an LRU of 47
  blocks per engine). The index learns a request's blocks when its service starts (vLLM
  publishes ``BlockStored`` for the blocks a step schedules) and forgets evicted ones;
* clients: ``--concurrency`` requests at a time, in the workload's order, a session's
  turns one after the other (as ``bench_gateway.run_workload``); each request reaches its
  engine's queue 0-150 ms after it is routed (the engine's HTTP front, its tokenizer);
* gateways (``--replicas``; request i to replica i mod N, as the benchmark's ``ours_x2``):
  each routes with the real :class:`~kvevents.routing.KVAwarePolicy`,
  :class:`~kvevents.gateway.load.EngineLoads` (its own requests in flight, its shares) and
  :class:`~kvevents.gateway.inflight.InflightPrompts`; the other replicas' load is the
  engines' queue plus running at the last poll (every ``--poll`` s) minus its own then.

Calibration (real figures from benchmarks/README.md, same workload): without the balance
term (``balance_weight=0``, the default before it) the model gives 1.14 max/min requests
per engine for one replica and 1.19 for two, against 1.05-1.16 and 1.19-1.31 measured;
it understates what two replicas lose. Hit tokens are lower in the model (~36k against
43-48k measured): the model evicts more than vLLM, so compare them only between rows. It
knows nothing of CPU contention, preemption or the engines' real step times: it screens
weights; a weight it favours is measured with ``bench_gateway.py`` before it becomes a
default.

    .venv/bin/python benchmarks/routing_sim.py
    .venv/bin/python benchmarks/routing_sim.py --variants "default;balance_weight=0;balance_weight=1"
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import machine, median, print_table  # noqa: E402
from routing_bound import BS, Caches, Request, block_keys, workload  # noqa: E402
from kvevents.gateway.answers import expected_cached  # noqa: E402
from kvevents.gateway.inflight import InflightPrompts  # noqa: E402
from kvevents.gateway.load import EngineLoads  # noqa: E402
from kvevents.index import EngineMatch, LookupResult  # noqa: E402
from kvevents.routing import KVAwarePolicy, KVRouterConfig  # noqa: E402

FRONT_LAG_S = 0.15  # at most, from routing to the engine's queue


class Replica:
    """One gateway's routing state: what ``kvevents.gateway.proxy.Gateway._decide`` reads."""

    def __init__(self, config: KVRouterConfig, engines: list[str]) -> None:
        self.policy = KVAwarePolicy(config)
        self.loads = EngineLoads()
        self.flights = InflightPrompts()
        self.engines = engines

    def route(self, ids: np.ndarray, lookup: LookupResult) -> tuple[str, int, tuple]:
        candidates = self.loads.candidates(self.engines, self.flights.matches(ids, self.engines))
        d = self.policy.choose(ids.tolist(), lookup, candidates)
        prefill = max(0, len(ids) - expected_cached(d, len(ids)))
        self.loads.started(d.engine, prefill)
        return d.engine, prefill, self.flights.add(d.engine, ids)

    def finished(self, engine: str, prefill: int, handle: tuple) -> None:
        self.loads.finished(engine, prefill)
        self.flights.remove(handle)


class Fleet:
    """One run of the workload; :meth:`run` returns (engine-reported hit tokens,
    requests per engine)."""

    def __init__(self, reqs: list[Request], replicas: int, config: KVRouterConfig, seed: int,
                 a: argparse.Namespace) -> None:
        self.reqs, self.a = reqs, a
        self.rng = random.Random(seed)
        self.names = [f"e{i}" for i in range(a.engines)]
        self.caches = Caches(a.engines, a.blocks)
        self.known: list[set[bytes]] = [set() for _ in self.names]  # what the index holds
        self.queue: list[collections.deque] = [collections.deque() for _ in self.names]
        self.serving: list[tuple | None] = [None] * a.engines
        self.replicas = [Replica(config, self.names) for _ in range(replicas)]
        self.events: list = []
        self.order = itertools.count()
        self.now = 0.0
        self.hits = 0
        self.counts = [0] * a.engines

    def _at(self, t: float, kind: str, data: tuple = ()) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, data))

    def _lookup(self, r: Request) -> LookupResult:
        matches = []
        for e, name in enumerate(self.names):
            n = 0
            for k in r.keys:
                if k not in self.known[e]:
                    break
                n += 1
            if n:
                matches.append(EngineMatch(name, n * BS, {"GPU": n * BS}, BS))
        matches.sort(key=lambda m: -m.tokens)
        return LookupResult(len(r.ids), BS, matches)

    def _poll(self) -> None:
        for rep in self.replicas:
            for e, name in enumerate(self.names):
                total = len(self.queue[e]) + (self.serving[e] is not None)
                t = rep.loads.of(name)
                t.others = max(0.0, total - t.inflight)

    def _serve_next(self, e: int) -> None:
        if self.serving[e] is not None or not self.queue[e]:
            return
        job = self.queue[e].popleft()
        r = self.reqs[job[0]]
        hit = self.caches.serve(r.keys, len(r.ids), e)
        self.known[e] = set(self.caches.lru[e])
        self.hits += hit
        a = self.a
        seconds = (a.base + a.per_token * (len(r.ids) - hit) + a.per_output * r.max_tokens) \
            * (1 + a.jitter * self.rng.random())
        self.serving[e] = job
        self._at(self.now + seconds, "done", (e,))

    def run(self) -> tuple[int, list[int]]:
        pending = list(range(len(self.reqs)))
        busy_sessions: set[str] = set()
        free = self.a.concurrency
        sent = done = 0

        def dispatch() -> None:
            nonlocal free, sent
            while free:
                i = next((j for j in pending if self.reqs[j].session not in busy_sessions), None)
                if i is None:
                    return
                pending.remove(i)
                r = self.reqs[i]
                busy_sessions.add(r.session)
                free -= 1
                k = sent % len(self.replicas)
                sent += 1
                engine, prefill, handle = self.replicas[k].route(np.asarray(r.ids, dtype=np.int64),
                                                                 self._lookup(r))
                e = self.names.index(engine)
                self.counts[e] += 1
                self._at(self.now + FRONT_LAG_S * self.rng.random(), "arrive", (e, (i, k, prefill, handle)))

        self._at(0.0, "poll")
        dispatch()
        while self.events:
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == "poll":
                self._poll()
                if done < len(self.reqs):
                    self._at(self.now + self.a.poll, "poll")
            elif kind == "arrive":
                e, job = data
                self.queue[e].append(job)
                self._serve_next(e)
            else:
                e, = data
                i, k, prefill, handle = self.serving[e]
                self.serving[e] = None
                self.replicas[k].finished(self.names[e], prefill, handle)
                busy_sessions.discard(self.reqs[i].session)
                free += 1
                done += 1
                self._serve_next(e)
                dispatch()
        return self.hits, self.counts


def prefix_repetition(prefixes: int, prefix_len: int, suffix_len: int, requests: int, seed: int
                      ) -> list[Request]:
    """``vllm bench serve``'s prefix_repetition dataset as the engines see it: ``prefixes``
    shared prefixes of random ids, each request one of them (evenly, shuffled) and a
    random suffix, each its own session, 8 output tokens."""
    rng = random.Random(seed)
    shared = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(prefixes)]
    order = [k % prefixes for k in range(requests)]
    rng.shuffle(order)
    out = []
    for i, k in enumerate(order):
        ids = shared[k] + [rng.randrange(32000) for _ in range(suffix_len)]
        out.append(Request(f"r{i}", f"prefix-{k}", ids, block_keys(ids), 8))
    return out


def parse_variant(text: str) -> tuple[str, KVRouterConfig]:
    """``default`` or ``key=value,key=value`` of :class:`KVRouterConfig`'s float fields."""
    text = text.strip()
    if text == "default":
        return text, KVRouterConfig()
    kw = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in {"load_weight", "kv_weight", "max_imbalance", "affinity_weight", "balance_weight"}:
            raise SystemExit(f"unknown weight {key!r} in variant {text!r}")
        kw[key.strip()] = float(value)
    return text, KVRouterConfig(**kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="default;balance_weight=0",
                    help="';'-separated: 'default' or KVRouterConfig weights as key=value,...")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--seeds", type=int, default=30, help="runs per variant and replica count")
    ap.add_argument("--requests", type=int, default=125)
    ap.add_argument("--seed", type=int, default=0, help="the workload's (bench_gateway --seed)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=47)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between the gateways' engine polls")
    ap.add_argument("--base", type=float, default=0.08, help="seconds per request")
    ap.add_argument("--per-token", type=float, default=1e-3, help="seconds per uncached prompt token")
    ap.add_argument("--per-output", type=float, default=0.02, help="seconds per output token")
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--model-dir", default="/tmp/kvevents-bench-gateway/model-small")
    ap.add_argument("--workload", choices=("chats", "prefix_repetition"), default="chats",
                    help="bench_gateway.py's chats, or vllm bench serve's prefix_repetition (12 x 480-token "
                         "prefixes, 32-token suffixes, 156 requests: bench_gateway --client vllm-bench)")
    a = ap.parse_args()
    reqs = (workload(a.model_dir, a.requests, a.seed) if a.workload == "chats"
            else prefix_repetition(12, 480, 32, 156, a.seed))
    rows = []
    for name, config in (parse_variant(v) for v in a.variants.split(";") if v.strip()):
        base_hits = None
        for replicas in (int(x) for x in a.replicas.split(",")):
            runs = [Fleet(reqs, replicas, config, s, a).run() for s in range(a.seeds)]
            hits = median([h for h, _ in runs])
            spread = sorted(max(c) / max(1, min(c)) for _, c in runs)
            base_hits = base_hits or hits
            rows.append([name, replicas, f"{hits:,.0f}", f"{hits / base_hits:.2f}x",
                         f"{median(spread):.2f}", f"{spread[int(0.8 * (len(spread) - 1))]:.2f}"])
    info = machine()
    print(f"machine: {info['cpu']}, Python {info['python']}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"model: {len(reqs)} requests, {a.engines} engines x {a.blocks} blocks, concurrency "
          f"{a.concurrency}, polls every {a.poll:g} s, {a.seeds} runs each (medians)")
    print_table(["variant", "replicas", "hit tokens", "vs first", "requests max/min", "p80 max/min"], rows)


if __name__ == "__main__":
    main()
