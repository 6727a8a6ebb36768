"""A paged-KV engine driving the connector (demo, tests, benchmarks).

Modules: ``hashing`` (block hash chain), ``request``, ``block_pool`` (GPU prefix cache +
GPU events), ``forward`` (deterministic KV writes and verification), ``scheduler``
(token-budget continuous batching), ``config`` (EngineConfig, TimeModel), ``engine``
(PagedEngine: the step loop).
"""

from kvevents.sim.config import EngineConfig, TimeModel
from kvevents.sim.engine import PagedEngine
from kvevents.sim.request import RequestResult

__all__ = ["EngineConfig", "PagedEngine", "RequestResult", "TimeModel"]
