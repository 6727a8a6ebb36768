"""The replay client: fetches missing batches from a publisher's replay endpoint.

Contracts it implements (see :mod:`kvevents.ingest.subscriber`):

* a gap, a first contact (``replay_from_start``) and a reconnect or suspicious jump
  (``verify``) are replayed over the source's one DEALER socket; replayed batches are
  delivered in seq order, overlap with what was delivered is dropped, and whatever the
  replay cannot supply is reported as :class:`BatchesLost` before the stream goes on;
* continuity: a replay starts a few seqs early and compares the payloads with the
  digests of what was applied (:mod:`kvevents.ingest.continuity`); a mismatch, or a
  buffer that ends below the newest applied seq, is a publisher restart;
* probes: the replay endpoint is asked for what the live socket has not brought, from
  ``expected`` (from 0 before first contact): at once when the live socket opens (the
  publisher's history), every ``_PROBE_INTERVAL_S`` while nobody answers, and after a
  connect that no live message has followed yet, within ``_CONNECT_PROBE_S`` of it
  (the first contact's probe may be that one) and then at doubling waits up to
  ``_CONNECT_PROBE_MAX_S`` (what a publisher sent before our subscription reached it
  was dropped on its side, and if it then goes quiet no later seq would show the
  gap); a live message ends the probes;
* every replay has a deadline (``replay_timeout`` without any reply,
  ``replay_deadline`` without progress, a hard cap of six of those); when it ends the
  live batches held back meanwhile are released through the live path.

State: reads and writes the per-source :class:`~kvevents.ingest.source.SourceState`
replay fields (``dealer``, ``replay_start``, ``replay_high``, ``replay_deadline``,
``replay_hard_deadline``, ``replay_cap``, ``replay_sent``, ``replay_retry_at``,
``next_probe``, ``probe_wait``, ``pending``, ``expected``, ``stats``);
reads the subscriber's ``_ctx``, ``_replay_timeout``, ``_replay_deadline`` and
``_max_message_bytes``. Runs on the subscriber's loop thread only (or the single
thread driving ``poll_once``); deadlines are checked by its housekeeping.

A mixin of :class:`~kvevents.ingest.subscriber.Subscriber`, whose ``__init__`` sets up
the attributes used here; it calls stream tracking (:mod:`kvevents.ingest.stream`),
delivery (:mod:`kvevents.ingest.delivery`) and the socket set
(:mod:`kvevents.ingest.sockets`) through ``self``.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from kvevents.ingest.source import SourceState
from kvevents.wire.framing import END_SEQ, pack_seq, parse_replay_reply

# The subscriber's logger: its records keep the name they always had.
log = logging.getLogger("kvevents.ingest.subscriber")


class ReplayClient:
    """The replay path of :class:`~kvevents.ingest.subscriber.Subscriber`."""

    _ctx: zmq.Context
    _replay_timeout: float
    _replay_deadline: float
    _max_message_bytes: int
    _BACKOFF_MIN_S: float
    _PROBE_INTERVAL_S: float
    # After a connect, until a live message arrives: when to probe, doubling the wait up
    # to _CONNECT_PROBE_MAX_S (see ``_probe``). A subscription lands in well under a
    # millisecond on an idle host, in a second or more on a starved one.
    _CONNECT_PROBE_S = 1.0
    _CONNECT_PROBE_MAX_S = 8.0

    @staticmethod
    def _can_replay(src: SourceState) -> bool:
        return src.config.replay_endpoint is not None

    def _request_replay(self, src: SourceState, start: int) -> None:
        """Start a replay from ``start``; when continuity can be checked, from a few
        seqs earlier so the remembered digests are compared."""
        assert src.config.replay_endpoint is not None
        oldest = src.digests.oldest()
        if oldest is not None and start > 0:
            start = min(start, oldest)
        src.verify = False
        now = time.monotonic()
        src.replay_start = start
        src.replay_high = None
        src.replay_deadline = now + self._replay_timeout
        src.replay_hard_deadline = now + self._replay_deadline
        src.replay_cap = now + 6 * self._replay_deadline
        src.replay_sent = False
        src.replay_retry_at = now
        src.stats.replaying = True
        src.stats.replay_from = src.expected if src.expected is not None else start
        src.stats.replay_requests += 1
        self._send_replay(src)

    def _probe(self, src: SourceState) -> None:
        """A probe is due (``next_probe``, set only for sources with a replay endpoint;
        no replay under way): ask for what the live socket has not brought. A connect's
        probes (``probe_wait`` set) schedule the next one at twice the wait, until it
        passes ``_CONNECT_PROBE_MAX_S``. A live message ends them (the subscriber's drain
        clears both fields): from then on a gap shows in the seqs."""
        src.next_probe = None
        if src.probe_wait:
            src.probe_wait *= 2
            if src.probe_wait <= self._CONNECT_PROBE_MAX_S:
                src.next_probe = time.monotonic() + src.probe_wait
            else:
                src.probe_wait = 0.0
        if src.expected is not None:
            self._request_replay(src, src.expected)
        elif src.config.replay_from_start:
            self._request_replay(src, 0)

    def _ensure_dealer(self, src: SourceState) -> bool:
        """Give ``src`` its one DEALER, connected to its replay endpoint, unless it has
        one; returns whether it has one. A source with a replay endpoint holds it from
        the moment its live socket opens until it is removed, and one that may carry
        stale replies is replaced at once (:meth:`_renew_dealer`), so the sockets and
        files a source costs do not depend on which replays it happened to need. A
        failure (out of sockets or files) is counted and logged, nothing is left open,
        and the next replay tries again."""
        if src.dealer is not None:
            return True
        if not self._can_replay(src):
            return False
        dealer = None
        try:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IPV6, 1)  # IPv6 replay endpoints too (IPv4 still works)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            dealer.connect(src.config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_quietly(dealer)
            src.stats.socket_errors += 1
            log.warning("cannot open the replay socket of %s (%s)", src.config.name, exc)
            return False
        src.dealer = dealer
        self._register(dealer, src, "replay")
        return True

    def _renew_dealer(self, src: SourceState) -> None:
        """Replace ``src``'s DEALER: stale replies may still be under way to it."""
        self._close_dealer(src)
        self._ensure_dealer(src)

    def _send_replay(self, src: SourceState) -> None:
        """Send the outstanding request on the source's one DEALER (opened if it has
        none); on failure count it and let housekeeping retry before the deadline."""
        if not self._ensure_dealer(src):
            src.replay_retry_at = time.monotonic() + self._BACKOFF_MIN_S * 4
            return
        try:
            # DEALER talking to a ROUTER must send the empty delimiter itself.
            src.dealer.send_multipart((b"", pack_seq(src.replay_start)), flags=zmq.NOBLOCK)
            src.replay_sent = True
        except zmq.ZMQError as exc:
            src.stats.socket_errors += 1
            # A DEALER that cannot send may hold a half-sent or stale exchange: new one.
            self._renew_dealer(src)
            src.replay_retry_at = time.monotonic() + self._BACKOFF_MIN_S * 4
            log.warning("replay request of %s failed (%s); retrying", src.config.name, exc)

    def _on_replay(self, src: SourceState, frames: list[bytes]) -> None:
        reply = parse_replay_reply(frames)
        if reply is None:
            src.stats.malformed_frames += 1
            return
        seq, payload = reply
        if src.replay_deadline is None:
            return  # a late reply to a replay that already ended
        if seq == END_SEQ:
            # The current stream's newest seq, not stats.last_seq: after a restart that
            # is the old process's, and a new process's still empty buffer would then
            # look like yet another restart, again and again.
            last = src.stream_high
            if (last is not None and src.expected is not None and src.replay_start <= last
                    and (src.replay_high is None or src.replay_high < last)):
                # The same process always still holds the newest batch we applied; a
                # buffer that ends below it belongs to a new process.
                self._continuity_broken(src, last)
                return
            self._finish_replay(src, timed_out=False)
            return
        now = time.monotonic()
        src.replay_deadline = now + self._replay_timeout  # the endpoint is alive
        src.replay_high = seq if src.replay_high is None else max(src.replay_high, seq)
        exp = src.expected if src.expected is not None else 0
        if seq < exp:
            verdict = src.digests.check(seq, payload)
            if verdict is True:
                src.stats.continuity_checks += 1
            elif verdict is False:
                self._continuity_broken(src, seq)
            return  # overlap with what was already delivered
        # Progress (not stale overlap) keeps the replay's deadline alive.
        src.replay_hard_deadline = now + self._replay_deadline
        if seq > exp:
            self._lose(src, exp, seq - exp, "not in the publisher's replay buffer")
        src.stats.replayed_batches += 1
        self._deliver(src, seq, payload, replayed=True)

    def _continuity_broken(self, src: SourceState, seq: int) -> None:
        """A replayed batch differs from the one we applied under the same seq: the
        publisher is a new process. Drop the old stream and replay the new one from 0,
        keeping the live messages held back (they are the new process's)."""
        src.stats.continuity_mismatches += 1
        log.warning("engine %s: replayed seq %d differs from the batch applied: publisher "
                    "restarted; rebuilding from seq 0", src.config.name, seq)
        pending, pending_bytes = src.pending, src.pending_bytes
        self._restart(src, seq, "continuity mismatch")
        src.pending, src.pending_bytes = pending, pending_bytes
        src.stats.pending_bytes = pending_bytes
        src.stats.replay_until = pending[0][0] if pending else None
        src.expected = 0
        self._request_replay(src, 0)

    def _clear_replay(self, src: SourceState) -> None:
        src.replay_deadline = src.replay_hard_deadline = src.replay_cap = None
        src.replay_sent = False
        src.pending = deque()
        src.pending_bytes = 0
        src.stats.pending_bytes = 0
        src.stats.replaying = False
        src.stats.replay_from = src.stats.replay_until = None

    def _finish_replay(self, src: SourceState, *, timed_out: bool) -> None:
        """End the outstanding replay and release the live batches held back.

        The replay was asked for after the first held batch had been published, so
        anything still missing before it is not in the publisher's buffer: lost. Later
        gaps among the held batches go through the live path again (and may start a
        new replay), unless the replay timed out, in which case they are lost too so a
        dead or trickling replay endpoint cannot stall the stream.
        """
        if timed_out:
            # Stale replies may still be under way to this DEALER: a fresh one now.
            self._renew_dealer(src)
        self._flush_group()  # so stats.last_seq is the last delivered seq
        pending = src.pending
        self._clear_replay(src)
        if timed_out and src.expected is None and not pending:
            # A history probe that nobody answered (publisher not up yet): try again.
            src.next_probe = time.monotonic() + self._PROBE_INTERVAL_S
            return
        if timed_out and src.expected == 0 and not pending and src.stats.last_seq is None:
            # First contact with a silent publisher: nothing to lose yet; probe again.
            src.expected = None
            src.next_probe = time.monotonic() + self._PROBE_INTERVAL_S
            return
        src.stats.initial_replay_done = True
        reason = "replay timed out" if timed_out else "not in the publisher's replay buffer"
        for i, (seq, payload) in enumerate(pending):
            exp = src.expected if src.expected is not None else 0
            if src.replay_deadline is not None:
                self._hold(src, seq, payload)  # a new replay is under way
            elif seq < exp:
                continue
            elif seq > exp and (i == 0 or timed_out):
                self._lose(src, exp, seq - exp, reason)
                self._deliver(src, seq, payload, replayed=False)
            else:
                self._accept_live(src, seq, payload)

    def _close_dealer(self, src: SourceState) -> None:
        if src.dealer is not None:
            self._unregister(src.dealer)
            self._close_quietly(src.dealer)
            src.dealer = None
