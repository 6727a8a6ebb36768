"""A paged-KV engine driving the connector core directly (demo, tests, benchmarks).

A demo and test double, not an imitation of any engine's interface: it calls
:class:`connector.base.OffloadCore` in step order and never imports torch (the KV
tensors are allocated, written and checked by the connector side: ``KVCacheLayout``,
``KVPattern``; the simulator only passes them along with numpy index arrays).

Modules: ``hashing`` (block hash chain), ``request``, ``block_pool`` (GPU prefix cache +
GPU events), ``scheduler`` (token-budget continuous batching), ``config`` (EngineConfig,
TimeModel), ``engine`` (PagedEngine: the step loop), ``metrics``, ``rpc``, ``process``,
``openai_front`` (the process's optional OpenAI-compatible HTTP front).
"""

from kvevents.sim.config import EngineConfig, TimeModel
from kvevents.sim.engine import PagedEngine
from kvevents.sim.request import RequestResult

__all__ = ["EngineConfig", "PagedEngine", "RequestResult", "TimeModel"]
