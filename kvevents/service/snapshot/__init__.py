"""Durable restarts: snapshots of the index plus where each engine's stream stood.

A snapshot is one file::

    magic b"KVEVSNAP" | version u32 | meta length u32 | state length u64
    | blake2b-256 of (meta + state) | meta (JSON) | state (PrefixIndex.export_state())

``meta`` holds, per engine, its spec and the seq and publisher timestamp of the last batch
applied to ``state``: the anchor from which the engine's stream resumes. The pair is
captured atomically by the aggregator (under its apply lock), so ``state`` holds
exactly the batches up to each anchor.

Files in the data dir: ``snapshot.bin`` (current) and ``snapshot.prev.bin`` (the one
before), never more: a write goes to a temp file, is fsynced, the current file becomes
the previous one, the temp file is renamed into place, and the directory is fsynced.
A crash at any point leaves at least one whole, checksummed file. Reading checks
magic, version, lengths and digest before anything is used: a truncated, flipped or
foreign file is logged and skipped (the previous one is tried), never half-loaded.

Continuity on restore (:func:`check_continuity`): the publisher's replay buffer is
asked for the anchor seq; the batch it returns must carry the anchor's timestamp. A
different timestamp or no such batch means another publisher process (restarted,
seq went back or went past us); a first replayed seq above the anchor means the buffer
wrapped while we were down. Either way that engine's restored state cannot be vouched for
and is dropped, as the live loss rule does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from kvevents.wire.schema import peek_batch_ts
from kvevents.service.settings import AggregatorSettings, EngineSpec
from kvevents.wire.framing import END_SEQ, pack_seq, parse_replay_reply

if TYPE_CHECKING:
    from kvevents.index import PrefixIndex

log = logging.getLogger(__name__)

MAGIC = b"KVEVSNAP"
VERSION = 1
_HEADER = struct.Struct(">8sIIQ32s")
CURRENT = "snapshot.bin"
PREVIOUS = "snapshot.prev.bin"
# Bounds of what a reader accepts, so a corrupt length cannot make it allocate wildly.
MAX_META_BYTES = 64 * 1024 * 1024
MAX_STATE_BYTES = 64 * 1024 * 1024 * 1024


class SnapshotError(ValueError):
    """A snapshot that is not whole and ours: wrong magic/version, short, bad digest."""


@dataclass(frozen=True)
class EngineAnchor:
    """Where one engine's stream stood when the snapshot was taken."""

    spec: dict[str, Any]  # EngineSpec fields
    last_seq: int | None  # None: nothing applied yet
    last_ts: float | None  # publisher timestamp of batch ``last_seq``


@dataclass(frozen=True)
class Snapshot:
    created: float
    engines: dict[str, EngineAnchor]
    state: bytes  # PrefixIndex.export_state()


def encode(snap: Snapshot) -> bytes:
    meta = json.dumps({
        "created": snap.created,
        "engines": {name: {"spec": a.spec, "last_seq": a.last_seq, "last_ts": a.last_ts}
                    for name, a in snap.engines.items()},
    }, allow_nan=False).encode()
    digest = hashlib.blake2b(meta + snap.state, digest_size=32).digest()
    return _HEADER.pack(MAGIC, VERSION, len(meta), len(snap.state), digest) + meta + snap.state


def decode(data: bytes) -> Snapshot:
    """Parse and verify a whole snapshot; raises :class:`SnapshotError`."""
    if len(data) < _HEADER.size:
        raise SnapshotError(f"truncated: {len(data)} bytes, header is {_HEADER.size}")
    magic, version, meta_len, state_len, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("not a kvevents snapshot (bad magic)")
    if version != VERSION:
        raise SnapshotError(f"snapshot version {version}; this build reads {VERSION}")
    if meta_len > MAX_META_BYTES or state_len > MAX_STATE_BYTES:
        raise SnapshotError("implausible section lengths")
    body = memoryview(data)[_HEADER.size:]
    if len(body) != meta_len + state_len:
        raise SnapshotError(f"truncated or padded: body {len(body)} bytes, "
                            f"header says {meta_len + state_len}")
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise SnapshotError("checksum mismatch (corrupt file)")
    try:
        meta = json.loads(bytes(body[:meta_len]))
        # "pods": the key of snapshots written before engines were called engines.
        anchors = meta["engines"] if "engines" in meta else meta["pods"]
        engines = {name: EngineAnchor(p["spec"], p["last_seq"], p["last_ts"])
                   for name, p in anchors.items()}
        created = float(meta["created"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"bad metadata: {exc}") from None
    return Snapshot(created, engines, bytes(body[meta_len:]))


def write(data_dir: str | Path, data: bytes) -> Path:
    """Atomically make ``data`` the current snapshot, keeping the previous one.
    Raises ``OSError`` (the current file is then untouched)."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (CURRENT + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    cur = d / CURRENT
    if cur.exists():
        os.replace(cur, d / PREVIOUS)
    os.replace(tmp, cur)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames themselves must survive a power cut
    finally:
        os.close(fd)
    return cur


def read_latest(data_dir: str | Path) -> Snapshot | None:
    """The newest whole snapshot in ``data_dir`` (current, else previous), or None.
    Every file that fails verification is logged and skipped."""
    d = Path(data_dir)
    for name in (CURRENT, PREVIOUS):
        path = d / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.error("snapshot %s unreadable, ignored: %s", path, exc)
            continue
        try:
            snap = decode(data)
        except SnapshotError as exc:
            log.error("snapshot %s ignored: %s", path, exc)
            continue
        log.info("snapshot %s: %d engines, taken %.1f s ago", path, len(snap.engines),
                 time.time() - snap.created)
        return snap
    return None


def fetch_peer(url: str, token: str | None, timeout: float = 30.0) -> Snapshot:
    """A peer aggregator's current snapshot from ``GET {url}/v1/snapshot``.
    Raises ``OSError`` (unreachable, HTTP error) or :class:`SnapshotError`."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"bootstrap URL must be http(s)://HOST:PORT, got {url!r}")
    req = urllib.request.Request(url.rstrip("/") + "/v1/snapshot")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (checked scheme)
        return decode(resp.read())


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
