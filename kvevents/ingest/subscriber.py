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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvevents.ingest.memory import release_memory
from kvevents.ingest.signals import (
    BatchesLost,
    BatchesReceived,
    BatchReceived,
    Consumer,
    GapDetected,
    PublisherRestarted,
    Resynced,
    Signal,
)
from kvevents.ingest.source import SourceConfig, SourceStats, SourceState
from kvevents.wire.schema import BatchDecoder, DecodeResult, PayloadError, peek_batch_ts
from kvevents.wire.framing import END_SEQ, pack_seq, parse_replay_reply, unpack_seq

log = logging.getLogger(__name__)


class PayloadDecoder(Protocol):
    """What turns a payload into a batch: :class:`~kvevents.wire.schema.BatchDecoder`'s
    ``decode`` (raises :class:`~kvevents.wire.schema.PayloadError` for a non-batch)."""

    def decode(self, payload: bytes) -> DecodeResult: ...


__all__ = [
    "BatchReceived", "BatchesReceived", "BatchesLost", "Consumer", "GapDetected", "PublisherRestarted",
    "Resynced", "Signal", "SourceConfig", "SourceStats", "Subscriber",
]


# Plain ints: pyzmq turns enum members back into enums on every call (measurable at
# tens of thousands of messages a second).
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


#: Most messages, and bytes, taken from one socket per poll: one busy publisher cannot
#: starve the others, and a flood of large messages waits in libzmq's bounded queue
#: (``recv_hwm``), not in Python memory.
_DRAIN_MAX = 1000
_DRAIN_MAX_BYTES = 4 << 20
#: Most batches in one :class:`BatchesReceived`: enough to pay a consumer's per-call
#: costs once per many batches, few enough that applying them holds the index (and the
#: GIL, inside the compiled core) for well under a millisecond, so lookups never wait
#: behind a whole drain.
_GROUP_MAX = 32


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One whole message without waiting (``zmq.Again`` when none is ready); what
    ``recv_multipart(NOBLOCK)`` does, at less cost per frame. A message's frames arrive
    together, so the later ones never block."""
    frames = [sock.recv(_NOBLOCK)]
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(_NOBLOCK))
    return frames


def _drain_python(sock: zmq.Socket, max_msgs: int, max_bytes: int,
                  out: list[list[bytes]]) -> int:
    """:func:`kvevents.ingest._zmqrecv.drain` through pyzmq's calls (the fallback)."""
    n = taken = 0
    while n < max_msgs and taken < max_bytes:
        try:
            frames = _recv_frames(sock)
        except zmq.Again:
            break
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, str(exc)) from exc
        out.append(frames)
        taken += sum(map(len, frames))
        n += 1
    return n


def _drain_compiled(sock: zmq.Socket, max_msgs: int, max_bytes: int,
                    out: list[list[bytes]]) -> int:
    return _zmqrecv.drain(sock.underlying, max_msgs, max_bytes, out)


try:
    from kvevents.ingest import _zmqrecv

    _zmqrecv.load()
    _DRAIN: Callable[[zmq.Socket, int, int, list[list[bytes]]], int] = _drain_compiled
except (ImportError, OSError) as _exc:  # not built, or no shared libzmq to borrow
    log.info("compiled ZeroMQ drain unavailable (%s); receiving through pyzmq", _exc)
    _DRAIN = _drain_python


class Subscriber:
    """Follows many publishers; see the module docstring for the contracts."""

    # Before first contact, how often to ask a silent publisher's replay socket for
    # its history.
    _PROBE_INTERVAL_S = 1.0
    _BACKOFF_MIN_S = 0.05
    # Longest a socket waits for a zmq_poll while others keep the loop busy.
    _FULL_POLL_S = 0.005
    _BACKOFF_MAX_S = 5.0
    # Consecutive out-of-window seqs after which the publisher is believed: resync.
    _JUMPS_TO_RESYNC = 3
    # Release freed heap memory after this many received bytes, once idle.
    _TRIM_AFTER_BYTES = 32 << 20
    _WATCHDOG_S = 0.5

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
    ) -> None:
        """``compiled_recv``: receive
        through :mod:`kvevents.ingest._zmqrecv` where it loaded (False: always through
        pyzmq; both give the same messages). ``group_batches``: deliver consecutive
        batches of one source taken in one drain of its socket as one
        :class:`BatchesReceived` instead of one :class:`BatchReceived` each (a source's
        stats then show them once they were delivered). ``decoder``: decodes each
        payload instead of a :class:`~kvevents.wire.schema.BatchDecoder` (the aggregator's,
        ``kvevents.index.IngestDecoder``, keeps common batches as bytes for the index)."""
        self._consumer = consumer
        self._drain = _DRAIN if compiled_recv else _drain_python
        self._group_batches = group_batches
        # Sockets that had messages in the last poll, drained again first; see
        # _ready_sockets.
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

    def remove_source(self, name: str) -> None:
        self._call(lambda: self._remove(name))

    def resync(self, name: str, reason: str) -> None:
        """Drop what is known of ``name``'s stream and rebuild it from replay seq 0
        (the consumer must drop its state when it asks for this). Queued: runs on the
        loop thread before the next poll, so it is safe to call from the consumer."""
        self._commands.put(lambda: self._resync(name, reason))

    def stats(self) -> dict[str, SourceStats]:
        """A shallow snapshot of every source's counters (kept after ``stop()``)."""
        if self._final_stats is not None:
            return self._final_stats
        return {n: SourceStats(**vars(s.stats)) for n, s in list(self._sources.items())}

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
                    self._stop.wait(backoff)
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
            try:
                self._drain(sock, _DRAIN_MAX, _DRAIN_MAX_BYTES, msgs)  # bounded: see there
            except OSError as exc:  # what came before the error is still handled
                src.stats.socket_errors += 1
                log.warning("receive on %s socket of %s failed: %s", role, src.config.name, exc)
            if msgs:
                hot.append(sock)
                if role != "monitor":
                    src.stats.last_received = time.time()  # once per drain, not per message
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

    def _ready_sockets(self, timeout_ms: int) -> tuple[list[zmq.Socket], bool]:
        """The sockets to drain now, and whether ``zmq_poll`` chose them. While messages
        flow, those that had some last time are drained again without asking
        ``zmq_poll`` (which costs ~1 us per socket followed, tens of us per call: it was
        a tenth of the loop under load); every ``_FULL_POLL_S``, and as soon as a pass
        over them finds nothing, all sockets are polled (with ``timeout_ms`` to wait),
        so none waits long."""
        if not self._by_socket:
            time.sleep(timeout_ms / 1000)
            return [], True
        now = time.monotonic()
        if self._hot and now < self._next_full_poll:
            return self._hot, False
        self._next_full_poll = now + self._FULL_POLL_S
        return [sock for sock, _ in self._poller.poll(timeout_ms)], True

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for src in list(self._sources.values()):
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
                src.next_probe = None
                if src.expected is None:
                    self._request_replay(src, 0)
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

    def _open(self, src: SourceState) -> bool:
        """Open the live SUB socket and its monitor; on failure count it and schedule
        a retry with capped backoff (the source stays registered)."""
        config = src.config
        sub = monitor = None
        try:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self._recv_hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
            # The monitor must exist before connect/bind or the first CONNECTED is missed.
            monitor = sub.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
            )
            (sub.bind if config.bind else sub.connect)(config.endpoint)
        except zmq.ZMQError as exc:
            src.stats.socket_errors += 1
            src.open_backoff = min(max(src.open_backoff * 2, self._BACKOFF_MIN_S),
                                   self._BACKOFF_MAX_S)
            src.open_retry_at = time.monotonic() + src.open_backoff
            log.warning("cannot open the live socket of %s (%s); retrying in %.2fs",
                        config.name, exc, src.open_backoff)
            self._close_quietly(monitor)
            if sub is not None:
                try:
                    sub.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._close_quietly(sub)
            return False
        src.sub, src.monitor, src.open_backoff = sub, monitor, 0.0
        self._register(sub, src, "live")
        self._register(monitor, src, "monitor")
        if self._can_replay(src) and config.replay_from_start and src.expected is None:
            # Catch up on history at once: an idle publisher may send nothing live for
            # a long time, and the batches it sent before we connected are in its buffer.
            src.next_probe = time.monotonic()
        return True

    @staticmethod
    def _close_quietly(sock: zmq.Socket | None) -> None:
        if sock is None:
            return
        try:
            sock.close(linger=0)
        except zmq.ZMQError:
            pass

    def _remove(self, name: str) -> None:
        src = self._sources.pop(name, None)
        if src is None:
            return
        self._close_dealer(src)
        if src.monitor is not None:
            self._unregister(src.monitor)
            try:
                src.sub.disable_monitor()  # type: ignore[union-attr]
            except zmq.ZMQError:
                pass
            self._close_quietly(src.monitor)
        if src.sub is not None:
            self._unregister(src.sub)
            self._close_quietly(src.sub)

    def _register(self, sock: zmq.Socket, src: SourceState, role: str) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = (src, role)

    def _on_monitor(self, src: SourceState, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # a monitor frame we cannot parse says nothing about peers
            return
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            src.stats.connected += 1
            if src.ever_connected and src.expected is not None:
                # A reconnect: the publisher may be a new process by now.
                src.verify = True
            src.ever_connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            src.stats.connected = max(0, src.stats.connected - 1)

    def _unregister(self, sock: zmq.Socket) -> None:
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass
        self._by_socket.pop(sock, None)

    def _close_all(self) -> None:
        for name in list(self._sources):
            self._remove(name)

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

    def _reset(self, src: SourceState) -> None:
        """Forget the stream (not the live socket): a new replay starts clean."""
        self._close_dealer(src)
        self._clear_replay(src)
        src.expected = None
        src.live_high = None
        src.stream_high = None
        src.digests.clear()
        src.verify = False
        src.jump_streak = 0

    # -- live path ---------------------------------------------------------------------

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

    def _restart(self, src: SourceState, seq: int, reason: str) -> None:
        """The publisher is a new process: report it, forget the old stream, keep
        held-back live messages (they are the new process's)."""
        self._flush_group()  # so stats.last_seq is the last delivered seq
        src.stats.restarts += 1
        last = src.stats.last_seq if src.live_high is None else src.live_high
        self._reset(src)
        self._emit(PublisherRestarted(src.config.name, -1 if last is None else last, seq, reason))

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

    # -- replay path ---------------------------------------------------------------------

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

    def _send_replay(self, src: SourceState) -> None:
        """Send the outstanding request on the source's one DEALER (opened on first
        use); on failure count it and let housekeeping retry before the deadline."""
        try:
            if src.dealer is None:
                dealer = self._ctx.socket(zmq.DEALER)
                try:
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
                    dealer.connect(src.config.replay_endpoint)
                except zmq.ZMQError:
                    dealer.close(linger=0)
                    raise
                src.dealer = dealer
                self._register(dealer, src, "replay")
            # DEALER talking to a ROUTER must send the empty delimiter itself.
            src.dealer.send_multipart((b"", pack_seq(src.replay_start)), flags=zmq.NOBLOCK)
            src.replay_sent = True
        except zmq.ZMQError as exc:
            src.stats.socket_errors += 1
            # A DEALER that cannot send may hold a half-sent or stale exchange: new one.
            self._close_dealer(src)
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
            # Stale replies may still be under way: the next replay gets a fresh DEALER.
            self._close_dealer(src)
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

    # -- delivery ------------------------------------------------------------------------

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
        try:
            self._consumer(signal)
        except Exception:
            # A consumer bug must not stop the stream of every other publisher.
            log.exception("consumer failed on %s", type(signal).__name__)
