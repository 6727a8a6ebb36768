"""How many prefix-cache hits can routing alone win on bench_gateway.py's workload?

Replays the gateway benchmark's chat workload (the same seed, the same tokenizer and
chat template, 32-token blocks) through a model of the engines' prefix caches: one LRU
of ``--blocks`` blocks per engine, a request hitting the leading blocks its engine holds
(one block less when the whole prompt is cached, as vLLM computes the last token), then
touching and inserting all of its blocks. Sequential: no queueing, no blocks pinned by
running requests. The model is calibrated against the real runs: with 47 blocks it
gives 22.7k hit tokens for round robin (vLLM engines, measured: 23-26k) and 48.2k for
"longest cached prefix, ties to the engine with fewer requests" (measured for the
KV-aware routers: 40-48k).

Policies compared: round robin; longest prefix; a static partition of the prompts by
their first 512 tokens (a system prompt or document); the best static assignment of
the workload's prompt groups (system prompts, documents) to engines, found by trying
them all (an oracle: it knows the groups and their traffic); and a lookahead oracle that
knows the next ``H`` requests and routes each request where the hits over them are
highest (the rest routed by longest prefix). The oracles bound what any online policy
can reach on this workload at this cache size.

    .venv/bin/python benchmarks/routing_bound.py            # 47 blocks, as the benchmark
    .venv/bin/python benchmarks/routing_bound.py --blocks 96
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_workloads import MAX_PROMPT, build_workload  # noqa: E402,F401
from common import machine, print_table  # noqa: E402

BS = 32


class Caches:
    """One LRU of block keys per engine."""

    def __init__(self, engines: int, blocks: int) -> None:
        self.lru = [collections.OrderedDict() for _ in range(engines)]
        self.blocks = blocks

    def copy(self) -> Caches:
        other = Caches(0, self.blocks)
        other.lru = [o.copy() for o in self.lru]
        return other

    def match(self, keys: list[bytes], e: int) -> int:
        n = 0
        for k in keys:
            if k not in self.lru[e]:
                break
            n += 1
        return n

    def serve(self, keys: list[bytes], n_tokens: int, e: int) -> int:
        """Hit tokens of the request on engine ``e``; its blocks are then cached there."""
        n = self.match(keys, e)
        if n * BS >= n_tokens:
            n -= 1
        lru = self.lru[e]
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > self.blocks:
            lru.popitem(last=False)
        return max(0, n) * BS


def block_keys(ids: list[int]) -> list[bytes]:
    keys, h = [], b""
    for i in range(len(ids) // BS):
        h = hashlib.blake2b(h + repr(ids[i * BS:(i + 1) * BS]).encode(), digest_size=8).digest()
        keys.append(h)
    return keys


@dataclass
class Request:
    """One request of the gateway benchmark's workload, as the engines see it."""

    session: str
    group: str  # its system prompt (a conversation) or document (a question)
    ids: list[int]  # the rendered chat template, tokenized
    keys: list[bytes]  # its full blocks' chained keys
    max_tokens: int


def workload(model_dir: str, requests: int, seed: int) -> list[Request]:
    """bench_gateway.py's workload (``requests``, ``seed``), tokenized as its engines do."""
    from transformers import AutoTokenizer

    from kvevents.demo.tiny_model import make_tiny_model

    model = make_tiny_model(model_dir, tokenizer=True, size="small")
    tok = AutoTokenizer.from_pretrained(str(model))
    out = []
    for r in build_workload(requests, model, seed):
        text = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        group = r.messages[0]["content"] if r.kind == "chat" else r.messages[1]["content"].split("\n", 1)[0]
        out.append(Request(r.session, group, ids, block_keys(ids), r.max_tokens))
    return out


def longest(c: Caches, keys: list[bytes], counts: list[int]) -> int:
    m = [c.match(keys, e) for e in range(len(counts))]
    return min((e for e in range(len(counts)) if m[e] == max(m)), key=lambda e: counts[e])


def replay(reqs, choose, engines: int, blocks: int) -> tuple[int, list[int]]:
    c, hits, counts = Caches(engines, blocks), 0, [0] * engines
    for i, (group, ids, keys) in enumerate(reqs):
        e = choose(i, c, group, ids, keys, counts)
        counts[e] += 1
        hits += c.serve(keys, len(ids), e)
    return hits, counts


def lookahead(reqs, horizon: int, engines: int, blocks: int) -> tuple[int, list[int]]:
    def choose(i, c, group, ids, keys, counts):
        best = None
        for e in range(engines):
            trial, tc = c.copy(), counts[:]
            value = trial.serve(keys, len(ids), e)
            tc[e] += 1
            for _, ids2, keys2 in reqs[i + 1:i + 1 + horizon]:
                x = longest(trial, keys2, tc)
                tc[x] += 1
                value += trial.serve(keys2, len(ids2), x)
            if best is None or value > best[0]:
                best = (value, e)
        return best[1]
    return replay(reqs, choose, engines, blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=125)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=47, help="blocks per engine (the benchmark's 48, one kept back)")
    ap.add_argument("--model-dir", default="/tmp/kvevents-bench-gateway/model-small")
    ap.add_argument("--horizons", default="8,20")
    a = ap.parse_args()
    reqs = [(r.group, r.ids, r.keys) for r in workload(a.model_dir, a.requests, a.seed)]
    total = sum(len(ids) for _, ids, _ in reqs)
    groups = sorted({g for g, _, _ in reqs})
    E, B = a.engines, a.blocks
    rows = []

    def add(name: str, result: tuple[int, list[int]]) -> None:
        hits, counts = result
        rows.append([name, f"{hits:,}", f"{100 * hits / total:.1f}%", "/".join(map(str, counts))])

    add("unbounded caches (any affinity policy)", replay(reqs, lambda i, c, g, ids, k, n: longest(c, k, n), E, 10**9))
    add("round robin", replay(reqs, lambda i, c, g, ids, k, n: i % E, E, B))
    add("longest cached prefix, ties to fewer requests", replay(reqs, lambda i, c, g, ids, k, n: longest(c, k, n), E, B))
    add("static partition by the first 512 tokens", replay(reqs, lambda i, c, g, ids, k, n: int.from_bytes(
        hashlib.blake2b(repr(ids[:512]).encode(), digest_size=8).digest(), "big") % E, E, B))
    if E == 2 and len(groups) <= 16:
        gi = {g: i for i, g in enumerate(groups)}
        best = max((replay(reqs, lambda i, c, g, ids, k, n, m=mask: (m >> gi[g]) & 1, E, B)
                    for mask in range(1 << len(groups))), key=lambda r: r[0])
        add(f"oracle: best static assignment of the {len(groups)} prompt groups", best)
    for h in (int(x) for x in a.horizons.split(",") if x):
        add(f"oracle: lookahead {h} requests", lookahead(reqs, h, E, B))
    info = machine()
    print(f"machine: {info['cpu']}, Python {info['python']}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"workload: {len(reqs)} requests, {total:,} prompt tokens, {len(groups)} prompt groups; "
          f"{E} engines x {B} blocks x {BS} tokens (sequential LRU model)")
    print_table(["policy", "hit tokens", "hit %", "requests per engine"], rows)


if __name__ == "__main__":
    main()
