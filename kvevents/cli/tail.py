"""``kvevents tail``: print every decoded event of one publisher, one line each.

Meant for debugging a deployment: point it at an engine's KV events endpoint (and its
replay endpoint to see gaps being recovered). Lines:

    seq=41 BlockStored tier=GPU blocks=2 block_size=16 parent=- tokens=[1, 2, 3, ...] hashes=[...]
    seq=42 BlockRemoved tier=CPU blocks=4
    seq=43 AllBlocksCleared
    GAP expected seq=44, received seq=47: asking for a replay
    seq=44 (replayed) BlockStored ...
    LOST 2 batches from seq=45: not in the publisher's replay buffer
    RESTART publisher went from seq=120 back to seq=0: state dropped

``tier`` is the event's wire field ``medium`` (vLLM's name; absent means GPU).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import TextIO

from kvevents.wire.schema import AllBlocksCleared, BlockRemoved, BlockStored, hash_to_str, medium_of
from kvevents.ingest.subscriber import (
    BatchesLost,
    BatchReceived,
    GapDetected,
    PublisherRestarted,
    Signal,
    SourceConfig,
    Subscriber,
)

_SHOW_TOKENS = 8
_SHOW_HASHES = 3


def _short(items: list, n: int, fmt=str) -> str:
    head = ", ".join(fmt(x) for x in items[:n])
    return f"[{head}{', ...' if len(items) > n else ''}]"


def format_signal(sig: Signal) -> list[str]:
    """The lines ``tail`` prints for one subscriber signal."""
    if isinstance(sig, BatchReceived):
        tag = f"seq={sig.seq}{' (replayed)' if sig.replayed else ''}"
        lines = []
        for ev in sig.batch.events:
            if isinstance(ev, BlockStored):
                parent = "-" if ev.parent_block_hash is None else hash_to_str(ev.parent_block_hash)
                lines.append(
                    f"{tag} BlockStored tier={medium_of(ev)} blocks={len(ev.block_hashes)} "
                    f"block_size={ev.block_size} tokens={len(ev.token_ids)} "
                    f"first={_short(ev.token_ids, _SHOW_TOKENS)} parent={parent} "
                    f"hashes={_short(ev.block_hashes, _SHOW_HASHES, hash_to_str)}"
                    + (f" lora={ev.lora_name}" if ev.lora_name else "")
                )
            elif isinstance(ev, BlockRemoved):
                lines.append(
                    f"{tag} BlockRemoved tier={medium_of(ev)} blocks={len(ev.block_hashes)} "
                    f"hashes={_short(ev.block_hashes, _SHOW_HASHES, hash_to_str)}"
                )
            elif isinstance(ev, AllBlocksCleared):
                lines.append(f"{tag} AllBlocksCleared")
        if not sig.batch.events:
            lines.append(f"{tag} (empty batch)")
        if sig.skipped_events:
            lines.append(f"{tag} SKIPPED {sig.skipped_events} undecodable events")
        return lines
    if isinstance(sig, GapDetected):
        return [
            f"GAP expected seq={sig.expected_seq}, received seq={sig.received_seq}: "
            f"{sig.received_seq - sig.expected_seq} batches missing"
        ]
    if isinstance(sig, BatchesLost):
        return [f"LOST {sig.count} batches from seq={sig.first_seq}: {sig.reason}"]
    if isinstance(sig, PublisherRestarted):
        return [
            f"RESTART publisher went from seq={sig.last_seq} back to seq={sig.new_seq}: "
            "state dropped"
        ]
    return []


def run_tail(
    endpoint: str,
    replay: str | None = None,
    topic: str = "",
    *,
    from_start: bool = False,
    bind: bool = False,
    max_batches: int | None = None,
    duration: float | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Follow one publisher until Ctrl-C, ``max_batches`` batches or ``duration`` s.

    Returns the process exit status (0). Endpoint errors raise ``ValueError``.
    """
    done = threading.Event()
    batches = 0

    def consume(sig: Signal) -> None:
        nonlocal batches
        for line in format_signal(sig):
            out.write(line + "\n")
        out.flush()
        if isinstance(sig, BatchReceived):
            batches += 1
            if max_batches is not None and batches >= max_batches:
                done.set()

    sub = Subscriber(consume)
    sub.add_source(
        SourceConfig(
            "tail", endpoint, replay_endpoint=replay, topic=topic, bind=bind,
            replay_from_start=from_start,
        )
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: done.set())
        signal.signal(signal.SIGTERM, lambda *_: done.set())
    out.write(f"# following {endpoint}" + (f" (replay {replay})" if replay else "") + "\n")
    out.flush()
    sub.start()
    deadline = None if duration is None else time.monotonic() + duration
    try:
        while not done.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            done.wait(0.1)
    finally:
        sub.stop()
        stats = sub.stats().get("tail")
        if stats is not None:
            out.write(
                f"# batches={stats.batches} replayed={stats.replayed_batches} gaps={stats.gaps} "
                f"lost={stats.lost_batches} restarts={stats.restarts} "
                f"malformed={stats.malformed_frames + stats.decode_errors}\n"
            )
            out.flush()
    return 0
