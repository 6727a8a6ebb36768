"""Publishers of KV event batches: a never-blocking ZeroMQ publisher and a null one.

Lifecycle of :class:`ZmqEventPublisher`: construct (sockets are bound or connected by
its thread before the constructor returns; a bad endpoint raises there) -> ``publish()``
any number of times from any thread -> ``shutdown(timeout)`` once, which sends what is
queued within the timeout and closes the sockets.

``publish()`` never waits: it stamps the batch with the next seq and appends it to a
bounded queue. When the queue is full the batch is dropped and counted; its seq is
consumed anyway, so consumers see a gap at the next batch, ask for a replay, learn that
the gap cannot be filled and count the loss (nothing is lost silently). This is the
one deliberate difference from vLLM's publisher, whose blocking ``Queue.put()`` stalls
the engine step when the queue is full.

One daemon thread owns both sockets (ZeroMQ sockets are not thread-safe): it encodes,
sends on the PUB socket, keeps the last ``buffer_steps`` encoded batches for replay and
answers replay requests on the optional ROUTER socket.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import zmq

from kvevents.wire.schema import BatchEncoder, KVEventBatch
from kvevents.wire.framing import (
    offset_endpoint,
    pack_seq,
    replay_end_marker,
    should_bind,
    unpack_seq,
    validate_endpoint,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherStats:
    """Counters of one publisher (a snapshot; safe to read from any thread)."""

    published: int  # batches accepted by publish()
    sent: int  # batches handed to the PUB socket
    dropped: int  # batches dropped because the queue was full
    replay_requests: int
    replayed: int  # batches re-sent through the replay socket
    queued: int
    next_seq: int


class EventPublisher(ABC):
    """What an engine publishes through. Implementations never block the caller."""

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch``; True if accepted, False if dropped (and counted)."""

    @abstractmethod
    def shutdown(self, timeout: float = 2.0) -> None:
        """Flush what is queued within ``timeout`` seconds, then release resources."""

    def stats(self) -> PublisherStats:
        return PublisherStats(0, 0, 0, 0, 0, 0, 0)


class NullEventPublisher(EventPublisher):
    """Publishes nothing: lets callers publish unconditionally when events are off."""

    def publish(self, batch: KVEventBatch) -> bool:
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        return None


@dataclass(frozen=True)
class PublisherConfig:
    """Settings of :class:`ZmqEventPublisher`, validated on construction.

    ``endpoint`` / ``replay_endpoint`` follow vLLM's rule: bind for ``*``, ``::``,
    ``ipc://`` and ``inproc://``, otherwise connect (to a binding subscriber). With a
    ``data_parallel_rank`` both endpoints are offset (tcp port + rank).
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    data_parallel_rank: int | None = None
    legacy_encoding: bool = False
    # None: vLLM's rule above. True/False force bind/connect, e.g. to bind one
    # interface only (tcp://127.0.0.1:5557), which vLLM's rule would connect to.
    bind: bool | None = None

    def __post_init__(self) -> None:
        validate_endpoint(self.endpoint)
        if self.replay_endpoint is not None:
            validate_endpoint(self.replay_endpoint)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class ZmqEventPublisher(EventPublisher):
    """Publishes batches on a ZeroMQ PUB socket with an optional ROUTER replay socket."""

    # How long the socket thread waits on an empty queue before checking the replay
    # socket again: bounds replay latency without spinning.
    _IDLE_WAIT_S = 0.005

    def __init__(self, config: PublisherConfig | None = None, **kwargs: object) -> None:
        self.config = config or PublisherConfig(**kwargs)  # type: ignore[arg-type]
        rank = self.config.data_parallel_rank
        self.endpoint = (
            offset_endpoint(self.config.endpoint, rank) if rank is not None else self.config.endpoint
        )
        self.replay_endpoint = (
            offset_endpoint(self.config.replay_endpoint, rank)
            if rank is not None
            else self.config.replay_endpoint
        )
        self._topic = self.config.topic.encode()
        self._queue: queue.SimpleQueue[tuple[int, KVEventBatch] | None] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._next_seq = 0
        self._published = 0
        self._dropped = 0
        self._sent = 0
        self._replay_requests = 0
        self._replayed = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=self.config.buffer_steps
        )
        self._closing = threading.Event()
        self._drain_timeout = 2.0
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(
            target=self._run, name=f"kvevents-publisher-{self.endpoint}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    # -- caller side -------------------------------------------------------------

    def publish(self, batch: KVEventBatch) -> bool:
        seq = next(self._seq)
        self._next_seq = seq + 1
        self._published += 1
        # SimpleQueue has no bound of its own; its qsize() is exact and O(1). Concurrent
        # publishers can overshoot the bound by at most their number.
        if self._closing.is_set() or self._queue.qsize() >= self.config.max_queue_size:
            self._dropped += 1
            return False
        if self.config.data_parallel_rank is not None and batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.config.data_parallel_rank
        self._queue.put((seq, batch))
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        if self._closing.is_set():
            return
        self._drain_timeout = timeout
        self._closing.set()
        self._queue.put(None)  # wakes the thread at once
        self._thread.join(timeout + 1.0)

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self._published,
            sent=self._sent,
            dropped=self._dropped,
            replay_requests=self._replay_requests,
            replayed=self._replayed,
            queued=self._queue.qsize(),
            next_seq=self._next_seq,
        )

    # -- socket thread -------------------------------------------------------------

    def _binds(self, endpoint: str) -> bool:
        return should_bind(endpoint) if self.config.bind is None else self.config.bind

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        router = None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT too (IPv4 endpoints unchanged)
            (pub.bind if self._binds(self.endpoint) else pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.IPV6, 1)
                (router.bind if self._binds(self.replay_endpoint) else router.connect)(
                    self.replay_endpoint
                )
        except BaseException:
            # A failed start (a port taken) must not keep the other socket bound and open.
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            raise
        return pub, router

    def _run(self) -> None:
        try:
            pub, router = self._open()
        except BaseException as exc:  # reported to the constructor's caller
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        encoder = BatchEncoder(legacy=self.config.legacy_encoding)
        deadline: float | None = None
        try:
            while True:
                if router is not None:
                    self._serve_replays(router)
                try:
                    item = self._queue.get(timeout=self._IDLE_WAIT_S)
                except queue.Empty:
                    if self._closing.is_set():
                        break
                    continue
                if item is None:  # shutdown sentinel: drain what is left, bounded
                    deadline = time.monotonic() + self._drain_timeout
                    continue
                seq, batch = item
                try:
                    payload = encoder.encode(batch)
                except Exception:  # a batch the encoder rejects must not kill the thread
                    log.exception("dropping unencodable batch seq=%d", seq)
                    self._dropped += 1
                    continue
                self._buffer.append((seq, payload))
                try:
                    pub.send_multipart((self._topic, pack_seq(seq), payload), flags=zmq.NOBLOCK)
                    self._sent += 1
                except zmq.Again:
                    # No peer or HWM reached: the batch stays in the replay buffer, so a
                    # subscriber that sees the gap can still recover it.
                    pass
                if deadline is not None and time.monotonic() > deadline:
                    break
        except Exception:
            log.exception("publisher thread failed")
        finally:
            pub.close(linger=200)
            if router is not None:
                router.close(linger=0)

    def _serve_replays(self, router: zmq.Socket) -> None:
        while router.poll(0):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # Anything but [identity, b"", start] is ignored, as vLLM does.
            if len(frames) != 3 or frames[1] != b"":
                continue
            try:
                start = unpack_seq(frames[2])
            except ValueError:
                continue
            self._replay_requests += 1
            ident = frames[0]
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        router.send_multipart(
                            (ident, b"", self._topic, pack_seq(seq), payload), flags=zmq.NOBLOCK
                        )
                        self._replayed += 1
                router.send_multipart((ident, *replay_end_marker()), flags=zmq.NOBLOCK)
            except zmq.Again:
                # The requester is gone or not reading; it will time out and re-ask.
                continue

