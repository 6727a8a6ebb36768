"""Where a metric label's value may come from: never from a client.

A label value that a request can choose mints a new series per value: memory in the
process that exports it, time in every scrape, and cardinality in the operator's
Prometheus, where series are what costs money and what brings a TSDB down. So every
label takes its value from a closed set: the engines the fleet follows (their names are
the operator's, given to ``serve --endpoint``, ``POST /v1/engines`` or found by
discovery), the models those engines serve, and fixed enums (status, reason, tier, api).

:class:`ModelLabels` is the rule for ``model_name``, the one label whose value a request
names: a model some followed engine serves keeps its name; any other name is counted
under :data:`UNKNOWN`; no model at all is ``""``. The gateway's and the lookup metrics
both take their ``model_name`` from it.
"""

from __future__ import annotations

from kvevents.service.view import ServiceView

__all__ = ["UNKNOWN", "ModelLabels"]

#: The ``model_name`` of a request for a model that no followed engine serves.
UNKNOWN = "unknown"


class ModelLabels:
    """The ``model_name`` label of a request's model (see the module docstring).

    The set of served models is read from ``view`` again whenever a name is not in it
    (an engine added since, by discovery say), so a new engine's model is labelled from
    its first request; names of models no engine serves then cost one read of the
    engine specs each, and no series. Thread-safe: the set is replaced, never mutated.
    """

    def __init__(self, view: ServiceView) -> None:
        self._view = view
        self._served: frozenset[str] = frozenset()

    def served(self) -> frozenset[str]:
        """The models the followed engines serve now (read from the view)."""
        self._served = frozenset(s.model for s in self._view.engine_specs() if s.model)
        return self._served

    def label(self, model: str | None) -> str:
        """``model`` if a followed engine serves it, ``""`` for none, else :data:`UNKNOWN`."""
        if not model:
            return ""
        if model in self._served or model in self.served():
            return model
        return UNKNOWN
