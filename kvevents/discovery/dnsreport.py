"""What a DNS source shows of its questions: :class:`QueryReport`.

Per kind of question (``A``, ``AAAA``, ``SRV``, ``SRV replay``...) the state of the last
round (``answer`` with how many records, ``nodata``, ``nxdomain``, or ``failed`` with the
reason and what each server did) and since when, and the failures counted by reason.
These go to ``GET /v1/discovery`` (the source's ``queries`` and ``query_failures``) and,
through :attr:`~kvevents.discovery.source.SourceStatus.query_failures`, to the
``kvevents_discovery_query_failures_total`` counter.

Logging: a kind that starts failing is logged once (a warning naming the reason); it is
logged again only when the reason changes, and once more (info) when it answers again.
A resolver that always refuses AAAA therefore writes one line, not one per round.

Lifecycle: one per source, written by the source's thread only; HTTP threads read the
plain dicts it replaces whole.
"""

from __future__ import annotations

import logging
import time

from kvevents.discovery.dnsquery import ANSWER, FAILED, Lookup, Outcome
from kvevents.discovery.source import SourceStatus

__all__ = ["QueryReport"]

log = logging.getLogger("kvevents.discovery.dns")


class QueryReport:
    """See the module docstring."""

    def __init__(self, origin: str, status: SourceStatus) -> None:
        self.origin = origin
        self.status = status
        self._states: dict[str, dict] = {}
        self._logged: dict[str, str] = {}  # kind -> the failure reason logged last
        status.extra["queries"] = {}
        status.extra["query_failures"] = {}
        status.extra["partial_rounds"] = 0

    def record(self, kind: str, outcome: Outcome, *, count: bool = True) -> None:
        """One question's outcome (or the round's verdict for ``kind``). ``count``:
        also count a failure (False when it was counted already this round)."""
        state = {"state": outcome.kind}
        if outcome.kind == ANSWER:
            state["records"] = len(outcome.records)
        elif outcome.kind == FAILED:
            state.update(reason=outcome.reason, detail=outcome.detail)
        old = self._states.get(kind)
        same = old is not None and old["state"] == state["state"] and old.get("reason") == state.get("reason")
        state["since"] = old["since"] if same else time.time()
        self._states[kind] = state
        if outcome.kind == FAILED:
            if count:
                key = (kind, outcome.reason or "unknown")
                self.status.query_failures[key] = self.status.query_failures.get(key, 0) + 1
            reason = outcome.reason or "unknown"
            if self._logged.get(kind) != reason:
                self._logged[kind] = reason
                log.warning("%s: %s questions fail (%s: %s); logged again only when this changes",
                            self.origin, kind, outcome.reason, outcome.detail)
        elif kind in self._logged:
            del self._logged[kind]
            log.info("%s: %s questions are answered again (%s)", self.origin, kind, outcome.kind)

    def record_lookup(self, lookup: Lookup, kinds: list[str], label: str = "") -> None:
        """Every question of ``lookup``: failures counted one by one, then each kind's
        verdict (the deciding candidate's outcome, or the failure that left it unknown)."""
        for rdtype, outcome, _ in lookup.failed:
            key = (f"{label}{rdtype}", outcome.reason or "unknown")
            self.status.query_failures[key] = self.status.query_failures.get(key, 0) + 1
        for rdtype in kinds:
            outcome = lookup.outcomes.get(rdtype)
            if outcome is not None:
                self.record(f"{label}{rdtype}", outcome, count=False)

    def reset(self) -> None:
        """No question this round (the hosts file answered): no states to show."""
        self._states.clear()
        self._logged.clear()

    def publish(self, partial: bool) -> None:
        """After a round: the states and counts as ``GET /v1/discovery`` shows them."""
        if partial:
            self.status.extra["partial_rounds"] += 1
        self.status.extra["queries"] = {k: dict(v) for k, v in self._states.items()}
        failures: dict[str, dict[str, int]] = {}
        for (kind, reason), n in sorted(self.status.query_failures.items()):
            failures.setdefault(kind, {})[reason] = n
        self.status.extra["query_failures"] = failures

    def failing(self) -> list[str]:
        """``KIND reason: detail`` of each kind whose last state is a failure."""
        return [f"{k} {v['reason']}: {v['detail']}" for k, v in self._states.items()
                if v["state"] == FAILED]
