"""Engine-side KV offloading connector (torch lives only in this package).

Pipeline::

    engine step ─► OffloadingConnector
                     ├ scheduler: CPUOffloadingManager (LRU | ARC) ─► OffloadEventsTracker ─► wire events
                     └ worker:    CPU pool + TransferHandler (CUDA streams | CPU thread)

Modules: ``config`` (OffloadConfig), ``kv_layout`` (KV tensor shapes), ``metadata``
(step plumbing), ``base`` (KVConnector interface), ``offload/`` (manager, policies),
``transfer/`` (copy handlers), ``events_tracker``, ``scheduler`` / ``worker`` (the two
roles), ``offloading_connector``, ``multi`` (MultiConnector), ``engine/`` (a paged-KV
engine driving all of it).
"""

from connector.base import KVConnector
from connector.config import OffloadConfig
from connector.kv_layout import KVCacheLayout
from connector.multi import MultiConnector
from connector.offloading_connector import OffloadingConnector

__all__ = ["KVCacheLayout", "KVConnector", "MultiConnector", "OffloadConfig", "OffloadingConnector"]
