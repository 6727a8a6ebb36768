"""The subscriber's sockets: per source a live SUB, its monitor, and (in
:mod:`kvevents.ingest.replay`) a replay DEALER, all in one poller.

Contracts it implements (see :mod:`kvevents.ingest.subscriber`):

* every socket operation is guarded: a source whose live socket cannot be opened (out
  of sockets or file descriptors) stays registered, counts ``socket_errors`` and is
  retried with capped backoff (``Subscriber._BACKOFF_MIN_S`` .. ``_BACKOFF_MAX_S``) by
  the loop's housekeeping;
* the monitor exists before connect/bind, so every connect is seen; a reconnect marks
  the stream for a continuity check (``verify``), since the publisher may be a new
  process; every connect schedules replay probes (``next_probe``, ``probe_wait``: the
  subscription is in place only once a live message arrives);
* a source's replay DEALER opens with its live socket (``ReplayClient._ensure_dealer``);
* removing a source closes all its sockets; closing never raises.

It also picks the sockets to drain on each pass of the loop (``_ready_sockets``) and
lets trickling messages gather between passes (``_gather``).

State: writes the subscriber's ``_poller``, ``_by_socket`` (socket -> (source, role))
and ``_next_full_poll``, and each source's ``sub``, ``monitor``, ``open_backoff``,
``open_retry_at``, ``next_probe``, ``probe_wait``, ``ever_connected``, ``verify`` and
``stats.connected``; reads ``_ctx``, ``_recv_hwm``, ``_max_message_bytes``,
``_sources``, ``_hot`` and ``_stop``. Runs on the
subscriber's loop thread (or, before ``start`` and after the loop thread ended, the
caller's).

A mixin of :class:`~kvevents.ingest.subscriber.Subscriber`, whose ``__init__`` sets up
the attributes used here.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvevents.ingest.gilmeter import HoldMeter
from kvevents.ingest.source import SourceState

# The subscriber's logger: its records keep the name they always had.
log = logging.getLogger("kvevents.ingest.subscriber")


class SocketSet:
    """The sockets of :class:`~kvevents.ingest.subscriber.Subscriber`."""

    _ctx: zmq.Context
    _recv_hwm: int
    _max_message_bytes: int
    _sources: dict[str, SourceState]
    _poller: zmq.Poller
    _by_socket: dict[zmq.Socket, tuple[SourceState, str]]
    _BACKOFF_MIN_S: float
    _BACKOFF_MAX_S: float
    _CONNECT_PROBE_S: float
    _hot: list[zmq.Socket]
    _next_full_poll: float
    _stop: threading.Event
    gil_holds: HoldMeter

    # Longest a socket waits for a zmq_poll while others keep the loop busy.
    _FULL_POLL_S = 0.005
    # While messages trickle in (a pass takes fewer than _GATHER_BELOW), the loop waits
    # _GATHER_S before the next pass, so each wake-up takes several: a wake-up (zmq_poll
    # returning, the GIL taken back from a busy event loop) cost more than the one
    # message it carried (a gateway routing ~1,000 requests/s, each engine publishing a
    # batch per request). A flood is drained back to back; a batch is applied at most
    # _GATHER_S later.
    _GATHER_S = 0.005
    _GATHER_BELOW = 16

    def _ready_sockets(self, timeout_ms: int) -> tuple[list[zmq.Socket], bool]:
        """The sockets to drain now, and whether ``zmq_poll`` chose them. While messages
        flow, those that had some last time are drained again without asking
        ``zmq_poll`` (which costs ~1 us per socket followed, tens of us per call: it was
        a tenth of the loop under load); every ``_FULL_POLL_S``, and as soon as a pass
        over them finds nothing, all sockets are polled (with ``timeout_ms`` to wait),
        so none waits long."""
        if not self._by_socket:
            self.gil_holds.releasing()
            time.sleep(timeout_ms / 1000)
            self.gil_holds.resumed()
            return [], True
        now = time.monotonic()
        if self._hot and now < self._next_full_poll:
            return self._hot, False
        self._next_full_poll = now + self._FULL_POLL_S
        self.gil_holds.releasing()
        try:
            return [sock for sock, _ in self._poller.poll(timeout_ms)], True
        finally:
            self.gil_holds.resumed()

    def _gather(self, handled: int) -> None:
        """After a pass that handled ``handled`` messages: a short wait if they trickle."""
        if 0 < handled < self._GATHER_BELOW:
            self.gil_holds.releasing()
            self._stop.wait(self._GATHER_S)
            self.gil_holds.resumed()

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
            sub.setsockopt(zmq.IPV6, 1)  # an engine found by its AAAA record: tcp://[::1]:PORT
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
        self._ensure_dealer(src)  # the replay socket too (see ReplayClient._ensure_dealer)
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

    def _unregister(self, sock: zmq.Socket) -> None:
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass
        self._by_socket.pop(sock, None)

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
            # The monitor reports the TCP connect; the publisher drops what it sends
            # until our subscription reaches it, a moment (or, on a busy machine, a
            # second) later. A burst in that moment followed by silence would show no
            # gap: unless a live message comes first, probe the replay endpoint then (a
            # probe already due, the first contact's, keeps its time).
            if self._can_replay(src):
                src.probe_wait = self._CONNECT_PROBE_S
                due = time.monotonic() + src.probe_wait
                src.next_probe = due if src.next_probe is None else min(src.next_probe, due)
        elif event == zmq.EVENT_DISCONNECTED:
            src.stats.connected = max(0, src.stats.connected - 1)

    def _close_all(self) -> None:
        for name in list(self._sources):
            self._remove(name)
