"""Subscribes to many KV event publishers and delivers their batches in seq order.

Pipeline, per publisher ("source"): SUB socket -> frame check -> payload decode ->
seq tracking (gap / restart detection) -> optional replay over a DEALER socket ->
in-order delivery to the consumer. Contracts:

* Batches of one source reach the consumer strictly in increasing seq order, each once.
* A gap is detected before delivery. With a replay endpoint the missing batches are
  asked for and delivered in order (overlap with live batches is dropped); whatever
  replay cannot supply (no endpoint, buffer overrun, timeout) is reported as
  :class:`BatchesLost` with its size before the stream goes on. Nothing is skipped
  without a signal.
* A seq that goes backwards means the publisher restarted: :class:`PublisherRestarted`
  comes first, and the consumer must drop that source's state.
* On first contact (and after a restart) a source with a replay endpoint is replayed
  from seq 0, so a consumer that starts mid-stream rebuilds the publisher's state from
  its buffer; what the buffer no longer holds is reported as lost.
* A malformed message (wrong frame count, bad seq, undecodable payload) is counted in
  :class:`SourceStats` and skipped; the loop never dies on input.

Lifecycle: construct with a consumer callback -> ``add_source`` (any time) ->
``start()`` (one daemon thread owns every socket) -> ``stop()`` (closes sockets in the
thread's ``finally``). Or drive it yourself with ``poll_once`` from a single thread.
The consumer runs on the subscriber thread; it must not block for long.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvevents.schema import BatchDecoder, KVEventBatch, PayloadError, peek_batch_ts
from kvevents.transport import END_SEQ, pack_seq, unpack_seq, validate_endpoint

log = logging.getLogger(__name__)


# -- signals delivered to the consumer ------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchReceived:
    source: str
    seq: int
    batch: KVEventBatch
    replayed: bool = False
    skipped_events: int = 0  # events of this batch that could not be decoded


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


Signal = BatchReceived | GapDetected | BatchesLost | PublisherRestarted
Consumer = Callable[[Signal], None]


@dataclass(frozen=True)
class SourceConfig:
    """One publisher to follow. ``replay_endpoint`` enables gap recovery."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False  # bind the SUB socket (publishers connect to us)
    replay_from_start: bool = True  # replay from seq 0 on first contact / restart
    # Resume a stream whose batches up to ``resume_seq - 1`` the consumer already holds
    # (restored from a snapshot): the next expected seq, and the publisher timestamp of
    # batch ``resume_seq - 1`` (a later live seq below ``resume_seq`` with a newer
    # timestamp is then a restart, not a stale copy).
    resume_seq: int | None = None
    resume_ts: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("source name must not be empty")
        validate_endpoint(self.endpoint)
        if self.replay_endpoint is not None:
            validate_endpoint(self.replay_endpoint)


@dataclass
class SourceStats:
    """Counters of one source; written by the subscriber thread only."""

    batches: int = 0
    replayed_batches: int = 0
    gaps: int = 0
    lost_batches: int = 0
    restarts: int = 0
    malformed_frames: int = 0
    decode_errors: int = 0
    skipped_events: int = 0
    replay_requests: int = 0
    replay_timeouts: int = 0
    last_seq: int | None = None
    last_batch_ts: float | None = None  # publisher timestamp of the last batch
    last_received: float | None = None  # time.time() of the last message
    connected: int = 0  # live-socket peers connected now (from the socket monitor)


@dataclass
class _Source:
    config: SourceConfig
    sub: zmq.Socket
    stats: SourceStats = field(default_factory=SourceStats)
    expected: int | None = None  # next seq to deliver; None before first contact
    dealer: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    live_high: int | None = None  # highest seq seen on the live socket
    next_probe: float | None = None  # when to ask for history before first contact
    replay_deadline: float | None = None  # set while a replay is outstanding
    pending: list[tuple[int, bytes]] = field(default_factory=list)  # live, held back


class Subscriber:
    """Follows many publishers; see the module docstring for the contracts."""

    # Before first contact, how often to ask a silent publisher's replay socket for
    # its history.
    _PROBE_INTERVAL_S = 1.0

    def __init__(
        self,
        consumer: Consumer,
        *,
        replay_timeout: float = 2.0,
        context: zmq.Context | None = None,
    ) -> None:
        self._consumer = consumer
        self._replay_timeout = replay_timeout
        self._ctx = context or zmq.Context.instance()
        self._decoder = BatchDecoder()
        self._sources: dict[str, _Source] = {}
        self._poller = zmq.Poller()
        # socket -> (source, role); role is "live", "replay" or "monitor".
        self._by_socket: dict[zmq.Socket, tuple[_Source, str]] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final_stats: dict[str, SourceStats] | None = None

    # -- control (any thread) --------------------------------------------------------

    def add_source(self, config: SourceConfig) -> None:
        """Follow a publisher. Raises ``ValueError`` if the name is taken (checked on
        the owning thread when running, so the error is then only logged)."""
        self._call(lambda: self._add(config))

    def remove_source(self, name: str) -> None:
        self._call(lambda: self._remove(name))

    def stats(self) -> dict[str, SourceStats]:
        """A shallow snapshot of every source's counters (kept after ``stop()``)."""
        if self._final_stats is not None:
            return self._final_stats
        return {n: SourceStats(**vars(s.stats)) for n, s in list(self._sources.items())}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvevents-subscriber", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._final_stats = self.stats()
            self._close_all()

    def _call(self, fn: Callable[[], None]) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(fn)
        else:
            fn()

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once(50)
        except Exception:
            log.exception("subscriber loop failed")
            raise
        finally:
            self._final_stats = self.stats()
            self._close_all()

    def poll_once(self, timeout_ms: int = 50) -> int:
        """Handle what is ready (commands, live and replay messages, replay timeouts).
        Returns how many messages were handled."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                cmd()
            except Exception:
                log.exception("subscriber command failed")
        handled = 0
        events = dict(self._poller.poll(timeout_ms)) if self._by_socket else {}
        if not self._by_socket:
            time.sleep(timeout_ms / 1000)
        for sock in events:
            entry = self._by_socket.get(sock)
            if entry is None:
                continue
            src, role = entry
            # Bounded drain per socket so one busy publisher cannot starve the others.
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                if role == "monitor":
                    self._on_monitor(src, frames)
                elif role == "replay":
                    self._on_replay(src, frames)
                    if src.dealer is not sock:  # replay finished and socket closed
                        break
                else:
                    self._on_live(src, frames)
        now = time.monotonic()
        for src in list(self._sources.values()):
            if src.replay_deadline is not None and now > src.replay_deadline:
                src.stats.replay_timeouts += 1
                self._finish_replay(src, timed_out=True)
            elif src.next_probe is not None and now >= src.next_probe:
                src.next_probe = None
                if src.expected is None and src.replay_deadline is None:
                    self._request_replay(src, 0)
        return handled

    # -- sources -----------------------------------------------------------------------

    def _add(self, config: SourceConfig) -> None:
        if config.name in self._sources:
            raise ValueError(f"source {config.name!r} already exists")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
        src = _Source(config, sub)
        # The monitor must exist before connect/bind or the first CONNECTED is missed.
        src.monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        try:
            (sub.bind if config.bind else sub.connect)(config.endpoint)
        except zmq.ZMQError:
            sub.disable_monitor()
            src.monitor.close(linger=0)
            sub.close(linger=0)
            raise
        self._sources[config.name] = src
        self._register(sub, src, "live")
        self._register(src.monitor, src, "monitor")
        if config.resume_seq is not None:
            src.expected = config.resume_seq
            src.stats.last_seq = config.resume_seq - 1 if config.resume_seq > 0 else None
            src.stats.last_batch_ts = config.resume_ts
            if self._can_replay(src):
                self._request_replay(src, config.resume_seq)  # what came while we were down
        elif self._can_replay(src) and config.replay_from_start:
            # Catch up on history at once: an idle publisher may send nothing live for
            # a long time, and the batches it sent before we connected are in its buffer.
            src.next_probe = time.monotonic()

    def _remove(self, name: str) -> None:
        src = self._sources.pop(name, None)
        if src is None:
            return
        self._close_dealer(src)
        if src.monitor is not None:
            self._unregister(src.monitor)
            src.sub.disable_monitor()
            src.monitor.close(linger=0)
        self._unregister(src.sub)
        src.sub.close(linger=0)

    def _register(self, sock: zmq.Socket, src: _Source, role: str) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = (src, role)

    @staticmethod
    def _on_monitor(src: _Source, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # a monitor frame we cannot parse says nothing about peers
            return
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            src.stats.connected += 1
        elif event == zmq.EVENT_DISCONNECTED:
            src.stats.connected = max(0, src.stats.connected - 1)

    def _unregister(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        self._by_socket.pop(sock, None)

    def _close_all(self) -> None:
        for name in list(self._sources):
            self._remove(name)

    # -- live path ---------------------------------------------------------------------

    def _on_live(self, src: _Source, frames: list[bytes]) -> None:
        src.stats.last_received = time.time()
        if len(frames) != 3:
            src.stats.malformed_frames += 1
            return
        try:
            seq = unpack_seq(frames[1])
        except ValueError:
            src.stats.malformed_frames += 1
            return
        if self._is_restart(src, seq, frames[2]):
            src.stats.restarts += 1
            self._close_dealer(src)
            src.replay_deadline = None
            src.pending = []
            last = src.stats.last_seq if src.live_high is None else src.live_high
            self._emit(PublisherRestarted(src.config.name, -1 if last is None else last, seq))
            src.expected = None
        src.live_high = seq
        self._accept_live(src, seq, frames[2])

    @staticmethod
    def _is_restart(src: _Source, seq: int, payload: bytes) -> bool:
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

    def _accept_live(self, src: _Source, seq: int, payload: bytes) -> None:
        if src.replay_deadline is not None:
            src.pending.append((seq, payload))
            return
        exp = src.expected
        if exp is None:  # first contact, or just restarted
            if seq == 0 or not (self._can_replay(src) and src.config.replay_from_start):
                self._deliver(src, seq, payload, replayed=False)
                return
            src.expected = 0  # catch up on the publisher's history through replay
            src.pending.append((seq, payload))
            self._request_replay(src, 0)
            return
        if seq < exp:
            return  # already delivered by a replay that ran ahead of the live stream
        if seq == exp:
            self._deliver(src, seq, payload, replayed=False)
            return
        src.stats.gaps += 1
        self._emit(GapDetected(src.config.name, exp, seq))
        if self._can_replay(src):
            src.pending.append((seq, payload))
            self._request_replay(src, exp)
            return
        self._lose(src, exp, seq - exp, "no replay endpoint")
        self._deliver(src, seq, payload, replayed=False)

    # -- replay path ---------------------------------------------------------------------

    @staticmethod
    def _can_replay(src: _Source) -> bool:
        return src.config.replay_endpoint is not None

    def _request_replay(self, src: _Source, start: int) -> None:
        assert src.config.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(src.config.replay_endpoint)
        # DEALER talking to a ROUTER must send the empty delimiter itself.
        dealer.send_multipart((b"", pack_seq(start)))
        src.dealer = dealer
        src.replay_deadline = time.monotonic() + self._replay_timeout
        src.stats.replay_requests += 1
        self._register(dealer, src, "replay")

    def _on_replay(self, src: _Source, frames: list[bytes]) -> None:
        # Current: [b"", topic, seq, payload]; older: [b"", seq, payload].
        if len(frames) == 4 and frames[0] == b"":
            seq_frame, payload = frames[2], frames[3]
        elif len(frames) == 3 and frames[0] == b"":
            seq_frame, payload = frames[1], frames[2]
        else:
            src.stats.malformed_frames += 1
            return
        try:
            seq = unpack_seq(seq_frame)
        except ValueError:
            src.stats.malformed_frames += 1
            return
        if seq == END_SEQ:
            self._finish_replay(src, timed_out=False)
            return
        # Replay keeps the deadline alive while data flows.
        src.replay_deadline = time.monotonic() + self._replay_timeout
        exp = src.expected if src.expected is not None else 0
        if seq < exp:
            return  # overlap with what was already delivered
        if seq > exp:
            self._lose(src, exp, seq - exp, "not in the publisher's replay buffer")
        src.stats.replayed_batches += 1
        self._deliver(src, seq, payload, replayed=True)

    def _finish_replay(self, src: _Source, *, timed_out: bool) -> None:
        """End the outstanding replay and release the live batches held back.

        The replay was asked for after the first held batch had been published, so
        anything still missing before it is not in the publisher's buffer: lost. Later
        gaps among the held batches go through the live path again (and may start a
        new replay), unless the replay timed out, in which case they are lost too so a
        dead replay endpoint cannot stall the stream.
        """
        self._close_dealer(src)
        src.replay_deadline = None
        if timed_out and src.expected is None and not src.pending:
            # A history probe that nobody answered (publisher not up yet): try again.
            src.next_probe = time.monotonic() + self._PROBE_INTERVAL_S
            return
        pending, src.pending = src.pending, []
        reason = "replay timed out" if timed_out else "not in the publisher's replay buffer"
        for i, (seq, payload) in enumerate(pending):
            exp = src.expected if src.expected is not None else 0
            if src.replay_deadline is not None:
                src.pending.append((seq, payload))  # a new replay is under way
            elif seq < exp:
                continue
            elif seq > exp and (i == 0 or timed_out):
                self._lose(src, exp, seq - exp, reason)
                self._deliver(src, seq, payload, replayed=False)
            else:
                self._accept_live(src, seq, payload)

    def _close_dealer(self, src: _Source) -> None:
        if src.dealer is not None:
            self._unregister(src.dealer)
            src.dealer.close(linger=0)
            src.dealer = None

    # -- delivery ------------------------------------------------------------------------

    def _lose(self, src: _Source, first: int, count: int, reason: str) -> None:
        src.stats.lost_batches += count
        src.expected = first + count
        self._emit(BatchesLost(src.config.name, first, count, reason))

    def _deliver(self, src: _Source, seq: int, payload: bytes, *, replayed: bool) -> None:
        src.expected = seq + 1
        src.stats.last_seq = seq
        src.stats.last_received = time.time()
        try:
            result = self._decoder.decode(payload)
        except PayloadError:
            # The seq was consumed, so the batch is gone: that is a loss, not a gap.
            src.stats.decode_errors += 1
            self._emit(BatchesLost(src.config.name, seq, 1, "undecodable payload"))
            src.stats.lost_batches += 1
            return
        src.stats.batches += 1
        src.stats.last_batch_ts = result.batch.ts
        if result.skipped_events:
            src.stats.skipped_events += result.skipped_events
        self._emit(BatchReceived(src.config.name, seq, result.batch, replayed, result.skipped_events))

    def _emit(self, signal: Signal) -> None:
        try:
            self._consumer(signal)
        except Exception:
            # A consumer bug must not stop the stream of every other publisher.
            log.exception("consumer failed on %s", type(signal).__name__)
