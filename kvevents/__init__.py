"""kvevents: KV cache event streaming and observability for LLM inference fleets.

The one place the version is written: packaging reads it (``[tool.setuptools.dynamic]``)
and ``kvevents --version`` prints it.
"""

__version__ = "0.1.0"
