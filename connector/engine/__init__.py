"""A paged-KV engine driving the connector (demo, tests, benchmarks).

Modules: ``hashing`` (block hash chain), ``request``, ``block_pool`` (GPU prefix cache +
GPU events), ``forward`` (deterministic KV writes and verification), ``scheduler``
(token-budget continuous batching), ``config`` (EngineConfig, TimeModel), ``engine``
(PagedEngine: the step loop).
"""

from connector.engine.config import EngineConfig, TimeModel
from connector.engine.engine import PagedEngine
from connector.engine.request import RequestResult

__all__ = ["EngineConfig", "PagedEngine", "RequestResult", "TimeModel"]
