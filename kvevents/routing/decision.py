"""The one place a routing request becomes a decision.

:class:`Router` takes a prompt's token ids and, optionally, the candidate engines with
their load, and returns the policy's :class:`~kvevents.routing.policies.RouteDecision`:

1. candidates: those the caller names, each checked against the followed engines (an
   unknown or repeated engine is an :class:`~kvevents.text.prompt.InputError` naming
   ``candidates[i].engine``); by default every followed engine that is not down, with
   no load;
2. the index lookup, waiting on the event loop for at most a bound (:mod:`.offloop`);
3. blocks of engines down for ``down_after_s`` removed from the lookup (they must not
   attract requests), and engines down now marked, so the policy never picks one while
   another is up.

``POST /v1/route`` is a thin handler over :meth:`Router.decide`, and so is anything
else that routes in the same process.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvevents.index import LookupResult, MediaItem
from kvevents.routing.offloop import lookup
from kvevents.routing.policies import Candidate, EngineLoad, KVAwarePolicy, RouteDecision, without_engines
from kvevents.service.aggregator import Aggregator
from kvevents.text.prompt import InputError


class Router:
    """Routing decisions over one aggregator's index and engines; see the module docstring.
    Holds no state of its own beyond the policy; safe to share across requests."""

    def __init__(self, aggregator: Aggregator, policy: KVAwarePolicy | None = None) -> None:
        self.aggregator = aggregator
        self.policy = policy or KVAwarePolicy()

    def candidates(self, requested: Sequence[tuple[str, EngineLoad]] | None) -> list[Candidate]:
        """``requested`` as candidates, each an engine followed and named once; None:
        every engine not down (all of them when all are down), with no load."""
        agg = self.aggregator
        names = [spec.name for spec in agg.engine_specs()]  # no index access: cheap
        if requested is None:
            down = agg.down_engines()
            engines = [name for name in names if name not in down] or names
            if not engines:
                raise InputError(422, "the aggregator follows no engines; pass candidates", "candidates")
            return [Candidate(name) for name in engines]
        known = set(names)
        if not requested:
            raise InputError(422, "candidates must not be empty", "candidates")
        out, seen = [], set()
        for i, (engine, load) in enumerate(requested):
            if engine not in known:
                raise InputError(422, f"unknown engine {engine!r}", f"candidates[{i}].engine")
            if engine in seen:
                raise InputError(422, f"engine {engine!r} listed twice", f"candidates[{i}].engine")
            seen.add(engine)
            out.append(Candidate(engine, load))
        return out

    async def decide(self, token_ids: Sequence[int], model: str | None = None,
                     lora_name: str | None = None,
                     requested: Sequence[tuple[str, EngineLoad]] | None = None, *,
                     cache_salt: str | None = None, media: Sequence[MediaItem] = ()) -> RouteDecision:
        """The engine for this prompt (``media``: its multimodal items, see
        :mod:`kvevents.index.media`). Raises :class:`InputError` for bad candidates."""
        return await self.choose(token_ids, model, lora_name, self.candidates(requested),
                                 cache_salt=cache_salt, media=media)

    async def choose(self, token_ids: Sequence[int] | None, model: str | None,
                     lora_name: str | None, candidates: Sequence[Candidate],
                     down: Collection[str] = (), *,
                     cache_salt: str | None = None, media: Sequence[MediaItem] = ()) -> RouteDecision:
        """The policy's choice among ``candidates`` (already checked). ``token_ids`` None:
        no cache signal (load alone). Engines down now, or in ``down``, are chosen only
        when every candidate is."""
        agg = self.aggregator
        if token_ids is None:
            result = LookupResult(0, 0, [], model, lora_name)
            ids: Sequence[int] = ()
        else:
            result = without_engines(await lookup(agg, token_ids, model, lora_name, "route",
                                                  cache_salt, media),
                                     agg.unroutable_engines())
            ids = token_ids
        return self.policy.choose(ids, result, candidates, down=agg.down_engines() | set(down))
