"""The last batches applied from one publisher, as digests, to tell its stream apart from
a restarted process's.

After a reconnect or a suspicious seq jump the subscriber asks the publisher to replay
the last few seqs it applied and compares the payloads: the same process replays
byte-identical payloads; a new process that has already published past our last seq
replays different ones under the same seqs (a restart the seq numbers alone cannot
show). Payloads are compared by a 64-bit digest: that guards against accidents, not
forgery.

The ring is compiled (:class:`~kvevents.ingest._zmqrecv.DigestRing`): the lane adds to
it for every batch it delivers without the GIL, the Python path through ``add``; both
use the same digest. Not thread-safe; owned by the subscriber thread.
"""

from __future__ import annotations

from kvevents.ingest._zmqrecv import DigestRing, digest

__all__ = ["DigestRing", "digest"]
