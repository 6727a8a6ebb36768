"""The module paths of 0.1.0, kept importable for one release after the 0.2.0 layout.

``import kvevents.aggregator`` (or ``from kvevents.router import KVAwarePolicy``) still
works: the old name is answered with the module at its new path, the same object, and
a :class:`DeprecationWarning` names the new path. Installed once, by
``kvevents/__init__.py``; it answers only the names in :data:`MOVED`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: Old module path -> new one (0.1.0 -> 0.2.0). Removed in 0.3.0.
MOVED = {
    "kvevents.schema": "kvevents.wire.schema",
    "kvevents.transport": "kvevents.wire.framing",
    "kvevents.publisher": "kvevents.wire.publisher",
    "kvevents.subscriber": "kvevents.ingest.subscriber",
    "kvevents.aggregator": "kvevents.service.aggregator",
    "kvevents.settings": "kvevents.service.settings",
    "kvevents.snapshot": "kvevents.service.snapshot",
    "kvevents.metrics": "kvevents.service.metrics",
    "kvevents.feed": "kvevents.service.feed",
    "kvevents.fleet_view": "kvevents.service.view",
    "kvevents.router": "kvevents.routing.policies",
    "kvevents.serve": "kvevents.cli.serve",
    "kvevents.tail": "kvevents.cli.tail",
}


def _caller_level() -> int:
    """The stack level of the first frame outside the import machinery, so the warning
    points at the user's import line."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__):
        level += 1
        frame = frame.f_back
    return level


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (importlib's signature)
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):  # noqa: ANN001
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new} in kvevents 0.2.0; the old path is removed "
                      "in 0.3.0", DeprecationWarning, stacklevel=_caller_level())
        return importlib.import_module(new)  # the same module object: one set of classes

    def exec_module(self, module) -> None:  # noqa: ANN001 (already executed at its new path)
        pass


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
