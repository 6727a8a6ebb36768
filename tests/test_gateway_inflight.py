"""Prompts in flight: the gateway's first-hand knowledge of what each engine is about to
hold, which the index learns only after the prefill (kvevents/gateway/inflight.py), and
how the KV-aware policy weighs it."""

from __future__ import annotations

import numpy as np

from kvevents.gateway.inflight import PER_BUCKET, InflightPrompts, common_prefix
from kvevents.index import LookupResult
from kvevents.index.results import EngineMatch
from kvevents.routing import Candidate, EngineLoad, KVAwarePolicy


def ids(*parts: range) -> np.ndarray:
    return np.concatenate([np.arange(p.start, p.stop, dtype=np.int64) for p in parts])


def test_common_prefix():
    a = ids(range(0, 100))
    assert common_prefix(a, a) == 100
    assert common_prefix(a, a[:40]) == 40
    b = a.copy()
    b[57] = -1
    assert common_prefix(a, b) == 57 and common_prefix(b, a) == 57
    assert common_prefix(a, np.zeros(0, dtype=np.int64)) == 0
    assert common_prefix(a, ids(range(1, 50))) == 0


def test_matches_per_engine_and_removal():
    fl = InflightPrompts()
    system = range(0, 400)
    h1 = fl.add("e0", ids(system, range(1000, 1100)))
    h2 = fl.add("e1", ids(system[:200], range(5000, 5300)))
    fl.add("e1", ids(range(9000, 9500)))  # another head: never compared
    new = ids(system, range(2000, 2050))
    assert fl.matches(new, ["e0", "e1", "e2"]) == {"e0": 400, "e1": 200}
    assert fl.count("e0") == 1 and fl.count("e1") == 2
    fl.remove(h1)
    fl.remove(h1)  # twice: harmless
    assert fl.matches(new, ["e0", "e1"]) == {"e1": 200}
    fl.remove(h2)
    fl.forget({"e0"})
    assert fl.matches(new, ["e0", "e1"]) == {} and fl.count("e1") == 0


def test_only_the_most_recent_of_a_hot_head_are_compared():
    fl = InflightPrompts()
    long = ids(range(0, 900))
    fl.add("e0", long)  # the oldest: past PER_BUCKET more recent ones
    for i in range(PER_BUCKET):
        fl.add("e0", ids(range(0, 100), range(10_000 * (i + 1), 10_000 * (i + 1) + 50)))
    assert fl.matches(long, ["e0"]) == {"e0": 100}


def _lookup(n: int, matches: list[tuple[str, int]], bs: int = 32) -> LookupResult:
    return LookupResult(n, bs, [EngineMatch(e, t, {"GPU": t}, bs) for e, t in matches], None, None)


def test_policy_counts_inflight_tokens_as_a_gpu_run():
    policy = KVAwarePolicy()
    toks = list(range(1000))
    # The index knows nothing yet; e1 has a request in flight sharing 600 tokens (floored
    # to whole blocks: 576), e0 is a bit less busy: e1 wins on the in-flight prefix.
    d = policy.choose(toks, _lookup(1000, [], bs=32),
                      [Candidate("e0", EngineLoad(running=1)), Candidate("e1", EngineLoad(running=2), 600)])
    assert d.engine == "e1" and d.matched_tokens == 576 and d.tiers == {"GPU": 576}
    # An index match longer than what is in flight wins over it.
    d = policy.choose(toks, _lookup(1000, [("e0", 800)]),
                      [Candidate("e0"), Candidate("e1", inflight_tokens=600)])
    assert d.engine == "e0" and d.matched_tokens == 800
    # In flight never counts beyond the prompt.
    d = policy.choose(toks[:100], _lookup(100, []), [Candidate("e0", inflight_tokens=5000)])
    assert d.matched_tokens == 96
