"""Subscribes to many KV event publishers and delivers their batches in seq order.

Pipeline, per publisher ("source"): SUB socket -> frame check -> seq tracking (gap,
jump and restart detection) -> optional replay over one DEALER socket per source ->
payload decode -> in-order delivery to the consumer. Contracts:

* Batches of one source reach the consumer strictly in increasing seq order, each once.
* A gap is detected before delivery. With a replay endpoint the missing batches are
  asked for and delivered in order (overlap with live batches is dropped); whatever
  replay cannot supply (no endpoint, buffer overrun, deadline) is reported as
  :class:`BatchesLost` with its size before the stream goes on. Nothing is skipped
  without a signal.
* A restart of the publisher is reported as :class:`PublisherRestarted` before any of
  the new process's batches, and the consumer must drop that source's state. It is
  detected when seq goes backwards, and by continuity: after every reconnect (seen by
  the socket monitor) and every gap, replay starts a few seqs early and the payloads are
  compared with digests of what was applied (:mod:`kvevents.ingest.continuity`); a
  mismatch is a new process that already published past our last seq.
* A seq beyond ``seq_window`` of the expected one is not believed (one bad frame must
  not count 1.8e19 lost batches): it is dropped and counted, and continuity is checked;
  only repeated jumps resync the source.
* Every replay has a deadline (``replay_timeout`` without any reply, ``replay_deadline``
  without progress): a trickling endpoint cannot freeze an engine. Held-back live messages
  are bounded in bytes (``max_pending_bytes``); an overflow is counted and becomes a gap.
* On first contact (and after a restart) a source with a replay endpoint is replayed
  from seq 0, so a consumer that starts mid-stream rebuilds the publisher's state from
  its buffer; what the buffer no longer holds is reported as lost.
* A connect is not yet a subscription: until a live message follows one, the replay
  endpoint is asked for what the publisher sent meanwhile (see :mod:`.replay`).
* A malformed message (wrong frame count, bad seq) or an undecodable payload is counted
  in :class:`SourceStats` and skipped; an undecodable payload consumes its seq without
  dropping the source's state.

Supervision: every socket operation is guarded; a failure (e.g. out of sockets or file
descriptors) is counted in ``socket_errors`` and retried with capped backoff. The loop
catches whatever a poll raises, counts it and goes on; a watchdog thread restarts the
loop thread if it ever dies (``thread_restarts``). ``heartbeat`` is the monotonic time of
the loop's last iteration, so callers can tell a stuck loop from an idle one.

Lifecycle: construct with a consumer callback -> ``add_source`` (any time) ->
``start()`` (one loop thread owns every socket, plus the watchdog) -> ``stop()`` (closes
sockets). Or drive it yourself with ``poll_once`` from a single thread. The consumer
runs on the loop thread; it must not block for long.

The lane (``lane=``, the aggregator's): a live socket's drain runs in compiled code
without the GIL (``Cursor.lane_drain`` in :mod:`kvevents.ingest._zmqrecv`), handing each
next in-order batch straight to the consumer's compiled sink, which applies it; the
first message it does not take (anything but that common case) ends the lane's drain
and goes through the Python path below, which shares the same per-source cursor (the
next drain tries the lane again; after two drains in a row whose first message was not
the lane's, the rest of such a drain goes the Python way whole). The consumer learns
what the sink applied from :class:`BatchesApplied`, at most every ``_LANE_REPORT_S``
per source and before any other signal of that source.

Here: the :class:`Subscriber` (construction, public API, loop thread, watchdog,
``poll_once``, housekeeping, the lane's drains and reports). Its mixins, run by the
loop thread: :mod:`.stream` (seq tracking), :mod:`.replay`, :mod:`.delivery`,
:mod:`.sockets`; receiving is :mod:`.drain`; the GIL-hold meter is :mod:`.gilmeter`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from kvevents.ingest.delivery import _GROUP_MAX, Delivery, PayloadDecoder  # noqa: F401  (re-exported)
from kvevents.ingest.drain import (  # noqa: F401  (some re-exported, for tests and tools)
    _DRAIN,
    _DRAIN_MAX,
    _DRAIN_MAX_BYTES,
    _NOBLOCK,
    _RCVMORE,
    _drain_compiled,
    _drain_python,
    _recv_frames,
)
from kvevents.ingest.memory import release_memory
from kvevents.ingest.replay import ReplayClient
from kvevents.ingest.gilmeter import HoldMeter
from kvevents.ingest.signals import (
    BatchesApplied,
    BatchesLost,
    BatchesReceived,
    BatchReceived,
    Consumer,
    GapDetected,
    PublisherRestarted,
    Resynced,
    Signal,
)
from kvevents.ingest.sockets import SocketSet
from kvevents.ingest.source import SourceConfig, SourceStats, SourceState
from kvevents.ingest.stream import StreamTracking
from kvevents.wire.schema import BatchDecoder, DecodeResult

log = logging.getLogger(__name__)


__all__ = [
    "BatchReceived", "BatchesApplied", "BatchesReceived", "BatchesLost", "Consumer", "GapDetected", "PublisherRestarted",
    "Resynced", "Signal", "SourceConfig", "SourceStats", "Subscriber",
]


class Subscriber(StreamTracking, ReplayClient, Delivery, SocketSet):
    """Follows many publishers; see the module docstring for the contracts."""

    # Before first contact, how often to ask a silent publisher's replay socket for
    # its history.
    _PROBE_INTERVAL_S = 1.0
    _BACKOFF_MIN_S = 0.05
    _BACKOFF_MAX_S = 5.0
    # Consecutive out-of-window seqs after which the publisher is believed: resync.
    _JUMPS_TO_RESYNC = 3
    # Release freed heap memory after this many received bytes, once idle.
    _TRIM_AFTER_BYTES = 32 << 20
    _WATCHDOG_S = 0.5
    # How often what the lane applied is reported to the consumer (BatchesApplied), per
    # source; a source's report also goes out before any other signal of it.
    _LANE_REPORT_S = 0.1

    def __init__(
        self,
        consumer: Consumer,
        *,
        replay_timeout: float = 2.0,
        replay_deadline: float = 5.0,
        seq_window: int = 1_000_000,
        max_pending_bytes: int = 32 << 20,
        recv_hwm: int = 1000,
        max_message_bytes: int = 64 << 20,
        context: zmq.Context | None = None,
        compiled_recv: bool = True,
        group_batches: bool = False,
        decoder: PayloadDecoder | None = None,
        lane: Callable[[str], object | None] | None = None,
    ) -> None:
        """``compiled_recv``: receive
        through :mod:`kvevents.ingest._zmqrecv` where it loaded (False: always through
        pyzmq; both give the same messages). ``group_batches``: deliver consecutive
        batches of one source taken in one drain of its socket as one
        :class:`BatchesReceived` instead of one :class:`BatchReceived` each (a source's
        stats then show them once they were delivered). ``decoder``: decodes each
        payload instead of a :class:`~kvevents.wire.schema.BatchDecoder` (the aggregator's,
        ``kvevents.index.IngestDecoder``, keeps common batches as bytes for the index).
        ``lane``: ``lane(source)`` gives the consumer's compiled sink for a source (a
        capsule, see ``kvevents/ingest/lane_abi.pxd``) or None; asked once per drain of
        its live socket. With a sink, that drain runs the lane: the next in-order
        batches are received, checked and applied by the sink without the GIL, the
        consumer is told by :class:`BatchesApplied`, and everything else takes the
        Python path as without it (needs the compiled drain: ``compiled_recv``)."""
        self._consumer = consumer
        self._drain = _DRAIN if compiled_recv else _drain_python
        self._lane = lane if self._drain is _drain_compiled else None
        # The loop thread's stretches of Python between two GIL releases.
        self.gil_holds = HoldMeter()
        self._group_batches = group_batches
        # Sockets that had messages in the last poll, drained again first (_ready_sockets).
        self._hot: list[zmq.Socket] = []
        self._next_full_poll = 0.0
        # The group being collected: its source, whether replayed, (seq, DecodeResult)s.
        self._group_src: SourceState | None = None
        self._group_replayed = False
        self._group: list[tuple[int, DecodeResult]] = []
        self._replay_timeout = replay_timeout
        self._replay_deadline = replay_deadline
        self._seq_window = seq_window
        self._max_pending_bytes = max_pending_bytes
        self._recv_hwm = recv_hwm
        self._max_message_bytes = max_message_bytes
        self._ctx = context or zmq.Context.instance()
        self._decoder: PayloadDecoder = decoder or BatchDecoder()
        self._sources: dict[str, SourceState] = {}
        self._poller = zmq.Poller()
        # socket -> (source, role); role is "live", "replay" or "monitor".
        self._by_socket: dict[zmq.Socket, tuple[SourceState, str]] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._final_stats: dict[str, SourceStats] | None = None
        self._bytes_since_trim = 0
        # The source whose messages the loop is handling now: if the thread dies there,
        # that source's stream position is unknown and it is resynced on restart.
        self._busy: str | None = None
        # Loop health, read from other threads (plain attribute reads are atomic).
        self.heartbeat = time.monotonic()
        self.loop_errors = 0
        self.thread_restarts = 0
        self.memory_releases = 0

    # -- control (any thread) --------------------------------------------------------

    def add_source(self, config: SourceConfig) -> None:
        """Follow a publisher. Raises ``ValueError`` if the name is taken (checked on
        the owning thread when running, so the error is then only logged)."""
        self._call(lambda: self._add(config))

    def remove_source(self, name: str, then: Callable[[], None] | None = None) -> None:
        """Stop following ``name``. ``then`` runs on the loop thread once its sockets are
        closed, when no signal of it can follow any more (a consumer drops its state
        there: batches delivered before the removal ran are dropped with it)."""
        def remove() -> None:
            self._remove(name)
            if then is not None:
                then()
        self._call(remove)

    def resync(self, name: str, reason: str) -> None:
        """Drop what is known of ``name``'s stream and rebuild it from replay seq 0
        (the consumer must drop its state when it asks for this). Queued: runs on the
        loop thread before the next poll, so it is safe to call from the consumer."""
        self._commands.put(lambda: self._resync(name, reason))

    def stats(self) -> dict[str, SourceStats]:
        """A shallow snapshot of every source's counters (kept after ``stop()``)."""
        if self._final_stats is not None:
            return self._final_stats
        return {n: s.stats.snapshot() for n, s in list(self._sources.items())}

    def disconnected(self, names: list[str]) -> set[str]:
        """``names`` not connected to their publisher now, unknown ones too (no snapshot)."""
        live = self._final_stats or {n: src.stats for n, src in list(self._sources.items())}
        return {n for n in names if (st := live.get(n)) is None or st.connected <= 0}

    def running(self) -> bool:
        """True while the loop thread is alive (False before ``start`` and after ``stop``)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._spawn()
        self._watchdog = threading.Thread(
            target=self._watch, name="kvevents-subscriber-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the loop and close every socket. Returns False if the loop thread did
        not end within ``timeout`` (its sockets are then still open)."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            if self._final_stats is None:  # the loop thread was dead: clean up here
                self._final_stats = self.stats()
                self._close_all()
        else:
            self._final_stats = self.stats()
            self._close_all()
        return True

    def _call(self, fn: Callable[[], None]) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(fn)
        else:
            fn()

    # -- the loop and its supervision ----------------------------------------------------

    def _spawn(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvevents-subscriber", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Restart the loop thread if it died (it should not: the loop catches every
        Exception; this covers BaseExceptions and interpreter-level failures)."""
        while not self._stop.wait(self._WATCHDOG_S):
            thread = self._thread
            if thread is not None and not thread.is_alive() and not self._stop.is_set():
                self.thread_restarts += 1
                log.error("subscriber thread died; restarting it (restart %d)",
                          self.thread_restarts)
                # Sockets migrate to the new thread: the old one is gone, which is the
                # full memory barrier ZeroMQ asks for.
                busy, self._busy = self._busy, None
                if busy is not None:
                    self.resync(busy, "ingest thread died while handling it")
                self._spawn()

    def _run(self) -> None:
        backoff = self._BACKOFF_MIN_S
        try:
            while not self._stop.is_set():
                try:
                    self.poll_once(50)
                    backoff = self._BACKOFF_MIN_S
                except Exception:
                    # Whatever went wrong, the other publishers must keep flowing.
                    self.loop_errors += 1
                    log.exception("subscriber loop iteration failed; retrying in %.2fs", backoff)
                    self.gil_holds.releasing()
                    self._stop.wait(backoff)
                    self.gil_holds.resumed()
                    backoff = min(backoff * 2, self._BACKOFF_MAX_S)
        finally:
            if self._stop.is_set():
                self._final_stats = self.stats()
                self._close_all()

    def poll_once(self, timeout_ms: int = 50) -> int:
        """Handle what is ready (commands, live and replay messages, deadlines, socket
        retries). Returns how many messages were handled."""
        self.heartbeat = time.monotonic()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                cmd()
            except Exception:
                log.exception("subscriber command failed")
        ready, polled = self._ready_sockets(timeout_ms)
        handled, hot = self._drain_sockets(ready)
        if not handled and not polled:
            # The busy sockets had nothing this time: ask zmq_poll about all of them,
            # waiting up to ``timeout_ms`` as callers expect.
            self._hot = []
            handled, hot = self._drain_sockets(self._ready_sockets(timeout_ms)[0])
        self._busy = None
        self._hot = hot
        self._housekeeping()
        self._flush_group()  # held-back batches a finished replay released
        self._gather(handled)
        if handled == 0 and self._bytes_since_trim >= self._TRIM_AFTER_BYTES:
            # A flood is over: give its freed buffers back to the OS.
            self._bytes_since_trim = 0
            if release_memory():
                self.memory_releases += 1
        return handled

    def _drain_sockets(self, ready: list[zmq.Socket]) -> tuple[int, list[zmq.Socket]]:
        """Drain and handle ``ready``; returns how many messages, and the sockets that
        had some."""
        handled = 0
        hot: list[zmq.Socket] = []
        for sock in ready:
            entry = self._by_socket.get(sock)
            if entry is None:
                continue
            src, role = entry
            self._busy = src.config.name
            msgs: list[list[bytes]] = []
            # The lane only where it can take the next message: not while a replay holds
            # live messages back.
            sink = (self._lane(src.config.name) if self._lane is not None and role == "live"
                    and src.replay_deadline is None else None)
            taken = 0
            try:
                if sink is not None:
                    taken = self._lane_drain(src, sock, sink, msgs)
                    if taken:
                        hot.append(sock)
                        handled += taken - len(msgs)
                else:
                    self._drain(sock, _DRAIN_MAX, _DRAIN_MAX_BYTES, msgs)  # bounded: see there
            except OSError as exc:  # what came before the error is still handled
                src.stats.socket_errors += 1
                log.warning("receive on %s socket of %s failed: %s", role, src.config.name, exc)
            if msgs:
                if sink is None:
                    hot.append(sock)
                if role != "monitor":
                    src.stats.last_received = time.time()  # once per drain, not per message
            if role == "live" and (msgs or taken) and src.next_probe is not None:
                src.next_probe, src.probe_wait = None, 0.0  # subscribed: gaps show in seqs
            # Progress is liveness: a long drain of a busy publisher is not "stuck".
            self.heartbeat = time.monotonic()
            for frames in msgs:
                handled += 1
                if role == "monitor":
                    self._on_monitor(src, frames)
                elif role == "replay":
                    self._bytes_since_trim += len(frames[-1])  # the payload
                    self._on_replay(src, frames)
                    if src.dealer is not sock:  # the source was reset mid-replay
                        break
                else:
                    self._bytes_since_trim += len(frames[-1])  # the payload
                    self._on_live(src, frames)
                if self._by_socket.get(sock) is None:  # removed while draining
                    break
            self._flush_group()
        return handled, hot

    def _lane_drain(self, src: SourceState, sock: zmq.Socket, sink: object,
                    msgs: list[list[bytes]]) -> int:
        """One drain of ``src``'s live socket through the lane (see ``lane`` in
        ``__init__``): what the sink applied is counted on the cursor, and the message
        the lane stopped at (if any) is left in ``msgs`` for the Python path. Returns
        how many messages were taken. A sink that failed is reported at once."""
        self._flush_group()  # the Python path's batches so far go first
        cursor = src.cursor
        before = cursor.lane_batches
        self.gil_holds.releasing()
        try:
            taken = cursor.lane_drain(sock.underlying, sink, _DRAIN_MAX, _DRAIN_MAX_BYTES, msgs)
        finally:
            self.gil_holds.resumed()
            if cursor.lane_batches != before:
                src.stats.last_received = time.time()  # once per drain, not per message
            if cursor.report_failed:
                self._report_lane(src)
        if cursor.lane_batches != before:
            src.lane_misses = 0
        elif msgs:
            # Not even the first message was the lane's. Once, that is usually a sink
            # that has yet to learn a new tier or block size from the Python path (it
            # does before the next drain). Twice in a row, it is a stream the sink cannot
            # take: the rest of the drain goes the Python way at once, not one lane
            # attempt per message.
            src.lane_misses += 1
            if src.lane_misses > 1:
                taken += self._drain(sock, _DRAIN_MAX - taken, _DRAIN_MAX_BYTES, msgs)
        return taken

    def _report_lane(self, src: SourceState) -> None:
        """Tell the consumer what the lane applied for ``src`` since the last report."""
        report = src.cursor.take_report()
        if report is None:
            return
        count, first, last, nbytes, failed = report
        src.reported_at = time.monotonic()
        self._bytes_since_trim += nbytes
        try:
            self._consumer(BatchesApplied(src.config.name, first, last, count, nbytes, failed))
        except Exception:
            # A consumer bug must not stop the stream of every other publisher.
            log.exception("consumer failed on BatchesApplied")

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for src in list(self._sources.values()):
            if src.cursor.pending_report and now - src.reported_at >= self._LANE_REPORT_S:
                self._report_lane(src)  # what the lane applied, due (see _LANE_REPORT_S)
            if src.sub is None:
                if now >= src.open_retry_at:
                    self._open(src)
                continue
            if src.replay_deadline is not None:
                if (now > src.replay_deadline or now > (src.replay_hard_deadline or now)
                        or now > (src.replay_cap or now)):
                    src.stats.replay_timeouts += 1
                    self._finish_replay(src, timed_out=True)
                elif not src.replay_sent and now >= src.replay_retry_at:
                    self._send_replay(src)
            elif src.next_probe is not None and now >= src.next_probe:
                self._probe(src)
            elif src.verify and src.expected is not None and self._can_replay(src):
                self._request_replay(src, src.expected)

    # -- sources -----------------------------------------------------------------------

    def _add(self, config: SourceConfig) -> None:
        if config.name in self._sources:
            raise ValueError(f"source {config.name!r} already exists")
        src = SourceState(config)
        self._sources[config.name] = src
        if not self._can_replay(src) or not config.replay_from_start:
            src.stats.initial_replay_done = True
        if config.resume_seq is not None:
            # Restored from a snapshot: continue the stream where it was left.
            src.expected = config.resume_seq
            src.stats.last_seq = config.resume_seq - 1 if config.resume_seq > 0 else None
            src.stream_high = src.stats.last_seq
            src.stats.last_batch_ts = config.resume_ts
        self._open(src)
        if config.resume_seq is not None and self._can_replay(src):
            self._request_replay(src, config.resume_seq)  # what came while we were down

