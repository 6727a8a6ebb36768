"""Seq tracking of each source's live stream: order, gaps, jumps, restarts, hold-back.

Contracts it implements (see :mod:`kvevents.ingest.subscriber`):

* a live batch is delivered only when its seq is the next expected one; a gap is
  reported (:class:`GapDetected`) before anything after it and handed to replay, or,
  without a replay endpoint, reported lost before the stream goes on;
* a seq beyond ``seq_window`` of the expected one is dropped and counted, continuity is
  checked, and only ``Subscriber._JUMPS_TO_RESYNC`` jumps in a row restart the stream;
* a seq that goes backwards (or a newer batch under an already delivered seq) is a new
  publisher process: :class:`PublisherRestarted` comes before any of its batches;
* while a replay runs, live messages are held back, bounded by ``max_pending_bytes``;
* a resync (asked by the consumer) drops the stream and rebuilds it from replay seq 0.

State: reads and writes the per-source :class:`~kvevents.ingest.source.SourceState`
(``expected``, ``live_high``, ``stream_high``, ``jump_streak``, ``verify``, ``pending``,
``pending_bytes``, ``digests``, ``stats``); reads the subscriber's ``_seq_window``,
``_max_pending_bytes`` and ``_sources``. Runs on the subscriber's loop thread only (or
the single thread driving ``poll_once``).

A mixin of :class:`~kvevents.ingest.subscriber.Subscriber`, whose ``__init__`` sets up
the attributes used here; it calls the replay client (:mod:`kvevents.ingest.replay`)
and delivery (:mod:`kvevents.ingest.delivery`) through ``self``.
"""

from __future__ import annotations

import logging

from kvevents.ingest.signals import GapDetected, PublisherRestarted, Resynced
from kvevents.ingest.source import SourceState
from kvevents.wire.framing import unpack_seq
from kvevents.wire.schema import peek_batch_ts

# The subscriber's logger: its records keep the name they always had.
log = logging.getLogger("kvevents.ingest.subscriber")


class StreamTracking:
    """The live path of :class:`~kvevents.ingest.subscriber.Subscriber`."""

    _seq_window: int
    _max_pending_bytes: int
    _sources: dict[str, SourceState]
    _JUMPS_TO_RESYNC: int

    def _on_live(self, src: SourceState, frames: list[bytes]) -> None:
        if len(frames) != 3:
            src.stats.malformed_frames += 1
            return
        try:
            seq = unpack_seq(frames[1])
        except ValueError:
            src.stats.malformed_frames += 1
            return
        if (seq == src.expected and src.replay_deadline is None
                and (src.live_high is None or seq > src.live_high)):
            # The common case, decided at once: the next seq of the stream we follow and
            # no replay under way (neither a jump nor a restart; what the checks below
            # and _accept_live conclude for it).
            src.jump_streak = 0
            src.live_high = seq
            self._deliver(src, seq, frames[2], replayed=False)
            return
        if self._is_jump(src, seq):
            src.stats.seq_jumps += 1
            src.jump_streak += 1
            log.warning("engine %s: seq %d is beyond the window of the expected %s; dropped",
                        src.config.name, seq, src.expected)
            if src.jump_streak < self._JUMPS_TO_RESYNC:
                src.verify = self._can_replay(src)  # is the stream still the one we follow?
                return
            # The publisher insists: believe it, as a new stream.
            self._restart(src, seq, "seq jump beyond the window")
        else:
            src.jump_streak = 0
            if self._is_restart(src, seq, frames[2]):
                self._restart(src, seq, "seq went backwards")
        src.live_high = seq
        self._accept_live(src, seq, frames[2])

    def _is_jump(self, src: SourceState, seq: int) -> bool:
        base = src.expected if src.expected is not None else None
        if src.live_high is not None:
            base = max(base or 0, src.live_high + 1)
        return base is not None and seq > base + self._seq_window

    @staticmethod
    def _is_restart(src: SourceState, seq: int, payload: bytes) -> bool:
        """Live seqs of one process only grow, so going backwards (or repeating) means
        a new publisher process. Before any live message was seen (history came by
        replay only), a seq below what was delivered is either a late live copy of a
        replayed batch or a new process: the new process's batches are newer."""
        if src.live_high is not None:
            return seq <= src.live_high
        if src.expected is None or seq >= src.expected:
            return False
        ts = peek_batch_ts(payload)
        last = src.stats.last_batch_ts
        return ts is not None and last is not None and ts > last

    def _restart(self, src: SourceState, seq: int, reason: str) -> None:
        """The publisher is a new process: report it, forget the old stream, keep
        held-back live messages (they are the new process's)."""
        self._flush_group()  # so stats.last_seq is the last delivered seq
        src.stats.restarts += 1
        last = src.stats.last_seq if src.live_high is None else src.live_high
        self._reset(src)
        self._emit(PublisherRestarted(src.config.name, -1 if last is None else last, seq, reason))

    def _hold(self, src: SourceState, seq: int, payload: bytes) -> None:
        """Hold a live message back while a replay runs, bounded in bytes: over the
        bound the message is dropped and counted; its seq becomes a gap later."""
        if src.pending_bytes + len(payload) > self._max_pending_bytes:
            src.stats.pending_dropped += 1
            return
        src.pending.append((seq, payload))
        src.pending_bytes += len(payload)
        src.stats.pending_bytes = src.pending_bytes
        if src.stats.replay_until is None:
            src.stats.replay_until = seq

    def _accept_live(self, src: SourceState, seq: int, payload: bytes) -> None:
        if src.replay_deadline is not None:
            self._hold(src, seq, payload)
            return
        exp = src.expected
        if exp is None:  # first contact, or just restarted
            if seq == 0 or not (self._can_replay(src) and src.config.replay_from_start):
                self._deliver(src, seq, payload, replayed=False)
                src.stats.initial_replay_done = True
                return
            src.expected = 0  # catch up on the publisher's history through replay
            self._request_replay(src, 0)
            self._hold(src, seq, payload)
            return
        if seq < exp:
            return  # already delivered by a replay that ran ahead of the live stream
        if seq == exp:
            self._deliver(src, seq, payload, replayed=False)
            return
        src.stats.gaps += 1
        self._emit(GapDetected(src.config.name, exp, seq))
        if self._can_replay(src):
            self._request_replay(src, exp)
            self._hold(src, seq, payload)
            return
        self._lose(src, exp, seq - exp, "no replay endpoint")
        self._deliver(src, seq, payload, replayed=False)

    def _reset(self, src: SourceState) -> None:
        """Forget the stream (not the live socket): a new replay starts clean."""
        self._renew_dealer(src)
        self._clear_replay(src)
        src.expected = None
        src.live_high = None
        src.stream_high = None
        src.digests.clear()
        src.verify = False
        src.jump_streak = 0

    def _resync(self, name: str, reason: str) -> None:
        src = self._sources.get(name)
        if src is None:
            return
        log.warning("engine %s: resync from seq 0 (%s)", name, reason)
        self._reset(src)
        self._emit(Resynced(name, reason))
        if self._can_replay(src):
            src.expected = 0
            self._request_replay(src, 0)
