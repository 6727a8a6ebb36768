"""One followed publisher: its configuration, its counters, and the subscriber's
private per-source state (owned by the subscriber's loop thread).

The stream position (``expected``, ``live_high``, ``stream_high``, ``jump_streak``,
whether a replay is under way), the continuity digests and the delivery counters
(``batches``, ``last_seq``, ``last_batch_ts``) live in the source's compiled
:class:`~kvevents.ingest._zmqrecv.Cursor`, which the lane (the compiled receive-and-apply
pass) updates without the GIL; :class:`SourceState` and the live :class:`SourceStats`
read and write the same fields through properties, so the Python path and the lane
share one state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import zmq

from kvevents.ingest._zmqrecv import Cursor
from kvevents.wire.framing import check_engine_endpoint


@dataclass(frozen=True)
class SourceConfig:
    """One publisher to follow. ``replay_endpoint`` enables gap recovery. The service
    makes it from an :class:`~kvevents.engines.EngineSpec` (``spec.source()``); the
    endpoints are checked by the same rule (:func:`~kvevents.wire.framing.check_engine_endpoint`)."""

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
        check_engine_endpoint(self.endpoint, "endpoint", connect=not self.bind)
        if self.replay_endpoint is not None:
            check_engine_endpoint(self.replay_endpoint, "replay_endpoint", connect=True)


@dataclass
class SourceStats:
    """Counters of one source; written by the subscriber thread only."""

    batches: int = 0
    lane_batches: int = 0  # of ``batches``, those the lane applied (the compiled pass)
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
    socket_errors: int = 0  # failed socket operations (retried)
    seq_jumps: int = 0  # frames whose seq was beyond the window (dropped)
    continuity_checks: int = 0  # replayed batches that matched a remembered digest
    continuity_mismatches: int = 0  # ... that did not: a restarted publisher
    pending_dropped: int = 0  # held-back live messages dropped over the byte bound
    pending_bytes: int = 0  # held back now
    replaying: bool = False  # a replay is outstanding
    replay_from: int | None = None  # the seq the outstanding replay waits for
    replay_until: int | None = None  # the first held-back live seq (None: none held)
    initial_replay_done: bool = False  # first contact finished (replayed or live)


def _cursor_field(name: str, cursor: str = "_cursor") -> property:
    """A property that reads and writes the field ``name`` of ``self.<cursor>``."""
    def get(self):
        return getattr(getattr(self, cursor), name)

    def put(self, value) -> None:
        setattr(getattr(self, cursor), name, value)
    return property(get, put)


class _LiveStats(SourceStats):
    """A source's counters as the subscriber keeps them: ``batches``, ``lane_batches``,
    ``last_seq`` and ``last_batch_ts`` are its cursor's (the lane counts there).
    :meth:`snapshot` gives a plain :class:`SourceStats`."""

    batches = _cursor_field("batches")  # type: ignore[assignment]
    lane_batches = _cursor_field("lane_batches")  # type: ignore[assignment]
    last_seq = _cursor_field("last_seq")  # type: ignore[assignment]
    last_batch_ts = _cursor_field("last_batch_ts")  # type: ignore[assignment]

    def __init__(self, cursor: Cursor) -> None:
        self._cursor = cursor
        super().__init__()

    def snapshot(self) -> SourceStats:
        values = {k: v for k, v in vars(self).items() if k != "_cursor"}
        return SourceStats(**values, batches=self.batches, lane_batches=self.lane_batches,
                           last_seq=self.last_seq, last_batch_ts=self.last_batch_ts)


@dataclass
class SourceState:
    """The subscriber's private state of one source (loop thread only)."""

    config: SourceConfig
    cursor: Cursor = field(default_factory=Cursor)
    sub: zmq.Socket | None = None
    dealer: zmq.Socket | None = None  # one per source, reused across replays
    monitor: zmq.Socket | None = None
    # When to ask the replay endpoint for what the live socket has not brought (history
    # before first contact, or after a connect), and a connect's wait before the next one
    # (0: not after a connect); see ``ReplayClient._probe``.
    next_probe: float | None = None
    probe_wait: float = 0.0
    _replay_deadline: float | None = None
    replay_hard_deadline: float | None = None  # progress deadline of the same replay
    replay_cap: float | None = None  # absolute cap of the same replay
    replay_start: int = 0  # the seq the outstanding replay was asked from
    replay_high: int | None = None  # highest seq the outstanding replay has returned
    replay_sent: bool = False  # the outstanding request went out
    replay_retry_at: float = 0.0
    pending: deque[tuple[int, bytes]] = field(default_factory=deque)  # live, held back
    pending_bytes: int = 0
    verify: bool = False  # a continuity check is wanted (after a reconnect or a jump)
    ever_connected: bool = False
    open_retry_at: float = 0.0
    open_backoff: float = 0.0
    # When what the lane applied was last reported to the consumer (BatchesApplied).
    reported_at: float = 0.0
    lane_misses: int = 0  # drains in a row whose first message the lane did not take

    def __post_init__(self) -> None:
        self.stats: _LiveStats = _LiveStats(self.cursor)

    # The cursor's fields (see the module docstring).
    expected = _cursor_field("expected", "cursor")  # next seq to deliver; None before first contact
    live_high = _cursor_field("live_high", "cursor")  # highest seq seen on the live socket
    # Newest seq delivered (or restored from a snapshot) of the stream followed now; None
    # after a reset. Unlike stats.last_seq it forgets a restarted publisher's old seqs.
    stream_high = _cursor_field("stream_high", "cursor")
    jump_streak = _cursor_field("jump_streak", "cursor")
    digests = _cursor_field("digests", "cursor")  # what was delivered last, for continuity checks

    @property
    def replay_deadline(self) -> float | None:
        """Idle deadline, set while a replay is outstanding (live messages are then held
        back: the lane leaves them to the Python path)."""
        return self._replay_deadline

    @replay_deadline.setter
    def replay_deadline(self, value: float | None) -> None:
        self._replay_deadline = value
        self.cursor.replaying = value is not None
