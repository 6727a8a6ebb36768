"""The narrow, read-only view of the aggregator that its metrics read.

:class:`~kvevents.service.aggregator.Aggregator` satisfies :class:`ServiceView` structurally;
:mod:`kvevents.service.metrics` depends on this module only, so imports run one way
(``aggregator -> metrics -> view``) and a test can hand the metrics any object
with these few read methods. Every method is safe to call from any thread (the
Prometheus scrape runs on an HTTP thread) and returns a snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvevents.ingest.gilmeter import HoldMeter
    from kvevents.index.results import IndexCounters
    from kvevents.ingest.budget import Budget
    from kvevents.engines import EngineSpec
    from kvevents.ingest.subscriber import SourceStats


class IndexView(Protocol):
    """The index queries the metrics need."""

    def counters(self) -> IndexCounters: ...

    def engine_block_counts(self, engine: str) -> dict[str, int]: ...


class ServiceView(Protocol):
    """What is followed and how it is doing: engines (engine specs), their stream
    statistics, and the index."""

    @property
    def index(self) -> IndexView: ...

    def engine_specs(self) -> list[EngineSpec]: ...

    def source_stats(self) -> Mapping[str, SourceStats]: ...

    @property
    def apply_errors(self) -> Mapping[tuple[str, str], int]:
        """Exceptions while applying, by (engine, kind)."""
        ...

    @property
    def rank_mismatches(self) -> Mapping[str, int]:
        """Batches of another data-parallel rank than the engine's, by engine."""
        ...

    @property
    def budget(self) -> Budget: ...

    def ingest_health(self) -> dict: ...

    def ingest_gil_holds(self) -> HoldMeter: ...

    def ingest_heartbeat_wall(self) -> float: ...


#: 0.1.0's name (``kvevents.fleet_view.FleetView``); "fleet" now means the demo's processes.
FleetView = ServiceView
