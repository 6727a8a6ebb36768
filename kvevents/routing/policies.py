"""Routing policies: where to send a prompt, given what each engine has cached and its load.

All policies take the same inputs — the index's :class:`~kvevents.index.LookupResult`
for the prompt and the candidate engines with their load — and return a
:class:`RouteDecision` that says why. They hold no sockets and no locks; the KV-aware
one is used in process by the demo and over HTTP by ``POST /v1/route``.

KV-aware scoring, per candidate::

    cache = (w_GPU * gpu_run + w_CPU * (any_tier_run - gpu_run)) / prompt_tokens
    load  = waiting + running + kv_weight * kv_usage
    score = cache - load_weight * load / (max_load + 1) + affinity_weight * [affine]
            - balance_weight * (recent_share - 1 / candidates)

``gpu_run`` is the leading prefix the engine holds on the GPU; blocks past it that are
cached on the CPU tier still save prefill but cost a load, hence the lower CPU weight.
A candidate's ``inflight_tokens`` (what a gateway knows first-hand: the longest prefix
of this prompt that a request it sent there and that has not finished starts with)
counts as a GPU run too: those blocks are held by that request or about to be computed
for it, while the index learns of them only after their prefill.
The load guard: a candidate more than ``max_imbalance`` requests busier than the least
loaded one is not eligible (unless none is), so a hot prefix cannot pile every request
onto one engine. ``affine`` marks the engine the prompt's distinctive part (the tokens
after what every engine caches) hashes to: a conversation keeps going back to the same
engine, which keeps per-engine reuse distances short. ``recent_share`` (a gateway's, when
it tracks one: the fraction of its latest requests it sent to the candidate) evens out
the request counts that cache stickiness alone leaves uneven: a system prompt shared by
many conversations would keep them all on the engine that cached it first; an engine
short of its share wins the prompts where it trails by little in cache (a new
conversation, whose shared part it then caches too). Ties (scores within ``1e-9``) are
broken by a hash of the prompt's first tokens and the engine name: deterministic for a
given prompt, spread over engines across prompts.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import msgspec

from kvevents.defaults import (ROUTE_AFFINITY_WEIGHT, ROUTE_BALANCE_WEIGHT, ROUTE_LOAD_WEIGHT,
                               ROUTE_MAX_IMBALANCE)
from kvevents.index import LookupResult

_TIE_EPS = 1e-9


def without_engines(lookup: LookupResult, engines: set[str]) -> LookupResult:
    """``lookup`` with the matches of ``engines`` removed: blocks of engines that are
    gone (down for ``down_after_s``) must not attract requests."""
    if not engines or not any(m.engine in engines for m in lookup.engines):
        return lookup
    return msgspec.structs.replace(lookup, engines=[m for m in lookup.engines if m.engine not in engines])


@dataclass(frozen=True)
class EngineLoad:
    """What an engine reports (or a router tracks) about how busy it is."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # fraction of GPU KV blocks in use, 0..1

    def __post_init__(self) -> None:
        if min(self.waiting, self.running, self.kv_usage) < 0:
            raise ValueError("load figures must be >= 0")


@dataclass(frozen=True)
class Candidate:
    engine: str
    load: EngineLoad = field(default_factory=EngineLoad)
    inflight_tokens: int = 0  # leading prompt tokens in flight there (see the module docstring)
    # Fraction of its recent requests the router sent there (None: not tracked).
    recent_share: float | None = None


@dataclass(frozen=True)
class EngineScore:
    engine: str
    score: float
    cache_score: float
    load: float
    matched_tokens: int
    tiers: dict[str, int]
    eligible: bool


@dataclass(frozen=True)
class RouteDecision:
    engine: str
    matched_tokens: int
    tiers: dict[str, int]
    scores: list[EngineScore]
    reason: str
    block_size: int = 0  # of the lookup's best match (0: unknown)


@dataclass(frozen=True)
class KVRouterConfig:
    """Weights of the KV-aware policy, validated once."""

    tier_weights: dict[str, float] = field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.6})
    load_weight: float = ROUTE_LOAD_WEIGHT
    kv_weight: float = 1.0
    max_imbalance: float = ROUTE_MAX_IMBALANCE  # requests
    affinity_weight: float = ROUTE_AFFINITY_WEIGHT
    balance_weight: float = ROUTE_BALANCE_WEIGHT

    def __post_init__(self) -> None:
        if any(w < 0 for w in self.tier_weights.values()):
            raise ValueError("tier weights must be >= 0")
        if min(self.load_weight, self.kv_weight, self.max_imbalance, self.affinity_weight,
               self.balance_weight) < 0:
            raise ValueError("load_weight, kv_weight, max_imbalance, affinity_weight, balance_weight "
                             "must be >= 0")


def _load_of(c: Candidate, kv_weight: float) -> float:
    return c.load.waiting + c.load.running + kv_weight * c.load.kv_usage


def _id_bytes(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as int64 bytes: the same bytes for the same ids in a list, an
    ``array('q')`` or a numpy array (hashed for affinity and ties; joining their
    decimal text cost more than the rest of the affinity)."""
    if type(token_ids) is array and token_ids.typecode == "q":
        return token_ids.tobytes()
    try:
        return array("q", token_ids).tobytes()
    except (OverflowError, TypeError):  # ids past int64: their decimal text instead
        return ",".join(map(str, token_ids)).encode()


def _by_score(s: EngineScore) -> float:
    return -s.score


def _tie_key(token_ids: Sequence[int], engine: str) -> bytes:
    return hashlib.blake2b(_id_bytes(token_ids[:64]) + b"|" + engine.encode(), digest_size=8).digest()


class KVAwarePolicy:
    """Longest cached prefix per tier, weighed against load; see the module docstring."""

    name = "kv"

    def __init__(self, config: KVRouterConfig | None = None) -> None:
        self.config = config or KVRouterConfig()

    def choose(self, token_ids: Sequence[int], lookup: LookupResult,
               candidates: Sequence[Candidate], down: Collection[str] = ()) -> RouteDecision:
        """``down``: candidates whose engine is disconnected; they are scored but not
        eligible, and chosen only when every candidate is down."""
        if not candidates:
            raise ValueError("no candidate engines")
        # Plain loops over locals: this runs once per routed request, on the event loop.
        cfg = self.config
        load_weight = cfg.load_weight
        matches = {m.engine: m for m in lookup.engines}
        loads = [_load_of(c, cfg.kv_weight) for c in candidates]
        max_load, min_load = max(loads), min(loads)
        n = max(1, lookup.prompt_tokens)
        w_gpu, w_cpu = cfg.tier_weights.get("GPU", 1.0), cfg.tier_weights.get("CPU", 0.0)
        bs = lookup.block_size
        # Whole blocks only: a partial block is never a hit.
        flying = [min(n, c.inflight_tokens) // bs * bs if bs else min(n, c.inflight_tokens)
                  for c in candidates]
        affinity = self._affinity(token_ids, candidates, matches, flying)
        even = 1.0 / len(candidates)
        scores = []
        for c, load, fly in zip(candidates, loads, flying):
            engine = c.engine
            m = matches.get(engine)
            if m is None:
                total, tiers, gpu = 0, {}, 0
            else:
                total, tiers = m.tokens, dict(m.tiers)
                gpu = min(tiers.get("GPU", 0), total)
            if fly > gpu:  # held there by a request in flight: a GPU run
                gpu = fly
                if gpu > total:
                    total = gpu
                tiers["GPU"] = gpu
            cache = (w_gpu * gpu + w_cpu * (total - gpu)) / n
            score = cache - load_weight * load / (max_load + 1)
            if engine == affinity:
                score += cfg.affinity_weight
            if c.recent_share is not None:
                score -= cfg.balance_weight * (c.recent_share - even)
            eligible = load - min_load <= cfg.max_imbalance and engine not in down
            scores.append(EngineScore(engine, score, cache, load, total, tiers, eligible))
        up = ([s for s in scores if s.engine not in down] or scores) if down else scores
        pool = [s for s in up if s.eligible] or up
        best_score = max([s.score for s in pool])
        tied = [s for s in pool if best_score - s.score <= _TIE_EPS]
        best = min(tied, key=lambda s: _tie_key(token_ids, s.engine)) if len(tied) > 1 else tied[0]
        shares = {c.engine: c.recent_share for c in candidates
                  if c.recent_share is not None} if cfg.balance_weight else {}
        reason = self._reason(best, up, pool, tied, n, shares)
        if down and best.engine not in down and len(up) < len(scores):
            reason += f"; skipped down: {', '.join(sorted(s.engine for s in scores if s.engine in down))}"
        scores.sort(key=_by_score)
        return RouteDecision(best.engine, best.matched_tokens, best.tiers, scores, reason,
                             lookup.block_size)

    @staticmethod
    def _affinity(token_ids: Sequence[int], candidates: Sequence[Candidate],
                  matches: dict, flying: list[int]) -> str | None:
        """The engine this prompt's *distinctive* part hashes to (rendezvous hashing).

        The part every candidate already caches (a shared system prompt) says nothing;
        the tokens right after it (a conversation's first message, a document) do, and
        they repeat in every later turn. Hashing them sends a conversation back to the
        same engine even after its blocks were evicted there, so each engine serves a
        stable share of conversations and its cache holds them longer.
        ``flying``: each candidate's whole blocks of this prompt in flight there.
        """
        common = None
        for c, fly in zip(candidates, flying):
            m = matches.get(c.engine)
            held = m.tokens if m is not None and m.tokens > fly else fly
            if common is None or held < common:
                common = held
        distinctive = token_ids[common:common + 64]
        if not len(distinctive):  # nothing distinctive (or no ids at all): no affinity
            return None
        key = _id_bytes(distinctive) + b"|"
        best, best_hash = None, b""
        for c in candidates:
            h = hashlib.blake2b(key + c.engine.encode(), digest_size=8).digest()
            if best is None or h > best_hash:
                best, best_hash = c.engine, h
        return best

    @staticmethod
    def _reason(best: EngineScore, scores: list[EngineScore], pool: list[EngineScore],
                tied: list[EngineScore], n: int, shares: dict[str, float]) -> str:
        top_cache = max(scores, key=lambda s: s.cache_score)
        if not top_cache.eligible and top_cache.cache_score > best.cache_score:
            return (f"load guard: {top_cache.engine} caches more ({top_cache.matched_tokens} tokens) "
                    f"but is {top_cache.load - min(s.load for s in scores):g} requests busier than "
                    f"the least loaded; chose {best.engine}")
        if top_cache.cache_score > best.cache_score:  # passed over by load, balance or affinity
            why = []
            if top_cache.load != best.load:
                why.append(f"load {top_cache.load:g} against {best.load:g}")
            top_share, best_share = shares.get(top_cache.engine), shares.get(best.engine)
            if top_share is not None and best_share is not None and top_share != best_share:
                why.append(f"{top_share:.0%} of the recent requests against {best_share:.0%}")
            return (f"{top_cache.engine} caches more ({top_cache.matched_tokens} tokens against "
                    f"{best.matched_tokens}) but scores lower ({'; '.join(why) or 'affinity'}); "
                    f"chose {best.engine}")
        if best.matched_tokens == 0:
            why = "no engine caches a prefix of this prompt: least loaded"
        else:
            tiers = ", ".join(f"{t} {v}" for t, v in sorted(best.tiers.items()))
            why = f"longest weighted cached prefix: {best.matched_tokens} of {n} tokens ({tiers})"
        if len(tied) > 1:
            why += f"; tie among {len(tied)} engines broken by prompt hash"
        return why


class RoundRobinPolicy:
    """Each candidate in turn, ignoring caches and load (the baseline)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, token_ids: Sequence[int], lookup: LookupResult | None,
               candidates: Sequence[Candidate]) -> RouteDecision:
        if not candidates:
            raise ValueError("no candidate engines")
        c = candidates[next(self._counter) % len(candidates)]
        m = {p.engine: p for p in lookup.engines}.get(c.engine) if lookup else None
        return RouteDecision(c.engine, m.tokens if m else 0, dict(m.tiers) if m else {}, [],
                             "round robin")


class LeastLoadedPolicy:
    """The candidate with the lowest load; ties by prompt hash."""

    name = "least_loaded"

    def __init__(self, kv_weight: float = 1.0) -> None:
        self.kv_weight = kv_weight

    def choose(self, token_ids: Sequence[int], lookup: LookupResult | None,
               candidates: Sequence[Candidate]) -> RouteDecision:
        if not candidates:
            raise ValueError("no candidate engines")
        loads = {c.engine: _load_of(c, self.kv_weight) for c in candidates}
        low = min(loads.values())
        tied = [c.engine for c in candidates if loads[c.engine] - low <= _TIE_EPS]
        engine = min(tied, key=lambda p: _tie_key(token_ids, p))
        m = {p.engine: p for p in lookup.engines}.get(engine) if lookup else None
        return RouteDecision(engine, m.tokens if m else 0, dict(m.tiers) if m else {}, [],
                             f"least loaded ({low:g})")


POLICIES = {"kv": KVAwarePolicy, "round_robin": RoundRobinPolicy, "least_loaded": LeastLoadedPolicy}
