"""What every discovery source is: :class:`Source`, and its status, :class:`SourceStatus`.

A source watches one place engines are announced (a DNS name, a Kubernetes label
selector) and hands the *whole* desired set of engines to ``emit`` each time it knows
it (after every successful resolve or watch event; repeating an unchanged set is fine
and cheap). It never adds or removes engines itself: the
:class:`~kvevents.discovery.manager.Discovery` manager reconciles the set into the
aggregator under the source's :attr:`Source.origin`, with a grace period for vanished
engines.

Lifecycle and failure: :meth:`Source.run` blocks on the manager's thread until
``stop`` is set, and returns within about a second of it. A failed round (DNS timeout,
API server error) is recorded with :meth:`SourceStatus.failed` and does **not** emit:
the last known set stands, since an outage of the source is not an outage of the
engines. An authoritative "nothing there" (NXDOMAIN, an empty pod list) emits ``[]``.
An exception escaping ``run`` is counted by the manager, which calls ``run`` again
after a back-off.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvevents.engines.spec import EngineSpec

__all__ = ["Emit", "Source", "SourceStatus"]

#: The manager's callback: the complete desired set of one source, now.
Emit = Callable[[Sequence[EngineSpec]], None]


@dataclass
class SourceStatus:
    """What ``GET /v1/discovery`` and ``/readyz`` show of one source. Written by the
    source's thread, read by HTTP threads (plain attribute writes)."""

    rounds: int = 0  # successful resolves / list or watch events handled
    errors: int = 0  # failed rounds (the last set stood)
    last_error: str | None = None
    last_ok: float | None = None  # wall time of the last successful round
    engines: int = 0  # engines in the last emitted set
    first_round_done: bool = False  # emitted at least once: readiness waits for this
    # Failed questions by (kind, reason), e.g. ("AAAA", "refused"), counted whether or not
    # the round failed: kvevents_discovery_query_failures_total.
    query_failures: dict[tuple[str, str], int] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # source-specific (resource version, relists)

    def succeeded(self, engines: int) -> None:
        self.rounds += 1
        self.engines = engines
        self.last_ok = time.time()
        self.first_round_done = True

    def failed(self, why: str) -> None:
        self.errors += 1
        self.last_error = why


class Source(ABC):
    """One discovery source (see the module docstring)."""

    #: The registry origin of its engines, e.g. ``dns:vllm.default.svc``; unique per source.
    origin: str

    def __init__(self) -> None:
        self.status = SourceStatus()

    @abstractmethod
    def run(self, emit: Emit, stop: threading.Event) -> None:
        """Watch until ``stop`` is set; ``emit`` the whole desired set after each
        successful round; record failures on :attr:`status`."""

    def describe(self) -> dict:
        """Static facts for ``GET /v1/discovery`` (what is watched, how often)."""
        return {}
