"""Engine-side KV offloading connector (torch lives only in this package).

One core, thin adapters::

    core:  scheduler role  OffloadingConnectorScheduler ─ CPUOffloadingManager (LRU | ARC)
                                                        └ OffloadEventsTracker ─► wire events
           worker role     OffloadingConnectorWorker ─ CPU pool + TransferHandler (CUDA | CPU thread)
    adapters:
           connector.vllm        KVEventsOffloadingConnector: vLLM 0.32 loads it (two processes)
           OffloadingConnector   both roles in one object, for a single-process engine
                                 (kvevents.sim, the demo's and benchmarks' simulated engine)
           MultiConnector        several single-process connectors behind one

Modules: ``config`` (OffloadConfig), ``kv_layout`` (KV tensor shapes), ``metadata``
(the core's step plumbing), ``base`` (the single-process connector contract),
``offload/`` (manager, policies), ``transfer/`` (copy handlers), ``events_tracker``,
``scheduler`` / ``worker`` (the two roles of the core), ``offloading_connector``,
``multi``, ``vllm`` (imports vLLM; nothing else here does).
"""

from connector.base import KVConnector
from connector.config import OffloadConfig
from connector.kv_layout import KVCacheLayout
from connector.multi import MultiConnector
from connector.offloading_connector import OffloadingConnector

__all__ = ["KVCacheLayout", "KVConnector", "MultiConnector", "OffloadConfig", "OffloadingConnector"]
