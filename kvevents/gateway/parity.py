"""Token parity, checked live against the engine itself: the gateway's ids for a request
against the ids the engine's ``/tokenize`` gives for the same body.

A router whose ids differ from the engine's (another chat template, content format,
special tokens) finds no overlap and routes by load while it calls itself KV-aware.
Here, per model:

* the first request of each model after start, then a sample of the requests
  (``sample_rate``, default 1 in 100), are checked off the request path: a task asks an
  engine serving the model for the same body's ids and compares (at most
  :data:`MAX_CHECKS` at once; one more is skipped, not queued);
* each result is counted (``kvevents_gateway_token_parity_checks_total{engine,
  model_name, result, reason}``; ``reason``: ``special_tokens`` when only a BOS/EOS
  differs, ``tools`` for a request with tools, ``content_format`` for one with content
  parts, else ``template``), and the model's first mismatch is logged with the first
  differing position;
* after ``threshold`` mismatches in a row the model's requests are routed with the
  engine's own ``/tokenize`` ids (right, if one hop slower); a sampled request then
  compares its local ids with those, and the first match returns the model to local
  ids. ``GET /v1/engines`` shows each model's state (:meth:`TokenParity.state`).

Lifecycle: one per gateway, the event loop's thread only; :meth:`stop` cancels the
checks in flight. A check that cannot ask the engine (refused, timed out) counts
nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: Parity checks in flight at once (each is one /tokenize call to an engine).
MAX_CHECKS = 2


@dataclass
class ModelParity:
    """One model's parity so far."""

    checks: int = 0
    mismatches: int = 0
    in_a_row: int = 0  # mismatches since the last match
    engine_ids: bool = False  # routed with the engine's /tokenize ids
    last_mismatch: dict[str, Any] | None = None
    reasons: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"ids": "engine" if self.engine_ids else "local", "checks": self.checks,
                "mismatches": self.mismatches, "mismatches_in_a_row": self.in_a_row,
                "mismatch_reasons": dict(self.reasons), "last_mismatch": self.last_mismatch}


def mismatch_reason(ours: Sequence[int], theirs: Sequence[int], tools: bool, parts: bool) -> str:
    """Why two id lists differ, as far as their shape tells (see the module docstring)."""
    a, b = list(ours), list(theirs)
    if a[1:] == b or b[1:] == a or a[:-1] == b or b[:-1] == a or a[1:] == b[1:]:
        return "special_tokens"
    if tools:
        return "tools"
    if parts:
        return "content_format"
    return "template"


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))


class TokenParity:
    """See the module docstring. ``count(engine, model, result, reason)``: the metric."""

    def __init__(self, count: Callable[[str, str | None, str, str], None], sample_rate: float = 0.01,
                 threshold: int = 3) -> None:
        self.count = count
        self.sample_rate = sample_rate
        self.threshold = threshold
        self.models: dict[str, ModelParity] = {}
        self._tasks: set[asyncio.Task] = set()

    def _of(self, model: str | None) -> ModelParity:
        key = model or ""
        got = self.models.get(key)
        if got is None:
            got = self.models[key] = ModelParity()
        return got

    def engine_ids(self, model: str | None) -> bool:
        """Whether the model's requests are routed with the engine's ids now."""
        got = self.models.get(model or "")
        return got is not None and got.engine_ids

    def due(self, model: str | None) -> bool:
        """Whether this request of ``model`` is checked (the first one, then a sample)."""
        if self.sample_rate <= 0:
            return False
        return (model or "") not in self.models or random.random() < self.sample_rate

    def check(self, engine: str, model: str | None, ours: Sequence[int],
              theirs: Callable[[], Awaitable[Sequence[int] | None]], tools: bool, parts: bool) -> None:
        """Compare ``ours`` with the engine's ids (``theirs()``) in a task of its own."""
        self._of(model)  # (the first request is being checked: the next ones are sampled)
        if len(self._tasks) >= MAX_CHECKS:
            return
        task = asyncio.get_running_loop().create_task(
            self._check(engine, model, list(ours), theirs, tools, parts), name="kvevents-token-parity")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, engine: str, model: str | None, ours: list[int],
                     theirs: Callable[[], Awaitable[Sequence[int] | None]], tools: bool, parts: bool) -> None:
        try:
            got = await theirs()
        except Exception:  # noqa: BLE001 - a check must never be why anything fails
            log.exception("token parity check of model %r failed", model)
            return
        if got is not None:
            self.record(engine, model, ours, list(got), tools, parts)

    def record(self, engine: str, model: str | None, ours: Sequence[int], theirs: Sequence[int],
               tools: bool = False, parts: bool = False) -> bool:
        """One comparison's result (also for a request routed with the engine's ids, whose
        local ids were computed beside them); True when equal."""
        state = self._of(model)
        state.checks += 1
        if list(ours) == list(theirs):
            state.in_a_row = 0
            if state.engine_ids:
                log.warning("token parity: model %r matches engine %s again; routing with local ids",
                            model, engine)
            state.engine_ids = False
            self.count(engine, model, "match", "")
            return True
        reason = mismatch_reason(ours, theirs, tools, parts)
        at = first_difference(ours, theirs)
        state.mismatches += 1
        state.in_a_row += 1
        state.reasons[reason] = state.reasons.get(reason, 0) + 1
        first = state.last_mismatch is None
        state.last_mismatch = {"engine": engine, "reason": reason, "position": at, "ours": len(ours),
                               "engine_ids": len(theirs)}
        self.count(engine, model, "mismatch", reason)
        if first:
            log.warning("token parity: model %r differs from engine %s's /tokenize (%s) at token %d "
                        "of %d (ours %s, the engine's %s); check --tokenizer %s=DIR[,chat_template=...]",
                        model, engine, reason, at, len(theirs), list(ours[at:at + 5]), list(theirs[at:at + 5]),
                        model or "MODEL")
        if state.in_a_row >= self.threshold and not state.engine_ids:
            state.engine_ids = True
            log.warning("token parity: %d mismatches in a row for model %r: routing it with the engines' "
                        "/tokenize ids until a check matches", state.in_a_row, model)
        return False

    def state(self, model: str | None) -> dict[str, Any] | None:
        got = self.models.get(model or "")
        return got.as_dict() if got is not None else None

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
