"""kvevents: KV cache event streaming and observability for LLM inference fleets.

The one place the version is written: packaging reads it (``[tool.setuptools.dynamic]``)
and ``kvevents --version`` prints it.
"""

__version__ = "0.2.0"

from kvevents import _compat

_compat.install()  # the 0.1.0 module paths (kvevents.aggregator, ...) for one more release
