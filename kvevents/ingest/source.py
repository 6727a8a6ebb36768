"""One followed publisher: its configuration, its counters, and the subscriber's
private per-source state (owned by the subscriber's loop thread)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import zmq

from kvevents.ingest.continuity import DigestRing
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


@dataclass
class SourceState:
    """The subscriber's private state of one source (loop thread only)."""

    config: SourceConfig
    sub: zmq.Socket | None = None
    stats: SourceStats = field(default_factory=SourceStats)
    expected: int | None = None  # next seq to deliver; None before first contact
    dealer: zmq.Socket | None = None  # one per source, reused across replays
    monitor: zmq.Socket | None = None
    live_high: int | None = None  # highest seq seen on the live socket
    # Newest seq delivered (or restored from a snapshot) of the stream followed now; None
    # after a reset. Unlike stats.last_seq it forgets a restarted publisher's old seqs.
    stream_high: int | None = None
    next_probe: float | None = None  # when to ask for history before first contact
    replay_deadline: float | None = None  # idle deadline, set while a replay is outstanding
    replay_hard_deadline: float | None = None  # progress deadline of the same replay
    replay_cap: float | None = None  # absolute cap of the same replay
    replay_start: int = 0  # the seq the outstanding replay was asked from
    replay_high: int | None = None  # highest seq the outstanding replay has returned
    replay_sent: bool = False  # the outstanding request went out
    replay_retry_at: float = 0.0
    pending: deque[tuple[int, bytes]] = field(default_factory=deque)  # live, held back
    pending_bytes: int = 0
    digests: DigestRing = field(default_factory=DigestRing)
    verify: bool = False  # a continuity check is wanted (after a reconnect or a jump)
    ever_connected: bool = False
    jump_streak: int = 0
    open_retry_at: float = 0.0
    open_backoff: float = 0.0
