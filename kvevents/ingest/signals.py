"""What the subscriber tells its consumer, per source, in stream order.

Contract for a consumer: apply :class:`BatchReceived` (and :class:`BatchesReceived`,
several consecutive batches in one signal, from a subscriber built with
``group_batches=True``) in the order given; on
:class:`PublisherRestarted`, :class:`BatchesLost` and :class:`Resynced` drop that
source's state (what follows rebuilds it); :class:`GapDetected` is informational (the
gap is being replayed); :class:`BatchesApplied` reports what the consumer's own sink
applied through the lane (only for a subscriber given ``lane=``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvevents.wire.schema import KVEventBatch


@dataclass(frozen=True, slots=True)
class BatchReceived:
    source: str
    seq: int
    batch: KVEventBatch
    replayed: bool = False
    skipped_events: int = 0  # events of this batch that could not be decoded


@dataclass(frozen=True, slots=True)
class BatchesReceived:
    """Consecutive batches of one source, ``seqs[i]`` for ``batches[i]``, increasing:
    exactly what one :class:`BatchReceived` each would say, in one call, so a consumer
    pays its per-call costs (locks, metrics, feeds) once per drain of the socket, not
    once per batch. Never empty."""

    source: str
    seqs: list[int]
    batches: list[KVEventBatch]
    replayed: bool = False
    skipped_events: int = 0  # events of these batches that could not be decoded


@dataclass(frozen=True, slots=True)
class BatchesApplied:
    """Consecutive live batches ``first_seq``..``last_seq`` (``count`` of them) of one
    source that the consumer's own compiled sink already applied (the lane: see
    ``Subscriber(lane=...)``); the consumer only observes them (feeds, errors). Sent at
    most every ``Subscriber._LANE_REPORT_S`` per source, and always before any other
    signal of that source. ``failed``: the sink failed on ``last_seq`` part way (its
    exception is the sink's to report); the consumer must rebuild the source."""

    source: str
    first_seq: int
    last_seq: int
    count: int
    payload_bytes: int
    failed: bool = False


@dataclass(frozen=True, slots=True)
class GapDetected:
    source: str
    expected_seq: int
    received_seq: int


@dataclass(frozen=True, slots=True)
class BatchesLost:
    """``count`` batches from ``first_seq`` on will never arrive; resync that source."""

    source: str
    first_seq: int
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    source: str
    last_seq: int
    new_seq: int
    reason: str = "seq went backwards"


@dataclass(frozen=True, slots=True)
class Resynced:
    """The consumer asked for a resync (:meth:`Subscriber.resync`): drop the source's
    state now; a replay from seq 0 follows when the source has a replay endpoint."""

    source: str
    reason: str


Signal = (BatchReceived | BatchesReceived | BatchesApplied | GapDetected | BatchesLost
          | PublisherRestarted | Resynced)
Consumer = Callable[[Signal], None]
