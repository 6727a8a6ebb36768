"""Restore on startup: load the newest snapshot (local, else a peer's) and keep only the
engines whose stream provably continues from their anchor.

Continuity (:func:`check_continuity`): the publisher's replay buffer is asked for the
anchor seq; the batch it returns must carry the anchor's timestamp. A different
timestamp or no such batch means another publisher process (restarted, seq went back or
went past us); a first replayed seq above the anchor means the buffer wrapped while we
were down. Either way that engine's restored state cannot be vouched for and is
dropped, as the live loss rule does.

(Not ``restore.py``: a submodule of that name would be shadowed by the package's
``restore`` function.)
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import zmq

from kvevents.service.settings import AggregatorSettings, EngineSpec
from kvevents.service.snapshot.format import EngineAnchor
from kvevents.service.snapshot.peer import fetch_peer
from kvevents.service.snapshot.store import read_latest
from kvevents.wire.framing import END_SEQ, pack_seq, parse_replay_reply
from kvevents.wire.schema import peek_batch_ts

if TYPE_CHECKING:
    from kvevents.index import PrefixIndex

# The package's logger, as before the split (one logger name for the whole feature).
log = logging.getLogger("kvevents.service.snapshot")

# -- continuity ------------------------------------------------------------------------

CONTINUOUS = "continuous"
RESTARTED = "restarted"
WRAPPED = "wrapped"
UNREACHABLE = "unreachable"


def check_continuity(replay_endpoint: str, last_seq: int, last_ts: float,
                     timeout: float) -> str:
    """Ask the publisher's replay buffer for batch ``last_seq`` and compare.

    Returns :data:`CONTINUOUS` (same batch: the stream we followed, resume at
    ``last_seq + 1``), :data:`WRAPPED` (the buffer starts after it), :data:`RESTARTED`
    (another batch at that seq, or none at all: a new process) or
    :data:`UNREACHABLE` (no answer within ``timeout``). One DEALER socket, closed
    before returning; bounded by ``timeout``.
    """
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", pack_seq(last_seq)))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not dealer.poll(int(left * 1000) + 1):
                break
            reply = parse_replay_reply(dealer.recv_multipart())
            if reply is None:
                continue
            seq, payload = reply
            if seq == END_SEQ:
                return RESTARTED  # the publisher never got as far as our anchor
            if seq > last_seq:
                return WRAPPED
            if seq == last_seq:
                return CONTINUOUS if peek_batch_ts(payload) == last_ts else RESTARTED
        return UNREACHABLE
    except zmq.ZMQError as exc:
        log.warning("continuity check on %s failed: %s", replay_endpoint, exc)
        return UNREACHABLE
    finally:
        dealer.close(linger=0)


# -- restore -----------------------------------------------------------------------------


def restore(index: PrefixIndex, settings: AggregatorSettings,
            stats: dict[str, Any]) -> dict[str, tuple[EngineSpec, EngineAnchor]]:
    """Load the newest snapshot (local, else the peer's) into ``index`` and return the
    engines to resume, each checked for continuity (in parallel, each bounded by
    ``replay_timeout_s``). Engines that cannot be vouched for have their restored state
    dropped here; ``stats["restored_engines"]`` / ``["dropped_engines"]`` count both.
    Nothing is imported from a snapshot that fails verification."""
    snap = read_latest(settings.data_dir) if settings.data_dir else None
    if snap is None and settings.bootstrap_from:
        try:
            snap = fetch_peer(settings.bootstrap_from, settings.auth_token)
            log.info("bootstrapped from %s: %d engines", settings.bootstrap_from, len(snap.engines))
        except (OSError, ValueError) as exc:
            log.error("bootstrap from %s failed, starting empty: %s", settings.bootstrap_from, exc)
    if snap is None:
        return {}
    try:
        index.import_state(snap.state)
    except ValueError as exc:
        log.error("snapshot index state rejected, starting empty: %s", exc)
        return {}

    def drop(name: str, why: str) -> None:
        index.drop_engine(name)
        stats["dropped_engines"] += 1
        log.warning("engine %s: restored state dropped (%s)", name, why)

    configured = {p.name: p for p in settings.engines}
    candidates: dict[str, tuple[EngineSpec, EngineAnchor]] = {}
    for name, anchor in snap.engines.items():
        try:
            spec = configured.get(name) or EngineSpec(**anchor.spec)
        except (TypeError, ValueError):
            spec = None
        same_stream = spec is not None and all(
            anchor.spec.get(k) == getattr(spec, k) for k in ("endpoint", "replay_endpoint", "topic"))
        if same_stream and anchor.last_seq is not None and spec.replay_endpoint:
            candidates[name] = (spec, anchor)
        else:
            drop(name, "no continuity anchor or replay endpoint" if same_stream else "stream changed")
    for name in index.engines():
        if name not in candidates:
            index.drop_engine(name)
    outcomes: dict[str, str] = {}
    if candidates:
        with ThreadPoolExecutor(min(32, len(candidates))) as pool:
            futures = {name: pool.submit(check_continuity, spec.replay_endpoint, a.last_seq,
                                         a.last_ts, settings.replay_timeout_s)
                       for name, (spec, a) in candidates.items()}
            outcomes = {name: f.result() for name, f in futures.items()}
    resume = {}
    for name, outcome in outcomes.items():
        if outcome in (CONTINUOUS, UNREACHABLE):
            # Unreachable: kept; a new process shows itself on the live stream (seq
            # back with a newer ts, or a gap replay cannot fill) and is dropped then.
            resume[name] = candidates[name]
            stats["restored_engines"] += 1
            log.info("engine %s restored at seq %d (%s)", name, candidates[name][1].last_seq, outcome)
        else:
            drop(name, outcome)
    return resume
