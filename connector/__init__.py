"""Engine-side KV offloading connector (torch lives only in this package).

One core, one adapter::

    core:  OffloadCore (base)     the interface, in engine-step order
           CPUOffloadCore (core)  both roles in one object, for a single-process engine
                                  (kvevents.sim drives it: the demo's, tests' and
                                  benchmarks' simulated engine)
             scheduler side  OffloadPlanner ─ CPUOffloadingManager (LRU | ARC)
                                            └ OffloadEventsTracker ─► wire events
             worker side     OffloadWorker ─ CPU pool + TransferHandler (CUDA | CPU thread)
           MultiConnector (multi) several cores behind one OffloadCore
    adapter:
           connector.vllm  KVEventsOffloadingConnector: vLLM 0.32 loads it (two processes);
                           the only place vLLM's method and type names appear

Modules: ``config`` (OffloadConfig), ``kv_layout`` (KV tensor shapes, allocation),
``kv_pattern`` (deterministic KV writes and checks for a model-free engine), ``step``
(what flows between the roles per step), ``base`` (OffloadCore), ``offload/`` (manager,
policies), ``transfer/`` (copy handlers), ``events_tracker``, ``planner`` / ``worker``
(the two roles of the core), ``core``, ``multi``, ``vllm`` and ``shared_folder`` (vLLM's
``ExampleConnector`` with folders that appear whole, for prefill/decode pairs: the two
that import vLLM; nothing else here does).
"""

from connector.base import OffloadCore
from connector.config import OffloadConfig
from connector.core import CPUOffloadCore
from connector.kv_layout import KVCacheLayout
from connector.multi import MultiConnector

__all__ = ["CPUOffloadCore", "KVCacheLayout", "MultiConnector", "OffloadConfig", "OffloadCore"]
