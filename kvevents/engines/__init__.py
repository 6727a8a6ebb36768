"""The engines the service follows: one :class:`EngineSpec` per engine, and the
:class:`EngineRegistry` that holds the followed set (add, remove, reconcile to a
desired set, status, routable).

Imports ``wire`` and ``ingest`` only: the registry knows an engine's stream statistics
(:class:`~kvevents.ingest.source.SourceStats`), never the index or HTTP.
"""

from kvevents.engines.registry import EngineBudgetError, EngineExistsError, EngineRegistry, EngineState
from kvevents.engines.spec import ENGINE_NAME_PATTERN, ROLES, EngineSpec, PodSpec, validate_engine_name

__all__ = ["ENGINE_NAME_PATTERN", "ROLES", "EngineBudgetError", "EngineExistsError", "EngineRegistry",
           "EngineSpec", "EngineState", "PodSpec", "validate_engine_name"]
