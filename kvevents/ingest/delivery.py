"""Delivery: decode each in-order batch and hand it, or a signal, to the consumer.

Contracts it implements (see :mod:`kvevents.ingest.subscriber`):

* what reaches :meth:`_deliver` is the next seq of its source: it is decoded and given
  to the consumer once, in order (:class:`BatchReceived`, or with ``group_batches``
  consecutive batches of one source from one drain as one :class:`BatchesReceived` of
  at most ``_GROUP_MAX``); every other signal is emitted after the batches collected
  before it;
* an undecodable payload is counted and skipped; its seq is consumed;
* a loss is reported as :class:`BatchesLost` with its size; a count beyond
  ``seq_window`` is not believed and is reported as one window (a resync);
* a consumer that raises is logged; the stream of every publisher goes on.

State: writes each source's ``expected``, ``stream_high``, ``digests`` and delivery
counters (``last_seq``, ``batches``, ``last_batch_ts``, ``skipped_events``,
``decode_errors``, ``lost_batches``); owns the group being collected (``_group``,
``_group_src``, ``_group_replayed``); reads ``_consumer``, ``_decoder``,
``_group_batches`` and ``_seq_window``. Runs on the subscriber's loop thread only (or
the single thread driving ``poll_once``); the consumer runs there too.

A mixin of :class:`~kvevents.ingest.subscriber.Subscriber`, whose ``__init__`` sets up
the attributes used here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvevents.ingest.signals import BatchesLost, BatchesReceived, BatchReceived, Consumer, Signal
from kvevents.ingest.source import SourceState
from kvevents.wire.schema import DecodeResult, PayloadError

# The subscriber's logger: its records keep the name they always had.
log = logging.getLogger("kvevents.ingest.subscriber")

#: Most batches in one :class:`BatchesReceived`: enough to pay a consumer's per-call
#: costs once per many batches, few enough that applying them holds the index (and the
#: GIL, inside the compiled core) for well under a millisecond, so lookups never wait
#: behind a whole drain.
_GROUP_MAX = 32


class PayloadDecoder(Protocol):
    """What turns a payload into a batch: :class:`~kvevents.wire.schema.BatchDecoder`'s
    ``decode`` (raises :class:`~kvevents.wire.schema.PayloadError` for a non-batch)."""

    def decode(self, payload: bytes) -> DecodeResult: ...


class Delivery:
    """The delivery end of :class:`~kvevents.ingest.subscriber.Subscriber`."""

    _consumer: Consumer
    _decoder: PayloadDecoder
    _group_batches: bool
    _group_src: SourceState | None
    _group_replayed: bool
    _group: list[tuple[int, DecodeResult]]
    _seq_window: int
    _lane: object | None
    _sources: dict[str, SourceState]

    _report_lane: Callable[[SourceState], None]  # the Subscriber's

    def _lose(self, src: SourceState, first: int, count: int, reason: str) -> None:
        if count > self._seq_window:
            # Not a believable number of batches: a resync, counted as one window.
            reason = f"{reason}; seq jump of {count} beyond the window, resync"
            count = self._seq_window
            src.stats.seq_jumps += 1
        src.stats.lost_batches += count
        src.expected = first + count
        self._emit(BatchesLost(src.config.name, first, count, reason))

    def _deliver(self, src: SourceState, seq: int, payload: bytes, *, replayed: bool) -> None:
        src.expected = seq + 1
        src.stream_high = seq
        src.digests.add(seq, payload)
        try:
            result = self._decoder.decode(payload)
        except PayloadError as exc:
            # Counted and skipped: the seq is consumed and the rest of the engine's state
            # stays valid (an undecodable batch is not a gap in what we can vouch for).
            self._flush_group()  # what came before it is delivered first
            src.stats.last_seq = seq
            src.stats.decode_errors += 1
            log.warning("engine %s: undecodable payload at seq %d skipped: %s",
                        src.config.name, seq, exc)
            return
        if self._group_batches:
            if self._group and (self._group_src is not src or self._group_replayed != replayed):
                self._flush_group()
            self._group_src = src
            self._group_replayed = replayed
            self._group.append((seq, result))
            if len(self._group) >= _GROUP_MAX:
                self._flush_group()
            return
        src.stats.last_seq = seq
        src.stats.batches += 1
        src.stats.last_batch_ts = result.batch.ts
        if result.skipped_events:
            src.stats.skipped_events += result.skipped_events
        self._emit(BatchReceived(src.config.name, seq, result.batch, replayed, result.skipped_events))

    def _flush_group(self) -> None:
        """Deliver the collected group (if any) as one :class:`BatchesReceived`, then
        show it in the source's stats (so "last_seq reached" means "applied")."""
        group = self._group
        if not group:
            return
        src = self._group_src
        assert src is not None
        self._group = []
        self._group_src = None
        skipped = sum(r.skipped_events for _, r in group)
        self._emit(BatchesReceived(src.config.name, [q for q, _ in group],
                                   [r.batch for _, r in group], self._group_replayed, skipped),
                   flush=False)
        stats = src.stats
        stats.last_seq = group[-1][0]
        stats.batches += len(group)
        stats.last_batch_ts = group[-1][1].batch.ts
        stats.skipped_events += skipped

    def _emit(self, signal: Signal, *, flush: bool = True) -> None:
        if flush and self._group:
            self._flush_group()  # every signal after the batches collected before it
        if self._lane is not None:
            src = self._sources.get(signal.source)
            if src is not None and src.cursor.pending_report:
                self._report_lane(src)  # ... and after what the lane applied before it
        try:
            self._consumer(signal)
        except Exception:
            # A consumer bug must not stop the stream of every other publisher.
            log.exception("consumer failed on %s", type(signal).__name__)
